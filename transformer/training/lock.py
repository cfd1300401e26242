"""One writer per run directory: an advisory lock (`fcntl.flock` on `<run_dir>/.lock`, the holder's PID
inside) that a training run's rank 0 takes before anything writes there, Hydra's own output included
(`LockRunDirectory`). The operating system releases it when the process ends, however it ends, so a
lock left by a killed run never blocks the next."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from transformer.config import ConfigError
from transformer.utils.cli import exit_with_error

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
_held: dict[Path, list[int]] = {}  # run directory -> [file descriptor, times taken by this process]


def _forget_in_child() -> None:
    """A forked child (data preparation's workers) closes its copies of the lock files: the lock stays
    the parent's alone, and goes when the parent dies, whatever the children do."""
    for fd, _ in _held.values():
        os.close(fd)
    _held.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_in_child)


class RunDirectoryInUse(ConfigError):
    """Another live process holds the run directory's lock."""


def lock(run_dir: str | Path) -> None:
    """Take the run directory's lock for this process (again, if it holds it already: `unlock` as often
    releases it). Another process holding it: RunDirectoryInUse, naming the directory and its PID."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    key = run_dir.resolve()
    if key in _held:
        _held[key][1] += 1
        return
    fd = os.open(key / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is None:
            raise OSError(errno.ENOSYS, "no fcntl module")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirectoryInUse(
            f"{run_dir} is in use by another training run (PID {holder}); wait for it to end, stop it, "
            "or choose another trainer.run_dir"
        ) from None
    except OSError as error:  # a filesystem without flock (some network ones)
        log.warning(
            "%s: cannot lock the run directory (%s): nothing stops a second run from writing into it",
            run_dir,
            error.strerror or error,
        )
    else:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[key] = [fd, 1]


def unlock(run_dir: str | Path) -> None:
    """Give back one `lock` of the run directory; the last one releases it."""
    key = Path(run_dir).resolve()
    if key not in _held:
        return
    _held[key][1] -= 1
    if _held[key][1] == 0:
        fd, _ = _held.pop(key)
        os.close(fd)  # releases the flock; the file stays (removing it could race a waiting process)


class LockRunDirectory(Callback):
    """Hydra callback (configs/train.yaml): rank 0 takes the run directory's lock before Hydra writes
    its log and .hydra/ there, and keeps it through training and the finish stage; a sweep locks its
    directory (each job then locks its own when it trains)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._lock(config.hydra.run.dir)

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._unlock(config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._lock(config.hydra.sweep.dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._unlock(config.hydra.sweep.dir)

    @staticmethod
    def _lock(run_dir: str) -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            try:
                lock(run_dir)
            except RunDirectoryInUse as error:
                exit_with_error(error)

    @staticmethod
    def _unlock(run_dir: str) -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            unlock(run_dir)
