"""Bad command-line input: the error class the ``dsv4`` command turns into one line on stderr
(exit code 2), and the argument checks that raise it. Imports torch only when a check needs it."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn


class UsageError(ValueError):
    """An argument of the ``dsv4`` command is invalid; the message names it."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """The parser of the ``dsv4`` command, its subcommands and its bench suites: a bad argument
    is one line on stderr, ``PROG: error: MESSAGE``, with exit code 2 (argparse's own prints
    the whole usage block before it); ``--help`` still prints the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def env_switch(name: str, value: str | None = None, *, default: bool) -> bool:
    """The on/off environment variable ``name`` (its ``value``, read from the environment when
    not given): ``0`` off, ``1`` on, unset or empty ``default``, else a UsageError naming the
    variable."""
    if value is None:
        value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise UsageError(f"{name} must be 0 or 1 (or unset), got {value!r}")
    return default if value == "" else value == "1"


def check_at_least(option: str, value: int | float, minimum: int | float, why: str = "") -> None:
    if value < minimum:
        raise UsageError(f"{option} {value}: must be at least {minimum}" + (f" ({why})" if why
                                                                             else ""))


def resolve_device(option_value: str | None) -> str:
    """The device to run on: the given one (checked: it must exist here), else cuda when
    available, else cpu."""
    import torch

    if option_value is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(option_value)
    except (RuntimeError, ValueError) as e:
        raise UsageError(f"--device {option_value}: not a device name ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {option_value}: CUDA is not available on this machine "
                             "(use --device cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"--device {option_value}: this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    elif dev.type not in ("cpu", "meta"):
        mod = getattr(torch, dev.type, None)
        if mod is not None and hasattr(mod, "is_available") and not mod.is_available():
            raise UsageError(f"--device {option_value}: {dev.type} is not available on this "
                             "machine")
    return option_value


def user_error_message(e: BaseException) -> str | None:
    """The message to print for an error caused by bad user input, or None for anything else
    (which keeps its traceback). Looks only at modules already imported."""
    if isinstance(e, UsageError):
        return str(e)
    known = [("dsv4.config", "ConfigError"), ("dsv4.checkpoint", "CheckpointError"),
             ("dsv4.platforms.registry", "UnknownPlatformError"),
             ("dsv4.platforms.registry", "PlatformUnavailableError"),
             ("dsv4.model.generate", "PromptError"), ("dsv4.weights", "WeightLoadError")]
    for module, name in known:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and isinstance(e, cls):
            return str(e)
    return None
