"""Code generation for kernels that never run: deviceless GPU plans ask XLA for the cheapest it can do.

XLA's GPU compiler generates every kernel of the step after buffer assignment: an LLVM module each,
optimized, then handed to a ``ptxas`` process. Nothing the memory report reads (the buffers, the
optimized HLO, the schedule) depends on that code, and a deviceless plan never runs it; it was about
half of a first plan of ``configs/llama-70b.yaml`` on a 2-core machine (152 kernels; BENCHMARKS.md,
"Planning speed"). So a deviceless GPU compile gets, unless the user set the option themselves:

- ``xla_gpu_cuda_data_dir``: a folder whose ``bin/ptxas`` is a stand-in that answers ``--version`` and
  writes an empty cubin. XLA still finds libdevice, which it links into the kernels' LLVM code, where it
  always looks (the ``nvidia-cuda-nvcc-cu12`` wheel, a CUDA toolkit).
- ``xla_backend_optimization_level=0`` and ``xla_llvm_disable_expensive_passes``: LLVM without
  optimization.

``python bench/plan_speed.py options --real-codegen`` (the wheel's ptxas, LLVM -O2) checks that every
shipped config reports the same figures either way; tests/test_codegen.py checks it on a small model.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CUDA_DIR = "xla_gpu_cuda_data_dir"
#: LLVM without optimization: the kernels are never run, so nothing is gained by making them fast.
UNOPTIMIZED = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
#: XLA's own defaults for the same options, for comparing with them (bench/plan_speed.py --real-codegen).
OPTIMIZED = {"xla_backend_optimization_level": 2, "xla_llvm_disable_expensive_passes": False}
#: What the stand-in says it is: XLA asks the assembler its version and emits PTX that version reads.
VERSION = "Cuda compilation tools, release 12.9, V12.9.86"
SCRIPT = f"""#!/bin/sh
# shardmem's stand-in ptxas for deviceless plans, whose kernels never run: an empty cubin for each.
case " $* " in
  *" --version "*) echo "ptxas: NVIDIA (R) Ptx optimizing assembler"; echo "{VERSION}"; exit 0;;
esac
while [ $# -gt 0 ]; do
  if [ "$1" = -o ]; then shift; : > "$1" || exit 1; fi
  shift
done
"""


def deviceless_options(target, options: Mapping[str, Any]) -> dict[str, Any]:
    """XLA options that make a compile for ``target`` generate its kernels cheaply, none that the user's
    ``options`` set: deviceless GPU targets only (attached GPUs run their kernels; CPU and TPU compilers
    take none of these)."""
    if not target.deviceless or target.platform in ("cpu", "tpu"):
        return {}
    ours = {key: value for key, value in UNOPTIMIZED.items() if key not in options}
    stand_in = None if CUDA_DIR in options else stand_in_cuda_dir()
    return ours if stand_in is None else {**ours, CUDA_DIR: stand_in}


def wheel_cuda_dir() -> str | None:
    """The CUDA folder of the ``nvidia-cuda-nvcc-cu12`` wheel (a real ptxas), or None without the wheel."""
    spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


@functools.cache
def stand_in_cuda_dir() -> str | None:
    """Returns a folder holding only ``bin/ptxas``, the stand-in, made once per process and removed at
    exit; None where it cannot run (a temporary folder mounted noexec, no ``/bin/sh``): XLA's own ptxas
    is used then, which is only slower."""
    try:
        root = Path(tempfile.mkdtemp(prefix="shardmem-ptxas-"))
        atexit.register(shutil.rmtree, root, True)
        script = root / "bin" / "ptxas"
        script.parent.mkdir()
        script.write_text(SCRIPT)
        script.chmod(0o755)
        answer = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return str(root) if VERSION in answer.stdout else None
