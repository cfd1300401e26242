"""Atomic, durable file writes: a file appears under its final name only complete, and the name survives
a power loss, so a crash or a kill never leaves half a checkpoint, shard or translation behind.

Every rename of a finished file goes through `rename`: it syncs the file's bytes, renames it, then syncs
the directory that holds the new name (without that, some filesystems can lose the rename itself).
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

TEMP_SUFFIX = ".tmp"


@contextmanager
def writing(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file that appears under `path` only complete: temp name beside it, fsync, rename."""
    path = Path(path)
    try:
        with open(temp := temp_name(path), "xb") as file:
            yield file
        rename(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def write_bytes(path: str | Path, data: bytes) -> None:
    """`data` as the whole file at `path`, written atomically."""
    with writing(path) as file:
        file.write(data)


def temp_name(path: Path) -> Path:
    """A hidden, unique name beside `path` that `remove_temp_files` clears after a crash."""
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def rename(source: str | Path, target: str | Path) -> None:
    """Move the finished file or directory `source` to `target` (replacing a file there), durably: its
    bytes (each file and folder in it) are synced first, the directory holding `target` after."""
    source, target = Path(source), Path(target)
    # its files and folders deepest first, then itself
    tree = [*sorted(source.rglob("*"), reverse=True), source] if source.is_dir() else [source]
    for path in tree:
        if path.is_dir():
            sync_directory(path)
        else:
            with open(path, "rb+") as file:  # writable: Windows syncs no read-only handle
                os.fsync(file.fileno())
    os.replace(source, target)
    sync_directory(target.parent)


def sync_directory(directory: str | Path) -> None:
    """fsync a directory, so the names created, renamed or removed in it persist (a no-op where the
    platform cannot open or sync a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError as error:
        if error.errno in (errno.EACCES, errno.EISDIR):  # Windows opens no directories
            return
        raise
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):  # filesystems syncing no directory
            raise
    finally:
        os.close(fd)


def remove_temp_files(directory: Path) -> None:
    """Remove what an interrupted write left behind in `directory` (temp files never carry a final name)."""
    for temp in directory.glob(f".*{TEMP_SUFFIX}"):
        temp.unlink(missing_ok=True)
