"""The error of an invalid configuration: its own module so that the config dialects
(:mod:`dsv4.dialects`), which :mod:`dsv4.config` reads, need not import the config."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value or combination is invalid; the message names the field."""
