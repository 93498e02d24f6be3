"""shardmem: declarative sharding, per-layer rematerialization and ahead-of-time memory planning for
JAX/Flax training and serving.

    import shardmem
    config = shardmem.load_config("configs/llama-7b.yaml")
    report = shardmem.plan(config, target="h100-sxm")   # compiled deviceless; nothing allocated
    print(report.fits, report.per_device["peak"])
"""

import os as _os
from typing import TYPE_CHECKING as _TYPE_CHECKING

from shardmem import _interrupt

# `python -m shardmem` imports this package, JAX included (a second or more), before shardmem/__main__.py:
# a Ctrl-C meanwhile must end the command as later (exit 130, one line), not with an import traceback.
_interrupt.guard_the_command()

# The CUDA plugin ships with shardmem so that planning for GPUs works anywhere; on a machine without
# an NVIDIA driver it must not try to start a GPU client. Users can still set JAX_PLATFORMS themselves.
_NO_GPU = not _os.path.exists("/dev/nvidiactl")
if _NO_GPU:
    _os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from shardmem._quiet import native_stderr_silenced

    with native_stderr_silenced():
        import jax
    if _os.environ["JAX_PLATFORMS"] == "cpu":
        # Also when jax was imported before shardmem (and so before the variable was set).
        jax.config.update("jax_platforms", "cpu")

from shardmem.config import Config, config_from_dict, load_config  # noqa: E402
from shardmem.errors import ConfigError, PlanError, ShardmemError  # noqa: E402
from shardmem.models.kv_cache import CacheLayout, CacheSlot, KVCache  # noqa: E402
from shardmem.models.llama import CHECKPOINT_TAGS, PRESETS, Llama, ModelConfig  # noqa: E402
from shardmem.parallel.mesh import build_mesh  # noqa: E402
from shardmem.parallel.rules import Rules, constrain  # noqa: E402
from shardmem.planning.cost import StepTime  # noqa: E402
from shardmem.planning.memory import MemoryReport, analyze, make_target, plan, plan_function, plan_program  # noqa: E402
from shardmem.planning.report import render  # noqa: E402
from shardmem.planning.serving import ServingPlan, plan_serving  # noqa: E402
from shardmem.planning.targets import GPU_TARGETS, TPU_TARGETS, Target, ensure_cpu_devices, resolve_target  # noqa: E402
from shardmem.planning.timeline import Timeline, timeline  # noqa: E402
from shardmem.program import (  # noqa: E402
    Description,
    Program,
    ServingProgram,
    TrainingProgram,
    build_program,
    build_serving,
    build_training,
    describe,
    next_token_loss,
    serving_program,
)
from shardmem.remat import LayerPlan, ModulePlan, RematPolicy, remat_modules, remat_scan  # noqa: E402

__all__ = [
    "CHECKPOINT_TAGS",
    "GPU_TARGETS",
    "TPU_TARGETS",
    "PRESETS",
    "CacheLayout",
    "CacheSlot",
    "Config",
    "ConfigError",
    "Description",
    "KVCache",
    "LayerPlan",
    "Llama",
    "MemoryReport",
    "ModelConfig",
    "ModulePlan",
    "PlanError",
    "Program",
    "RematPolicy",
    "Rules",
    "ServingPlan",
    "ServingProgram",
    "ShardmemError",
    "StepTime",
    "Target",
    "Timeline",
    "TrainResult",
    "TrainingProgram",
    "analyze",
    "build_mesh",
    "build_program",
    "build_serving",
    "build_training",
    "config_from_dict",
    "constrain",
    "describe",
    "ensure_cpu_devices",
    "load_config",
    "make_target",
    "next_token_loss",
    "plan",
    "plan_function",
    "plan_program",
    "plan_serving",
    "remat_modules",
    "remat_scan",
    "render",
    "resolve_target",
    "serving_program",
    "timeline",
    "train",
]
__version__ = "0.1.0"

# Training needs Orbax and the run machinery, which planning never uses: imported on first use, so that
# `import shardmem` (and `shardmem plan`) does not pay for them.
_LAZY = {"TrainResult": "shardmem.run.training", "train": "shardmem.run.training"}
if _TYPE_CHECKING:  # Seen by type checkers and the API docs (griffe), not at run time.
    from shardmem.run.training import TrainResult, train


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardmem' has no attribute {name!r}")
