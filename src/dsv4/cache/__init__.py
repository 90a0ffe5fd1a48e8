"""dsv4's paged KV cache: rows stored in blocks of ``rows_per_block`` in one of the upstream row
formats (:mod:`dsv4.cache.formats`), addressed by flat row indices ``block * rows_per_block +
offset`` (-1: no row)."""
