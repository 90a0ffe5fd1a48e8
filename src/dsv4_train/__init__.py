"""Training of the tiny arithmetic LM that ``dsv4 demo`` evaluates (``dsv4 train-tiny``,
``scripts/train_tiny.py``): a differentiable full-sequence DSV4 attention and LM, kept out of the
inference package ``dsv4``, which never imports it."""
