"""Multi-process start-up: ``jax.distributed`` from flags, env vars or a detected cluster.

Call :func:`initialize` first thing, before any JAX computation; it is a no-op for a single
process (:func:`start` calls it, then starts the backends, for ``train`` and ``generate``, which run a
config's mesh over all the processes). :func:`launch` runs N local processes that find each other over
loopback, the way a cluster scheduler would start them on N hosts::

    # in the program (python -m shardmem ...):
    shardmem.run.distributed.initialize()

    # on one machine, 2 processes with 4 simulated CPU devices each:
    launch(2, ["train", "configs/tiny.yaml"], devices_per_process=4)

Settings come from, in order: explicit arguments; ``SHARDMEM_COORDINATOR`` (``HOST:PORT``),
``SHARDMEM_NUM_PROCESSES``, ``SHARDMEM_PROCESS_ID`` and ``SHARDMEM_LOCAL_DEVICES``; a cluster
that JAX can read by itself (SLURM, Open MPI, Kubernetes indexed jobs).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO

import jax

from shardmem.errors import ConfigError

__all__ = ["initialize", "start", "detected_cluster", "launch"]

ENV_COORDINATOR = "SHARDMEM_COORDINATOR"
ENV_NUM_PROCESSES = "SHARDMEM_NUM_PROCESSES"
ENV_PROCESS_ID = "SHARDMEM_PROCESS_ID"
ENV_LOCAL_DEVICES = "SHARDMEM_LOCAL_DEVICES"
ENV_LAUNCHER_PID = "SHARDMEM_LAUNCHER_PID"  # Set by launch(): the worker ends when that process is gone.

# A peer that stops sending heartbeats (killed, its host lost) ends the others after this long, through
# JAX's coordination service; JAX's default, 100 s, is more than a scheduler's patience.
HEARTBEAT_TIMEOUT_S = 30
# After the launcher is gone, a worker gets SIGTERM (it saves and exits) and is ended this long after.
ORPHAN_GRACE_S = 40
_PR_SET_PDEATHSIG = 1
# Runs first in each launched child: arms the parent-death signal, then becomes the real command (a
# preexec_fn would do it too, but forks this process, which JAX warns can deadlock when threaded).
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "if sys.platform.startswith('linux'): ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)\n"
    "os.execvp(sys.argv[1], sys.argv[1:])"
)
# Start-up chatter of the gloo CPU collectives: "[Gloo] Rank R is connected to P peer ranks. Expected
# number of connected peer ranks is : P", once per process and collective context. gloo writes it in
# pieces from several threads, so two contexts' lines can interleave ("[Gloo] Rank [Gloo] Rank 1 is
# connected ..." then "1 is connected ..."): a line made only of its pieces and numbers, with "[Gloo]"
# or "peer ranks" in it, is chatter.
_GLOO_PIECES = re.compile(
    r"\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is\s*:|\d+|\s+"
)
_GLOO_MARKS = re.compile(r"\[Gloo\]|peer ranks")


def detected_cluster() -> str | None:
    """Returns "slurm", "openmpi" or "kubernetes" when this process runs in a multi-process job."""
    if "SLURM_JOB_ID" in os.environ and _int_or(os.environ.get("SLURM_NTASKS"), 1) > 1:
        return "slurm"
    if _int_or(os.environ.get("OMPI_COMM_WORLD_SIZE"), 1) > 1:
        return "openmpi"
    if "JOB_COMPLETION_INDEX" in os.environ:
        return "kubernetes"
    return None


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_count: int | None = None,
) -> None:
    """Joins this process to a multi-process JAX run, or does nothing for a single process.

    Must run before JAX creates its devices. ``local_device_count`` simulates that many CPU
    devices in this process (``jax_num_cpu_devices``). Calling it again is a no-op.
    """
    if local_device_count is None:
        local_device_count = _env_int(ENV_LOCAL_DEVICES)
    if local_device_count is not None:
        _set_cpu_device_count(local_device_count)
    _watch_launcher()
    if jax.distributed.is_initialized():
        return
    coordinator = coordinator if coordinator is not None else os.environ.get(ENV_COORDINATOR)
    if num_processes is None:
        num_processes = _env_int(ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _env_int(ENV_PROCESS_ID)
    _validate(coordinator, num_processes, process_id)
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    cluster = detected_cluster()
    if all(value is None for value in given.values()) and cluster is None:
        return
    if num_processes == 1 and coordinator is None:
        return
    if cluster is None and any(value is None for value in given.values()):
        missing = [name for name, value in given.items() if value is None]
        raise ConfigError(
            f"Multi-process run needs --coordinator, --num-processes and --process-id, but {missing} "
            f"{'is' if len(missing) == 1 else 'are'} unset (no SLURM, Open MPI or Kubernetes job "
            f"detected to fill them in); pass them or set {ENV_COORDINATOR}, "
            f"{ENV_NUM_PROCESSES} and {ENV_PROCESS_ID}."
        )
    # Cross-process collectives on CPU need gloo; GPU and TPU backends ignore this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
        )
    except RuntimeError as error:  # raised when JAX already created its devices
        raise ConfigError(
            f"Could not join the multi-process run ({error}); call "
            "shardmem.run.distributed.initialize() before any JAX computation."
        ) from error
    except ValueError as error:  # JAX could not fill in what the cluster left out
        found = f"Detected a {cluster} job, but" if cluster else "With the settings given,"
        raise ConfigError(
            f"{found} JAX could not work out the rest of the multi-process "
            f"settings ({error}); set {ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and "
            f"{ENV_PROCESS_ID} explicitly."
        ) from error


def start(
    mesh_devices: int,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_devices: int | None = None,
) -> None:
    """Joins a multi-process run (:func:`initialize`) and starts JAX's backends, for a command that runs a
    mesh of ``mesh_devices`` devices over all the processes (``train``, ``generate``); call it before
    anything touches a JAX device.

    Simulates ``local_devices`` CPU devices (or ``SHARDMEM_LOCAL_DEVICES``), by default as many as the
    mesh needs split over the processes; the other arguments are :func:`initialize`'s. JAX's preemption
    notifier, which a multi-process run installs, takes SIGTERM over: a command that does not stop by
    itself on it sets its own handler after this.
    """
    from shardmem._quiet import native_stderr_silenced
    from shardmem.planning.targets import ensure_cpu_devices

    if local_devices is None and not os.environ.get(ENV_LOCAL_DEVICES):
        processes = num_processes or os.environ.get(ENV_NUM_PROCESSES) or "1"
        # A malformed count is reported by initialize() below; plan for one process meanwhile.
        processes = max(int(processes), 1) if str(processes).isdigit() else 1
        ensure_cpu_devices(-(-mesh_devices // processes))
    initialize(coordinator, num_processes, process_id, local_devices)
    with native_stderr_silenced():
        jax.devices()  # Start the backends now, without the CUDA stub's expected complaint.


def launch(
    nproc: int,
    argv: Sequence[str],
    *,
    devices_per_process: int | None = None,
    port: int | None = None,
    command: Sequence[str] | None = None,
    grace_seconds: float = 10.0,
) -> int:
    """Runs ``nproc`` local processes of ``command + argv``; returns the first non-zero exit code.

    ``command`` defaults to ``python -m shardmem``. Each process gets ``SHARDMEM_*`` variables
    for a coordinator on ``127.0.0.1:port`` (a free port if None), and every line it prints is
    echoed to this process's stdout prefixed by ``[i] `` (but gloo's "Rank N is connected to M
    peer ranks" start-up lines). SIGINT and SIGTERM are forwarded to all processes. When one process
    fails, a line on stderr names it and how it ended (exit code or signal), and the others get
    SIGTERM, then SIGKILL after ``grace_seconds``. A process killed by signal ``s`` counts as exit
    code ``128 + s``. No process outlives the launcher: if it dies, even by kill -9, each gets SIGTERM
    (a training run saves and exits), and one that calls :func:`initialize` ends for good at most
    ``ORPHAN_GRACE_S`` later.
    """
    _check_positive("--nproc", nproc)
    if devices_per_process is not None:
        _check_positive("--local-devices", devices_per_process)
    if port is None:
        port = _free_port()
    elif not 0 < port < 65536:
        raise ConfigError(f"port={port} is not a TCP port; use 1024-65535, or None for a free one")
    prefix = list(command) if command is not None else [sys.executable, "-m", "shardmem"]
    children: list[subprocess.Popen[bytes]] = []
    outputs = []
    for index in range(nproc):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env[ENV_COORDINATOR] = f"127.0.0.1:{port}"
        env[ENV_NUM_PROCESSES] = str(nproc)
        env[ENV_PROCESS_ID] = str(index)
        env[ENV_LAUNCHER_PID] = str(os.getpid())
        if devices_per_process is not None:
            env[ENV_LOCAL_DEVICES] = str(devices_per_process)
        # Output goes to an unlinked file that this process tails, not to a pipe: if the launcher dies,
        # a pipe would break under the child, whose next print would then fail before it could save.
        output = tempfile.TemporaryFile()
        outputs.append(output)
        # A session of its own: only our forwarding signals it, and killpg reaches its children.
        children.append(
            subprocess.Popen(
                [sys.executable, "-c", _DIE_WITH_PARENT, *prefix, *argv],
                env=env,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    lock = threading.Lock()
    echoes = [
        threading.Thread(target=_echo, args=(f"[{i}] ", output, child, lock), daemon=True)
        for i, (child, output) in enumerate(zip(children, outputs, strict=True))
    ]
    for echo in echoes:
        echo.start()
    with _forwarding_signals(children):
        exit_code = _wait_all(children, grace_seconds)
    for echo in echoes:
        echo.join(timeout=5)
    for output in outputs:
        output.close()
    return exit_code


def _wait_all(children: list[subprocess.Popen[bytes]], grace_seconds: float) -> int:
    """Waits for every child; after the first failure names it, terminates the rest, then kills them."""
    first_failure = 0
    kill_at: float | None = None
    while any(child.poll() is None for child in children):
        for index, child in enumerate(children):
            code = child.poll()
            if code and not first_failure:
                first_failure = 128 - code if code < 0 else code
                others = [i for i, other in enumerate(children) if other.poll() is None]
                stopping = f"; stopping process {', '.join(map(str, others))}" if others else ""
                print(f"shardmem launch: process {index} (pid {child.pid}) {_how_it_ended(code)}{stopping}",
                      file=sys.stderr, flush=True)  # fmt: skip
                _signal_all(children, signal.SIGTERM)
                kill_at = time.monotonic() + grace_seconds
        if kill_at is not None and time.monotonic() > kill_at:
            _signal_all(children, signal.SIGKILL)
            kill_at = None
        time.sleep(0.05)
    if not first_failure:
        codes = [child.returncode for child in children if child.returncode]
        first_failure = (128 - codes[0] if codes[0] < 0 else codes[0]) if codes else 0
    return first_failure


class _forwarding_signals:
    """Context manager: while active, SIGINT and SIGTERM are passed on to the children."""

    def __init__(self, children: list[subprocess.Popen[bytes]]) -> None:
        self.children = children
        self.previous: dict[int, object] = {}

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed from the main thread
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.previous[signum] = signal.signal(
                signum, lambda received, _frame: _signal_all(self.children, received)
            )

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]


def _signal_all(children: list[subprocess.Popen[bytes]], signum: int) -> None:
    for child in children:
        if child.poll() is None:
            try:
                os.killpg(child.pid, signum)
            except ProcessLookupError:
                pass  # exited between poll and kill


def _how_it_ended(code: int) -> str:
    """Returns "exited with code 3" or "was killed by SIGKILL (signal 9)" for a Popen return code."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "an unknown signal"
    return f"was killed by {name} (signal {-code})"


