"""Keeps expected native (C++) log lines off the terminal, without hiding a native crash."""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator

# Runs in a small process of its own: it waits on a pipe that the block closes after writing one byte
# when it ends. End of file without that byte means the process died inside the block (XLA aborts on a
# failed check with SIGABRT, and nothing of Python runs after that), so the watcher prints the gist of
# what the native code wrote to the captured stderr, on the real one. Unless Ctrl-C came first: it
# reaches the terminal's whole process group, this watcher too, and an interrupted command ends its
# processes on purpose (tune's and sweep's workers are killed mid-compile, and their watchers see the
# same end of file as after a crash). So SIGINT stays blocked here, pending once it came. SIGTERM too: a
# scheduler (SLURM's time limit, `timeout`, `kill -- -PGID`) signals the whole process group, and `train`
# stops at its next step, saved, where a watcher that died of it would fail the parent's block.
_WATCHER = r"""
import os, re, signal, sys
stops = {signal.SIGINT, signal.SIGTERM}
signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # Ctrl-C and SIGTERM are the parent's: no traceback here.
if os.read(0, 1) or stops & signal.sigpending():
    sys.exit(0)
fd = int(sys.argv[1])
size = os.fstat(fd).st_size
lines = [l.strip() for l in os.pread(fd, 1 << 16, max(0, size - (1 << 16))).decode("utf-8", "replace")
         .splitlines() if l.strip()]
if not lines:
    sys.exit(0)
telling = [l for l in lines if re.search(r"what\(\):|Check failed|^[FE]\d{4} |FATAL|Fatal|error", l)]
line = re.sub(r"^.*what\(\):\s*", "", (telling or lines)[-1])
line = line if len(line) <= 400 else line[:397] + "..."
os.write(2, ("shardmem: error: the process died in native code (XLA) while compiling or starting "
             "devices; its last message: " + line + "\n").encode())
"""

_lock = threading.Lock()
_depth = 0
_watchers: list[subprocess.Popen] = []
_saved_stderr: int | None = None  # The real stderr while an outer block runs.


@contextlib.contextmanager
def native_stderr_silenced(*, watch: bool = False) -> Iterator[None]:
    """Sends file descriptor 2 to a temporary file while the block runs. On machines without an NVIDIA
    driver, loading the CUDA plugin (for deviceless GPU compiles) prints "Could not find cuda drivers"
    from C++; that is expected there, as are XLA's remat warnings on a plan that does not fit. Python
    exceptions still propagate normally. Should the process die inside the block (XLA aborting on a
    shape it cannot handle, exit status 134), a watcher process prints one line with the last message
    the native code wrote, instead of leaving the user with no output at all. Nested blocks (and a
    second thread's) share the outer one.

    The watcher is a process of its own, so only blocks that may abort ask for it (``watch=True``: the
    step's compile); the others (imports, device start-up) are only silenced, and leave no process
    behind that a launcher or a test would count as a child."""
    global _depth, _saved_stderr
    with _lock:
        _depth += 1
        outer = _depth == 1
    if not outer:
        try:
            yield
        finally:
            with _lock:
                _depth -= 1
        return
    _reap()
    saved = _saved_stderr = os.dup(2)
    capture = tempfile.TemporaryFile(prefix="shardmem-stderr-")
    read_end, write_end = os.pipe()
    watcher = None
    try:
        if watch:
            watcher = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WATCHER, str(capture.fileno())],
                stdin=read_end, stdout=subprocess.DEVNULL, stderr=saved, pass_fds=(capture.fileno(),),
            )  # fmt: skip
            _watchers.append(watcher)
    except OSError:
        pass  # No watcher (no processes left?): the block is only silenced, as it always was.
    finally:
        os.close(read_end)
    os.dup2(capture.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        _saved_stderr = None
        os.close(saved)
        if watcher is not None:
            with contextlib.suppress(OSError):  # A watcher killed meanwhile (SIGKILL) has nothing to hear.
                os.write(write_end, b"k")  # Ended alive: the watcher exits without a word.
        os.close(write_end)
        capture.close()
        if watcher is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                watcher.wait(timeout=2)  # Gone at once: no child left behind.
            _reap()
        with _lock:
            _depth -= 1


def say(text: str) -> None:
    """Writes ``text`` to the real stderr, also from inside a block (a progress line mid-compile)."""
    saved = _saved_stderr
    with contextlib.suppress(OSError):
        os.write(saved if saved is not None else 2, text.encode())


def abandon() -> None:
    """For a process about to exit on purpose mid-block (Ctrl-C): gives file descriptor 2 back to the
    real stderr, and ends the watchers at once without a word (they would report the exit as a crash
    in native code)."""
    saved = _saved_stderr
    if saved is not None:
        with contextlib.suppress(OSError):
            os.dup2(saved, 2)
    for watcher in _watchers:
        with contextlib.suppress(OSError):
            watcher.kill()
    for watcher in _watchers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            watcher.wait(timeout=2)
    _watchers.clear()


def _reap() -> None:
    """Collects watchers that have exited (each one does at once once its block ends)."""
    _watchers[:] = [w for w in _watchers if w.poll() is None]


@atexit.register
def _wait_for_watchers() -> None:
    for watcher in _watchers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            watcher.wait(timeout=5)
