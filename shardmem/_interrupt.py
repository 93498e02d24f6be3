"""Ctrl-C for commands that only plan: ends the process within a moment, even inside an XLA compile.

    with ends_on_interrupt(lambda: print("what was done so far")):
        report = plan(config, "h100-sxm")

Python runs a SIGINT handler only between bytecodes of the main thread, so a compile (minutes in C++)
would swallow Ctrl-C until it returned, and the processes it started would each print a
``KeyboardInterrupt`` traceback of their own. Inside the block SIGINT is blocked in the main thread, so
every thread and process started there inherits the block (XLA's threads, the ``_quiet`` watcher,
tune's and sweep's spawned workers: none of them hears Ctrl-C), and one thread of ours waits for it:
it runs ``on_interrupt``, ends the processes this one started, prints ``shardmem: interrupted`` and
exits with status 130 at once. ``train`` handles SIGINT itself (it saves a checkpoint first).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

EXIT_INTERRUPTED = 130


@contextlib.contextmanager
def ends_on_interrupt(
    on_interrupt: Callable[[], None] | None = None, *, workers: bool = False
) -> Iterator[None]:
    """Inside the block, SIGINT ends the process (exit 130) within a moment, with one line on stderr
    after whatever ``on_interrupt`` prints, and no process of this one's left behind. ``workers``: the
    block starts ``multiprocessing`` processes. Outside the main thread the block changes nothing
    (signals are the main thread's to handle)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if workers:
        from multiprocessing import resource_tracker

        # Now, before SIGINT is blocked: starting the tracker unblocks SIGINT in the calling thread
        # afterwards, and the workers spawned after that would each take Ctrl-C for themselves.
        resource_tracker.ensure_running()
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # signal.set_wakeup_fd needs it.
    previous_handler = signal.signal(signal.SIGINT, lambda signum, frame: None)  # The thread acts.
    previous_wakeup = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    def wait() -> None:
        # The one thread that takes SIGINT (any other it reaches writes its number to the pipe, too).
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        while True:
            received = os.read(read_end, 1)
            if not received or received[0] == 0:  # The block ended: nothing to do.
                return
            if received[0] == signal.SIGINT:
                _interrupted(on_interrupt)

    waiter = threading.Thread(target=wait, name="shardmem-interrupt", daemon=True)
    waiter.start()
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        signal.set_wakeup_fd(previous_wakeup)
        signal.signal(signal.SIGINT, previous_handler)
        os.write(write_end, b"\0")
        waiter.join()
        os.close(read_end)
        os.close(write_end)


def _interrupted(on_interrupt: Callable[[], None] | None) -> None:
    from shardmem import _quiet

    _quiet.abandon()  # Stderr back, and no watcher to report this exit as a crash.
    if on_interrupt is not None:
        with contextlib.suppress(Exception):  # What is printed is a courtesy; the exit is the point.
            on_interrupt()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os.write(2, b"shardmem: interrupted\n")
    # The last word: the main thread, seeing its workers end, must not print their errors after it.
    silence = os.open(os.devnull, os.O_WRONLY)
    os.dup2(silence, 1)
    os.dup2(silence, 2)
    _end_children()  # tune's and sweep's workers, mid-compile.
    _forget_semaphores()
    _end_children()  # Any the main thread started since.
    os._exit(EXIT_INTERRUPTED)


def _end_children() -> None:
    for child in multiprocessing.active_children():
        with contextlib.suppress(Exception):
            child.kill()
    for child in multiprocessing.active_children():
        child.join(timeout=2)  # Reaped: no process left, not even a zombie.


def _forget_semaphores() -> None:
    """Unlinks the semaphores of the worker pools' queues and stops the resource tracker process, as a
    normal exit would; otherwise the tracker, left behind, warns about each semaphore as "leaked"."""
    from multiprocessing import resource_tracker, util

    with contextlib.suppress(Exception):
        util._run_finalizers(0)  # Priority 0 and up: semaphore clean-ups, not the joins of threads.
    with contextlib.suppress(Exception):
        resource_tracker._resource_tracker._stop()  # It exits once its pipe closes; reaped here.