def _watch_launcher() -> None:
    """In a process started by :func:`launch`: make sure it ends when the launcher is gone.

    The kernel's parent-death signal (armed by the ``_DIE_WITH_PARENT`` shim, renewed here) arrives the
    moment the launcher dies, even by kill -9, and becomes one SIGTERM, so a training run stops like a
    preempted one: it saves and exits. Should it not get that far (say, stuck in a collective with a
    dead peer), a watch thread ends the process ``ORPHAN_GRACE_S`` later.

    The kernel sends the parent-death signal each time it reparents the process, and a dying launcher
    can reparent it twice: to one of its threads still alive, then to init. Two SIGTERMs would end a run
    in the middle of its save (a second SIGTERM means "now"), so from here the death signal is SIGHUP,
    whose handler sends SIGTERM once. Before this runs, the shim's SIGTERM simply ends the process."""
    text = os.environ.pop(ENV_LAUNCHER_PID, "")  # Not for this process's own children.
    if not text.isdigit():
        return
    launcher = int(text)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGHUP, _launcher_gone)
        _set_parent_death_signal(signal.SIGHUP)
    else:  # Python handlers are installed from the main thread only: keep the shim's SIGTERM.
        _set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != launcher:  # Died before the signal was armed.
        _launcher_gone(signal.SIGHUP, None)

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(0.5)
        time.sleep(ORPHAN_GRACE_S)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="shardmem-launcher-watch", daemon=True).start()


