"""Test support that ships with the package, so that a platform can be checked on any machine:
the override contract (:mod:`dsv4.testing.contract`), spies on a layer's forward
(:mod:`dsv4.testing.probes`), the naive float64 evaluation of the spec
(:mod:`dsv4.testing.naive_reference`), seeded random weights
(:mod:`dsv4.testing.random_weights`) and ``dsv4 verify`` (:mod:`dsv4.testing.verify`,
:mod:`dsv4.testing.verify_tp`)."""
