"""One run per run directory: a lock file that names the run holding it.

    RunDirLock("runs/tiny").check()  # Before long work: ConfigError naming the holder, if another run has it
    with RunDirLock("runs/tiny") as lock:  # The same error, or the lock taken
        if lock.stale:
            print(f"took over the lock of {lock.stale}, which is gone")
        ...

The rule. The lock is ``<run dir>/run.lock``, held with ``flock`` by the run's process 0 (in a
multi-process run the others never touch it) and holding JSON ``{"host", "pid", "started",
"command"}`` of that process. The kernel releases a ``flock`` when its process dies, however it dies
(kill -9 included), so a lock that can be taken is never held by a live run: "dead" is what the file
system says. On one machine that is exact. On a shared file system the same holds across hosts where
the file system forwards locks (NFS does, as POSIX locks; Lustre with ``-o flock``); a host that dies
holding one loses it when the server's lease expires (NFS: about 90 s), and only then can another host
take it. Where the file system cannot lock at all (``flock`` fails with ENOLCK or EOPNOTSUPP), the file's
contents decide: a holder on this host is stale when its pid no longer runs; a holder on another host
cannot be checked from here, so it is respected until someone deletes the file. A clean exit empties the
file; contents found in a lock that could be taken mean a run that did not exit cleanly, reported as
``stale``. The file itself is never deleted: another run may be waiting on it.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from pathlib import Path
from typing import Self

from shardmem.errors import ConfigError

__all__ = ["RunDirLock"]

LOCK_NAME = "run.lock"


class RunDirLock:
    """The lock of ``run_dir`` (which must exist). :meth:`acquire` takes it or raises ConfigError naming
    the run that holds it; :meth:`release` (or leaving the ``with`` block) gives it back."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.stale: str | None = None  # The holder a taken-over stale lock named, described.
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"cannot create the lock {str(self.path)!r}: {e.strerror}; choose another "
                              "--run-dir") from None  # fmt: skip
        try:
            holder = self._take(fd)
            self.stale = _describe(holder) if holder else None
            _write_holder(fd, _this_process())
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def check(self) -> None:
        """Raises the ConfigError :meth:`acquire` would when another run holds the lock, without taking
        it or creating anything: for a check before long work (a plan's compile), the lock itself taken
        after it."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError:
            return  # No lock file (or none to open): no run holds it; acquire() says the rest.
        try:
            self._take(fd)
        finally:
            os.close(fd)  # Releases the flock it may have taken.

    def _take(self, fd: int) -> dict | None:
        """Flocks ``fd`` (or raises ConfigError naming the holder); returns the holder its file names."""
        holder = _read_holder(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(self._in_use(holder)) from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            if holder and not _is_gone(holder):  # No locks here: the contents decide.
                raise ConfigError(self._in_use(holder, unlockable=True)) from None
        return holder

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)  # Empty: the next run sees a clean hand-over, not a stale lock.
        os.close(self._fd)  # Closing releases the flock.
        self._fd = None

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def _in_use(self, holder: dict | None, unlockable: bool = False) -> str:
        who = _describe(holder) if holder else "another process (it has not written its name yet)"
        fix = "wait for it to finish or stop it, or choose another --run-dir"
        if unlockable:
            fix += f" (this file system cannot lock; if that run is gone, delete {str(self.path)!r})"
        return f"run directory {str(self.path.parent)!r} is in use by {who}; {fix}"


def _this_process() -> dict:
    argv = sys.argv[:]
    if argv and argv[0].endswith(("shardmem", "__main__.py")):  # `shardmem ...` or `python -m shardmem ...`
        argv[0] = "shardmem"
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(argv),
    }


def _describe(holder: dict) -> str:
    command = f" ({holder['command']})" if holder.get("command") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('started')}{command}"


def _read_holder(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    data = os.read(fd, 64 * 1024)
    try:
        holder = json.loads(data) if data.strip() else None
    except ValueError:
        return None  # Garbled: written by no run of ours, or cut short by a crash.
    return holder if isinstance(holder, dict) else None


def _write_holder(fd: int, holder: dict) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    os.fsync(fd)


def _is_gone(holder: dict) -> bool:
    """Whether the holder is known to have exited: only checkable for a process of this host."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # Alive, under another user.
    return False