_launcher_gone_seen = False


def _launcher_gone(signum: int, frame) -> None:
    """The parent-death signal's handler: the first one sends this process SIGTERM, later ones nothing."""
    global _launcher_gone_seen
    if not _launcher_gone_seen:
        _launcher_gone_seen = True
        os.kill(os.getpid(), signal.SIGTERM)


def _set_parent_death_signal(signum: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)


def _echo(prefix: str, output: IO[bytes], child: subprocess.Popen[bytes], lock: threading.Lock) -> None:
    """Prints each line ``child`` writes to ``output`` (a file, read at our own offset), prefixed."""
    offset, pending = 0, b""
    while True:
        exited = child.poll() is not None  # Before reading: what it wrote before exiting is read below.
        chunk = os.pread(output.fileno(), 1 << 16, offset)
        if chunk:
            offset += len(chunk)
            *lines, pending = (pending + chunk).split(b"\n")
            _print_lines(prefix, lines, lock)
        elif exited:
            _print_lines(prefix, [pending] if pending else [], lock)
            return
        else:
            time.sleep(0.05)


def _print_lines(prefix: str, lines: list[bytes], lock: threading.Lock) -> None:
    with lock:
        for raw in lines:
            line = raw.decode("utf-8", errors="replace")
            if not _is_gloo_chatter(line):
                sys.stdout.write(f"{prefix}{line}\n")
        sys.stdout.flush()


