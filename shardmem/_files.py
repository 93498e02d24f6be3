"""Files shardmem writes for the user (an export, a plan's timeline, a sweep's tables), whole or not at all.

    folder = make_folder("exported/", "--out")                # a one-line ConfigError if it cannot be
    with staged([folder / "model.safetensors", folder / "config.json"], "--out") as temporaries:
        ...                                                   # write the temporaries
    # both renamed over their names here; an error or Ctrl-C inside the block leaves the old files

Each file is written to a temporary file beside it (the same file system, so the rename is atomic),
flushed to the disk, and renamed over its name only once every file of the block is complete: a full
disk, an error or an interruption leaves what was there before and no partial file. A path that cannot
be written (``/proc``, a folder under a file, a read-only disk, a full one) is a one-line ConfigError
naming the flag, the path and the reason.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path

from shardmem._interrupt import undone_on_interrupt
from shardmem.errors import ConfigError


def check_writable(path: str | Path, flag: str) -> None:
    """Raises ConfigError now, rather than after the work, when ``path`` cannot be written."""
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ConfigError(_problem(flag, path, e, "write")) from None
    if not existed:
        os.remove(path)


def make_folder(path: str | Path, flag: str) -> Path:
    """Returns ``path`` as a folder, created with its parents if need be; raises ConfigError for a path
    that is a file, is under a file or cannot be created."""
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{flag} {str(path)!r} is a file, not a folder; choose a folder (it is created)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(_problem(flag, path, e, "create the folder")) from None
    return folder


@contextlib.contextmanager
def staged(paths: Sequence[str | Path], flag: str) -> Iterator[list[Path]]:
    """Yields a temporary path beside each of ``paths`` (same suffix) for the block to write; when it
    ends, each is flushed to the disk and renamed over its path. On any error, including an OSError
    (raised as ConfigError naming ``flag``), and on Ctrl-C (which ends the process at once:
    :mod:`shardmem._interrupt`), the temporaries are removed and ``paths`` are as they were."""
    paths = [Path(p).expanduser() for p in paths]
    temporaries: list[Path] = []

    def remove_temporaries() -> None:
        for temporary in temporaries:
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)

    with undone_on_interrupt(remove_temporaries):
        try:
            for path in paths:
                if path.is_dir():
                    raise ConfigError(f"{flag} {str(path)!r} is a folder; give a file name")
                temporary = path.with_name(f".{path.stem}.{secrets.token_hex(4)}.partial{path.suffix}")
                with open(temporary, "xb"):  # Created now (the user's umask applies), written by the block.
                    temporaries.append(temporary)
            yield list(temporaries)
            for temporary in temporaries:
                _flush(temporary)
            for temporary, path in zip(temporaries, paths, strict=True):
                os.replace(temporary, path)
            with contextlib.suppress(OSError):  # The renames themselves on the disk (not every system can).
                _flush(paths[0].parent)
        except OSError as e:
            raise ConfigError(_problem(flag, paths[0], e, "write")) from None
        finally:
            remove_temporaries()


def write_file(path: str | Path, data: str | bytes, flag: str) -> Path:
    """Writes ``data`` to ``path`` whole or not at all (:func:`staged`); returns the path."""
    with staged([path], flag) as (temporary,):
        temporary.write_bytes(data.encode() if isinstance(data, str) else data)
    return Path(path)


def _flush(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _problem(flag: str, path, error: OSError, doing: str) -> str:
    """One line saying why ``path`` could not be written, and what to do."""
    where = f"{flag} {str(path)!r}"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"{where}: the disk is full; nothing was written (what was there is as it was): free space "
                "or choose another place")  # fmt: skip
    if error.errno in (errno.ENOTDIR, errno.EEXIST):
        return f"{where}: a part of the path is a file, not a folder; choose another path"
    return f"{where}: cannot {doing} there: {error.strerror or error}; choose another path"
