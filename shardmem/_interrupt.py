"""Ctrl-C for the ``shardmem`` command: ends the process within a moment, even inside an XLA compile.

    with ends_on_interrupt(lambda: print("what was done so far")):
        report = plan(config, "h100-sxm")

Python runs a SIGINT handler only between bytecodes of the main thread, so a compile (minutes in C++)
would swallow Ctrl-C until it returned, and the processes it started would each print a
``KeyboardInterrupt`` traceback of their own. Worse, jaxlib polls for signals while it waits for a
compile and raises ``KeyboardInterrupt`` at once, while XLA's thread pool goes on compiling: the
interpreter then shuts down under that thread, which dereferences the freed client's device list when
the compile ends (a segmentation fault, exit 139: ``train`` did this 1.7-3 s after its start). And a
``KeyboardInterrupt`` that lands in a garbage-collection callback is printed as "Exception ignored" and
lost. So ``KeyboardInterrupt`` is never raised here: inside the block SIGINT is blocked in the main
thread, so every thread and process started there inherits the block (XLA's threads, the ``_quiet``
watcher, tune's and sweep's spawned workers: none of them hears Ctrl-C), and one thread of ours waits
for it: it runs ``on_interrupt`` and the undo steps of :func:`undone_on_interrupt`, ends the processes
this one started, prints ``shardmem: interrupted`` and exits with status 130 at once, without the
interpreter's shutdown. Before any block (while the command imports JAX, a second or more) the same
exit is a plain handler's (:func:`guard_the_command`). ``train``'s loop takes SIGINT over
(:func:`sigint_to_python`): it saves a checkpoint first. A process started with SIGINT ignored (a
shell's background job) ignores it throughout, as Python itself then does.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from shardmem import _quiet

EXIT_INTERRUPTED = 130

_undo_steps: list[Callable[[], None]] = []  # What an interrupt undoes first, innermost last.
_python_handles = threading.Event()  # Set inside sigint_to_python(): SIGINT is not ours to act on.


def guard_the_command() -> None:
    """From now on (until a block of this module takes over), Ctrl-C ends this process as an interrupted
    command does (exit 130, one line), where it is the ``shardmem`` command (``python -m shardmem`` or the
    console script); in a program that imports shardmem, nothing changes. Called first thing by the
    package, because ``python -m shardmem`` imports it, JAX included, before ``__main__`` runs. A process
    started with Ctrl-C ignored (a background job) keeps ignoring it."""
    if not _is_the_command() or _ignored(signal.SIGINT):
        return
    signal.signal(signal.SIGINT, lambda signum, frame: _interrupted(None))


def _ignored(signum: int) -> bool:
    """Whether this process ignores the signal ``signum`` (it started so, or its program set it so)."""
    return signal.getsignal(signum) is signal.SIG_IGN


def _is_the_command() -> bool:
    """Whether this process runs the ``shardmem`` command. While ``python -m shardmem`` imports the
    package, ``sys.argv[0]`` is "-m" (the module is still being located) and ``sys.orig_argv`` names it;
    the console script is a file named ``shardmem``."""
    argv = getattr(sys, "orig_argv", [])
    if sys.argv[:1] == ["-m"] and "-m" in argv:
        return argv[argv.index("-m") + 1 :][:1] == ["shardmem"]
    return os.path.basename(sys.argv[0]) == "shardmem" if sys.argv else False


@contextlib.contextmanager
def ends_on_interrupt(
    on_interrupt: Callable[[], None] | None = None, *, workers: bool = False
) -> Iterator[None]:
    """Inside the block, SIGINT ends the process (exit 130) within a moment, with one line on stderr
    after whatever ``on_interrupt`` prints, and no process of this one's left behind. ``workers``: the
    block starts ``multiprocessing`` processes. Outside the main thread the block changes nothing
    (signals are the main thread's to handle), nor in a process that ignores SIGINT (one started so, as
    a shell starts a background job: Ctrl-C is the foreground's, here as during the imports)."""
    if threading.current_thread() is not threading.main_thread() or _ignored(signal.SIGINT):
        yield
        return
    if workers:
        from multiprocessing import resource_tracker

        # Now, before SIGINT is blocked: starting the tracker unblocks SIGINT in the calling thread
        # afterwards, and the workers spawned after that would each take Ctrl-C for themselves. Its
        # stderr is /dev/null: after an interrupt it would warn of the worker pools' semaphores as
        # "leaked" (it still removes them), lines that follow "shardmem: interrupted".
        saved_stderr, silence = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(silence, 2)
        try:
            resource_tracker.ensure_running()
        finally:
            os.dup2(saved_stderr, 2)
            os.close(saved_stderr)
            os.close(silence)
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
            if received[0] == signal.SIGINT and not _python_handles.is_set():
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


@contextlib.contextmanager
def undone_on_interrupt(undo: Callable[[], None]) -> Iterator[None]:
    """While the block runs, an interrupt that ends the process calls ``undo`` first, so that what the
    block makes (a file it writes, a run directory it sets up) is not left behind half made. The main
    thread may still be at work as ``undo`` runs: undo what cannot be half there by the exit (remove a
    file, a folder this block created), nothing the block must finish."""
    _undo_steps.append(undo)
    try:
        yield
    finally:
        _undo_steps.remove(undo)


@contextlib.contextmanager
def sigint_to_python() -> Iterator[None]:
    """Inside the block, SIGINT runs the Python handler set for it (in the main thread, between
    bytecodes), also inside an :func:`ends_on_interrupt` block, which then leaves the process running:
    ``train``'s loop stops at the next step and saves."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _python_handles.set()
    try:
        yield
    finally:
        _python_handles.clear()


def _interrupted(on_interrupt: Callable[[], None] | None) -> None:
    _quiet.abandon()  # Stderr back, and no watcher to report this exit as a crash.
    if on_interrupt is not None:
        with contextlib.suppress(Exception):  # What is printed is a courtesy; the exit is the point.
            on_interrupt()
    for undo in reversed(_undo_steps):
        with contextlib.suppress(Exception):
            undo()
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
