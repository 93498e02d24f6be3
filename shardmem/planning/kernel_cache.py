"""XLA's cache of compiled GPU kernels for deviceless plans: a second plan of a model skips most of the code
generation that the memory report never reads.

A deviceless GPU compile spends much of its time after buffer assignment, generating one kernel at a time
(LLVM IR, PTX, then a ``ptxas`` process each, cheap ones in a plan: codegen.py; ``bench/plan_speed.py``
shows the split). None of that changes the buffers, the optimized HLO or the schedule the report reads,
and XLA can keep the kernels in a file (``xla_gpu_kernel_cache_file``), keyed by each fused computation's
fingerprint, so that the next compile that meets the same kernel reuses it. Every plan still runs XLA's
HLO passes and buffer assignment and writes the dump the report reads: unlike JAX's persistent
compilation cache, this cache cannot return a stale report; it only speeds up the plans after the first.

One file per jaxlib version and GPU generation lives in ``$SHARDMEM_KERNEL_CACHE`` (default
``$XDG_CACHE_HOME/shardmem/xla-kernels``, or ``~/.cache/shardmem/xla-kernels``; ``SHARDMEM_KERNEL_CACHE=off``
turns it off). Each compile works on a private copy, published with an atomic rename when the compile
succeeds, so plans running side by side never read a half-written file (the last one to finish wins;
a lost entry only costs its compile again). Only deviceless GPU compiles use it: their kernels never run.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

ENV = "SHARDMEM_KERNEL_CACHE"
OPTION = "xla_gpu_kernel_cache_file"
#: A file past this size is started afresh: XLA reads all of it on every compile.
MAX_BYTES = 64 << 20
_OFF = ("", "0", "off", "false", "no")


def cache_dir() -> Path | None:
    """Returns the folder of the kernel caches, or None when ``SHARDMEM_KERNEL_CACHE`` turns them off."""
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in _OFF else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "shardmem" / "xla-kernels"


def cache_file(target) -> Path | None:
    """Returns the cache file for a deviceless GPU ``target``, or None where no cache applies: attached
    devices (their kernels run), CPU and TPU targets, or the cache turned off."""
    folder = cache_dir()
    if folder is None or not target.deviceless or target.platform in ("cpu", "tpu"):
        return None
    import jax

    # Kernels are linked into one binary: never mix GPU generations, nor jaxlib versions (the file's format).
    chip = getattr(target.spec, "target_config", None)
    identity = chip() if callable(chip) else target.name
    key = hashlib.sha256(f"{jax.__version__}\n{identity}".encode()).hexdigest()[:16]
    return folder / f"{target.platform}-{key}.pb"


@contextlib.contextmanager
def private_copy(shared: Path | None) -> Iterator[str | None]:
    """Yields the path of a private copy of ``shared`` for one compile (None: no cache), and publishes the
    copy in its place when the block ends without an exception. A folder that cannot be written means
    no cache, never a failed plan."""
    private = None
    if shared is not None:
        try:
            shared.parent.mkdir(parents=True, exist_ok=True)
            handle, private = tempfile.mkstemp(prefix=f".{shared.name}.", dir=shared.parent)
            os.close(handle)
            with contextlib.suppress(FileNotFoundError):
                if shared.stat().st_size <= MAX_BYTES:
                    shutil.copyfile(shared, private)
            if not os.path.getsize(private):
                os.unlink(private)  # XLA starts a cache only where no file is (an empty one does not parse).
        except OSError:
            if private is not None:
                with contextlib.suppress(OSError):
                    os.unlink(private)
            private = None
    try:
        yield private
        if private is not None and os.path.exists(private):
            with contextlib.suppress(OSError):  # A cache that cannot be kept only slows the next plan.
                os.replace(private, shared)
    finally:
        if private is not None:
            with contextlib.suppress(OSError):
                os.unlink(private)


def discard(shared: Path | None) -> None:
    """Removes a cache file that XLA could not use (another version's format, a damaged file)."""
    if shared is not None:
        with contextlib.suppress(OSError):
            shared.unlink()
