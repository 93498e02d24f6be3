"""Keeps expected native (C++) log lines off the terminal."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Sends file descriptor 2 to /dev/null while the block runs. On machines without an NVIDIA
    driver, loading the CUDA plugin (for deviceless GPU compiles) prints "Could not find cuda drivers"
    from C++; that is expected there. Python exceptions still propagate normally."""
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