def _is_gloo_chatter(line: str) -> bool:
    return bool(_GLOO_MARKS.search(line)) and not _GLOO_PIECES.sub("", line)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _set_cpu_device_count(count: int) -> None:
    _check_positive("--local-devices", count, ENV_LOCAL_DEVICES)
    if jax.config.jax_num_cpu_devices == count:
        return
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError as error:
        raise ConfigError(
            f"--local-devices {count} ({ENV_LOCAL_DEVICES}) came after JAX had already "
            "created its devices; call shardmem.run.distributed.initialize() before any JAX "
            "computation"
        ) from error


def _validate(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    if coordinator is not None:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"--coordinator {coordinator} (or {ENV_COORDINATOR}) is not HOST:PORT; "
                "use e.g. 10.0.0.1:1234 or 127.0.0.1:1234"
            )
    if num_processes is not None:
        _check_positive("--num-processes", num_processes, ENV_NUM_PROCESSES)
    if process_id is not None:
        if process_id < 0:
            raise ConfigError(f"--process-id {process_id} (or {ENV_PROCESS_ID}) must be 0 or more")
        if num_processes is not None and process_id >= num_processes:
            raise ConfigError(
                f"--process-id {process_id} (or {ENV_PROCESS_ID}) must be below "
                f"--num-processes {num_processes} (or {ENV_NUM_PROCESSES}); use 0 to {num_processes - 1}"
            )


def _check_positive(flag: str, value: int, env_var: str = "") -> None:
    """Raises ConfigError naming the flag (and the variable that can also set it) unless ``value`` >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        source = f" (or {env_var})" if env_var else ""
        raise ConfigError(f"{flag} {value!r}{source} must be a positive integer; use e.g. {flag} 1")


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} must be an integer; set it to one, or unset it") from None


def _int_or(text: str | None, default: int) -> int:
    try:
        return int(text) if text else default
    except ValueError:
        return default
