"""Atomic file writes: a file appears under its final name only complete, so a crash or a kill
never leaves half a checkpoint, shard or translation behind."""

from __future__ import annotations

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
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")  # hidden, unique
    try:
        with open(temp, "xb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def write_bytes(path: str | Path, data: bytes) -> None:
    """`data` as the whole file at `path`, written atomically."""
    with writing(path) as file:
        file.write(data)


def remove_temp_files(directory: Path) -> None:
    """Remove what an interrupted write left behind in `directory` (temp files never carry a final name)."""
    for temp in directory.glob(f".*{TEMP_SUFFIX}"):
        temp.unlink(missing_ok=True)
