"""Replace a folder's contents all at once: write a new version into a temporary sibling folder,
then swap it in by renaming.

After :func:`replace_folder` the target holds exactly the files the writer produced, or, if the
writer (or the swap) failed, exactly what it held before. Only folders whose every entry the
caller recognises as its own are replaced, so files someone else put there are never deleted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


class FolderOwnershipError(ValueError):
    """The target folder holds entries the caller did not write; nothing was changed."""


def foreign_entries(folder: Path, is_ours: Callable[[str], bool]) -> list[str]:
    """Names in ``folder`` that ``is_ours`` does not claim (sub-folders are never ours)."""
    return sorted(p.name for p in folder.iterdir() if not (p.is_file() and is_ours(p.name)))


def _sibling(folder: Path, tag: str) -> Path:
    return folder.parent / f".{folder.name}.{tag}-{uuid.uuid4().hex[:8]}"


def replace_folder(folder: str | Path, write: Callable[[Path], list[Path]],
                   is_ours: Callable[[str], bool], what: str = "files") -> list[Path]:
    """Run ``write(tmp)`` in a fresh sibling of ``folder`` and swap the result in.

    ``write`` returns the paths it wrote (inside ``tmp``); the same names inside ``folder`` are
    returned. The new folder is created with the user's umask; a folder that existed keeps its
    permission bits. Raises :class:`FolderOwnershipError` (before writing anything) when
    ``folder`` is a file or holds entries ``is_ours`` does not claim.
    """
    folder = Path(folder).resolve()
    if folder.exists() and not folder.is_dir():
        raise FolderOwnershipError(f"{folder} is a file, not a folder")
    existed = folder.is_dir()
    if existed:
        foreign = foreign_entries(folder, is_ours)
        if foreign:
            raise FolderOwnershipError(
                f"{folder} holds entries that are not {what}: {foreign}; refusing to replace "
                "its contents (save into an empty or new folder, or remove them)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(folder, "new")
    tmp.mkdir()  # the user's umask applies, like any folder they create
    try:
        written = write(tmp)
        if existed:
            shutil.copymode(folder, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = _sibling(folder, "old") if existed else None
    try:
        if old is not None:
            os.rename(folder, old)
        os.rename(tmp, folder)
    except BaseException:
        if old is not None and old.exists() and not folder.exists():
            os.rename(old, folder)  # put the previous version back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        with contextlib.suppress(OSError):
            shutil.rmtree(old)
    return [folder / p.name for p in written]
