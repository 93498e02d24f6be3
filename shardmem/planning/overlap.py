"""The XLA options that overlap a GPU step's collectives with its compute: one definition, which the
plan's compile and ``train``'s use alike, so that what a plan predicts is what runs.

    options = overlap.step_options(target, config.memory.compiler_options)   # the user's win

What production JAX training on GPUs sets (MaxText's GPU scripts, NVIDIA JAX-Toolbox's
``rosetta/docs/GPU_performance.md``, Paxml's GPU recipes), and what shardmem takes:

- ``xla_gpu_enable_latency_hiding_scheduler``: schedule async collectives early and their ``-done``
  late, across independent compute. Taken.
- pipelined all-gather / reduce-scatter / all-reduce: move a loop's collective into the previous (for
  all-gathers) or next (reduce-scatters, all-reduces) iteration, so that the layer scan's FSDP
  gather of layer i + 1 runs under layer i's compute. Taken, except where a program turns pipelined
  all-gather off (``Program.overlap_off``, :func:`shardmem.program.parallelism.overlap_exceptions`: sequence
  parallelism with per-device gradient accumulation, whose forward XLA's pipeliner cloned). XLA 0.10
  (JAX 0.10.2) spells them ``xla_gpu_enable_pipelined_{all_gather,reduce_scatter,all_reduce}=true``;
  XLA 0.12 replaced them with ``xla_gpu_pipeline_{...}=COLLECTIVE_PIPELINING_MODE_ON`` (the old names
  are refused as compile options; ``_OFF`` turns one off). Each is written in the spelling the
  running XLA accepts (:func:`supported`).
- ``xla_gpu_enable_while_loop_double_buffering``: unrolls loops by two so a pipelined collective has
  a buffer to land in. Taken, except where a step loops over micro-batches with no parameter split over
  a batch axis (:func:`~shardmem.program.parallelism.overlap_exceptions`): there it has no FSDP gather
  to land and only raised the peak (MaxText notes an OOM for 405B with it).
- combine thresholds (``xla_gpu_{all_reduce,all_gather,reduce_scatter}_combine_threshold_bytes``) and
  ``..._combine_by_dim=false``: per-model tuning in those recipes (1 GiB, 128 MiB, 32-64 MiB, divided by
  the GPU count in some); not taken, XLA's defaults stand (a user may set them in
  ``memory.compiler_options``).
- ``xla_gpu_enable_highest_priority_async_stream``: on by default in XLA 0.10-0.12; not set.
- ``xla_disable_hlo_passes=rematerialization``, ``xla_gpu_enable_triton_gemm=false``: not overlap;
  not taken (the first changes the memory verdict, the second is the plan's own retry).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp

#: Each overlap option as (name, value) spellings, newest XLA first; the first the running XLA accepts
#: is used.
GPU_OVERLAP: dict[str, tuple[tuple[str, Any], ...]] = {
    "latency hiding scheduler": (("xla_gpu_enable_latency_hiding_scheduler", True),),
    "pipelined all-gather": (
        ("xla_gpu_pipeline_all_gather", "COLLECTIVE_PIPELINING_MODE_ON"),
        ("xla_gpu_enable_pipelined_all_gather", True),
    ),
    "pipelined reduce-scatter": (
        ("xla_gpu_pipeline_reduce_scatter", "COLLECTIVE_PIPELINING_MODE_ON"),
        ("xla_gpu_enable_pipelined_reduce_scatter", True),
    ),
    "pipelined all-reduce": (
        ("xla_gpu_pipeline_all_reduce", "COLLECTIVE_PIPELINING_MODE_ON"),
        ("xla_gpu_enable_pipelined_all_reduce", True),
    ),
    "loop double buffering": (("xla_gpu_enable_while_loop_double_buffering", True),),
}


@functools.cache
def supported(name: str, value: Any) -> bool:
    """Whether the running XLA accepts compile option ``name=value`` (a trivial compile, on the CPU where
    JAX has one: the options are one proto for every backend, and an unknown name or enum value is
    refused)."""
    try:
        device = jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS names no CPU: the attached GPU compiles it as well.
        device = jax.devices()[0]
    one = jax.sharding.SingleDeviceSharding(device)
    lowered = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((), jnp.float32, sharding=one))
    try:
        lowered.compile(compiler_options={name: value})
    except Exception:  # XLA's INVALID_ARGUMENT, a plain runtime error.
        return False
    return True


def gpu_options(off: Collection[str] = ()) -> dict[str, Any]:
    """Returns the overlap options for a GPU step in the running XLA's spelling, those named in ``off``
    (keys of :data:`GPU_OVERLAP`) set off."""
    unknown = set(off) - set(GPU_OVERLAP)
    if unknown:
        raise ValueError(f"not overlap options: {sorted(unknown)}; known: {sorted(GPU_OVERLAP)}")
    options = {}
    for key, spellings in GPU_OVERLAP.items():
        found = next(((name, value) for name, value in spellings if supported(name, value)), None)
        if found:
            options[found[0]] = _off(found[1]) if key in off else found[1]
    return options


def _off(value: Any) -> Any:
    return value.replace("_MODE_ON", "_MODE_OFF") if isinstance(value, str) else False


def step_options(target, user_options: Mapping[str, Any], off: Collection[str] = ()) -> dict[str, Any]:
    """Returns the XLA options to compile a training step for ``target`` with: the overlap options on
    GPU targets (deviceless or attached), less those the program turns ``off`` (``Program.overlap_off``),
    then ``user_options`` (``memory.compiler_options``) over them."""
    ours = gpu_options(off) if target.platform in ("cuda", "gpu", "rocm") else {}
    return {**ours, **user_options}
