"""Bad command-line input: the error class the ``dsv4`` command turns into one line on stderr
(exit code 2), and the argument checks that raise it. Imports torch only when a check needs it."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn


class UsageError(ValueError):
    """An argument of the ``dsv4`` command is invalid; the message names it."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """The parser of the ``dsv4`` command, its subcommands and its bench suites: a bad argument
    is one line on stderr, ``PROG: error: MESSAGE``, with exit code 2 (argparse's own prints
    the whole usage block before it); ``--help`` still prints the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")

    @contextlib.contextmanager
    def usage_errors(self) -> Iterator[None]:
        """Checks after parsing (paths, devices, ranges): a :class:`UsageError` raised inside
        becomes this parser's one-line error (exit code 2), as a bad option value would."""
        try:
            yield
        except UsageError as e:
            self.error(str(e))


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
    if not value >= minimum:  # NaN fails too
        raise UsageError(f"{option} {value}: must be at least {minimum}" + (f" ({why})" if why
                                                                             else ""))


def check_positive(option: str, value: float, why: str = "") -> None:
    """A finite number > 0 (a time budget, a learning rate): 0, negatives, NaN and inf are
    usage errors."""
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"{option} {value}: must be a positive number" + (f" ({why})" if why
                                                                            else ""))


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (a file there is reported by the caller)."""
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path.cwd()  # unreachable: '/' exists


def _check_writable_folder(option: str, path: Path, folder: Path) -> None:
    """Create and remove an empty probe folder in ``folder``: the only test that also holds
    for root, read-only mounts and pseudo file systems such as /proc. Leaves nothing behind."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dsv4-write-check-", dir=folder))
    except OSError as e:
        raise UsageError(f"{option} {path}: cannot write in {folder} "
                         f"({e.strerror or e})") from None


def check_output_dir(option: str, path: Path) -> None:
    """A folder the command creates or writes into, checked before any work: it is no file,
    no file stands where one of its parents should be, and the nearest existing one of them
    is a folder this process can write in. Writes nothing."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path}: is a file, not a folder")
    base = _nearest_existing(path)
    if not base.is_dir():
        raise UsageError(f"{option} {path}: {base} is a file, not a folder")
    _check_writable_folder(option, path, base)


def check_output_file(option: str, path: Path) -> None:
    """A file the command writes, checked before any work: not a folder, and its folder exists
    and can be written in. Writes nothing."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{option} {path}: is a folder; give a file name")
    parent = path.parent
    if not parent.exists():
        raise UsageError(f"{option} {path}: folder {parent} does not exist")
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: {parent} is a file, not a folder")
    _check_writable_folder(option, path, parent)


def resolve_device(option_value: str | None) -> str:
    """The device to run on: the given one (checked: it must exist here and hold data, so not
    ``meta``), else cuda when available, else cpu."""
    import torch

    if option_value is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(option_value)
    except (RuntimeError, ValueError) as e:
        raise UsageError(f"--device {option_value}: not a device name ({e})") from None
    if dev.type == "meta":
        raise UsageError(f"--device {option_value}: the meta device holds no data, so nothing "
                         "can run on it (use --device cpu or cuda)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {option_value}: CUDA is not available on this machine "
                             "(use --device cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"--device {option_value}: this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
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
             ("dsv4.tinylm.generate", "PromptError"), ("dsv4.weights", "WeightLoadError")]
    for module, name in known:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and isinstance(e, cls):
            return str(e)
    return None
