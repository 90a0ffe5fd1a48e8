"""Benchmarks that ship with the package (``dsv4 bench``)."""
