"""The memory reporter: compile the real training step ahead of time and say whether it fits.

    report = shardmem.plan(load_config("configs/llama-7b.yaml"), target="h100-sxm")
    report.per_device["peak"], report.budget_bytes, report.fits
    print(render(report))              # or report.to_json()

Nothing the size of the model is allocated: the step is traced on abstract shapes, lowered with the
config's shardings and compiled by XLA for the target (deviceless for named GPUs). The figures are XLA's
(``memory_analysis`` and its buffer live-range analysis); parameter and optimizer bytes are also derived
from shapes and shardings alone as a cross-check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from shardmem._quiet import native_stderr_silenced
from shardmem.config import Config, MemoryConfig
from shardmem.errors import ConfigError, PlanError
from shardmem.parallel.mesh import build_mesh
from shardmem.parallel.rules import rule_warnings
from shardmem.planning import hlo
from shardmem.planning.targets import Target, ensure_cpu_devices, resolve_target
from shardmem.step import LossFn, ModelFactory, Program, build_program, next_token_loss
from shardmem.units import format_bytes

#: The per-device figures of a report, in the order tables show them.
CATEGORIES = ("params", "optimizer", "batch", "outputs", "temp", "alias", "host", "code", "peak")


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """What one compiled step needs per device, against the budget of the target it was compiled for.

    ``per_device`` holds integer bytes for :data:`CATEGORIES`. ``flops_per_step`` counts every matrix
    multiplication of the whole step across all devices, recomputation included; ``flops_no_remat``
    is the same step without rematerialization (None when not computed).
    """

    name: str
    target: str
    target_label: str
    approximate: bool
    devices: int
    mesh: dict[str, int]
    per_device: dict[str, int]
    device_memory_bytes: int
    budget_bytes: int
    fits: bool
    deviceless_margin: float
    flops_per_step: float
    flops_no_remat: float | None
    top_buffers: list[hlo.LiveBuffer]
    collectives: dict[str, int]
    cross_check: dict[str, Any]
    remat: str
    warnings: list[str]
    compile_seconds: float
    sharding: list = dataclasses.field(default_factory=list, repr=False)
    attention: str = ""  # The attention kernel planned, and what a stand-in stands for.
    jax_version: str = jax.__version__  # Plans move with the XLA version (BENCHMARKS.md).

    @property
    def margin_bytes(self) -> int:
        """Budget minus peak: negative when the step does not fit."""
        return self.budget_bytes - self.per_device["peak"]

    @property
    def recompute_overhead(self) -> float | None:
        """Extra matmul FLOPs from rematerialization, as a fraction of the step without it."""
        if not self.flops_no_remat:
            return None
        return self.flops_per_step / self.flops_no_remat - 1.0

    def to_json(self) -> dict[str, Any]:
        """Returns the report as plain JSON-ready data (the ``--json`` output)."""
        return {
            "name": self.name,
            "target": self.target,
            "target_label": self.target_label,
            "approximate": self.approximate,
            "devices": self.devices,
            "mesh": self.mesh,
            "remat": self.remat,
            "attention": self.attention,
            "per_device": self.per_device,
            "device_memory_bytes": self.device_memory_bytes,
            "budget_bytes": self.budget_bytes,
            "deviceless_margin": self.deviceless_margin,
            "fits": self.fits,
            "margin_bytes": self.margin_bytes,
            "flops_per_step": self.flops_per_step,
            "flops_no_remat": self.flops_no_remat,
            "recompute_overhead": self.recompute_overhead,
            "top_buffers": [dataclasses.asdict(b) for b in self.top_buffers],
            "collectives": self.collectives,
            "cross_check": self.cross_check,
            "warnings": self.warnings,
            "compile_seconds": round(self.compile_seconds, 3),
            "jax_version": self.jax_version,
        }


def budget(
    memory: MemoryConfig, device_memory_bytes: int, allocator_limit: int | None = None, *, deviceless=False
) -> int:
    """Returns the bytes a step may use: device memory x usable_fraction (no more than the allocator's
    limit on an attached GPU) - reserve; for a deviceless GPU compile, divided by 1 + deviceless_margin,
    the measured gap between deviceless and real-GPU compiles."""
    limit = int(device_memory_bytes * memory.usable_fraction)
    if allocator_limit:
        limit = min(limit, allocator_limit)
    if limit <= memory.reserve:
        raise ConfigError(
            f"memory.reserve={format_bytes(memory.reserve)} leaves no budget: it is not below the usable "
            f"{format_bytes(limit)} (device {format_bytes(device_memory_bytes)} x memory.usable_fraction="
            f"{memory.usable_fraction:g}{', capped by the allocator' if limit == allocator_limit else ''}); "
            "lower memory.reserve or raise memory.usable_fraction"
        )
    margin = memory.deviceless_margin if deviceless else 0.0
    return int((limit - memory.reserve) / (1 + margin))


def make_target(config: Config, target: str | None = None) -> Target:
    """Resolves the target (``config.memory.target`` by default) for the config's mesh."""
    name = target or config.memory.target
    if name == "local":
        if os.environ.get("JAX_PLATFORMS") == "cpu":
            ensure_cpu_devices(config.mesh.device_count())  # CPU-only: simulate the mesh's devices.
        with native_stderr_silenced():
            return resolve_target("local", n_devices=len(jax.devices()))
    n_devices = config.mesh.device_count()
    mesh = config.mesh
    fixed = math.prod(mesh.axes.values())
    if -1 not in mesh.axes.values() and mesh.devices_per_host and fixed != n_devices:
        axes = ", ".join(f"{k}: {v}" for k, v in mesh.axes.items())
        per_host = fixed // mesh.hosts
        fix = f"set mesh.devices_per_host={per_host}" if fixed % mesh.hosts == 0 else "change mesh.hosts"
        raise ConfigError(
            f"mesh.axes {{{axes}}} multiply to {fixed}, but the plan is for {n_devices} devices "
            f"(mesh.hosts={mesh.hosts} x mesh.devices_per_host={mesh.devices_per_host}); make the axes "
            f"multiply to {n_devices}, set one to -1, or {fix}"
        )
    if name == "cpu":
        ensure_cpu_devices(n_devices)
    return resolve_target(name, n_devices=n_devices, hosts=config.mesh.hosts)


def plan(
    config: Config,
    target: str | None = None,
    *,
    model_factory: ModelFactory | None = None,
    loss_fn: LossFn = next_token_loss,
    top: int = 10,
    count_remat_overhead: bool = True,
) -> MemoryReport:
    """Compiles the config's training step for ``target`` and returns its :class:`MemoryReport`.

    ``model_factory(rngs)`` plans a user's own Flax NNX module (its logical axis names, with the
    config's mesh, rules and remat) instead of the reference model.
    """
    resolved = make_target(config, target)
    mesh = build_mesh(config.mesh.axes, resolved.devices)
    program = build_program(config, mesh, model_factory=model_factory, loss_fn=loss_fn)
    report, _ = plan_program(program, resolved, top=top, count_remat_overhead=count_remat_overhead)
    return report


def plan_program(
    program: Program, target: Target, *, top: int = 10, count_remat_overhead: bool = True
) -> tuple[MemoryReport, jax.stages.Compiled]:
    """Plans a built program (its mesh over ``target.devices``) and returns the report with the compiled
    step, which runs on attached devices: ``shardmem train`` steps with it rather than compiling again."""
    traced = program.step.trace(program.abstract_state, program.abstract_batch)
    state = program.abstract_state
    groups = {
        "params": state["params"],
        "optimizer": {"opt_state": state["opt_state"], "step": state["step"]},
        "batch": program.abstract_batch,
    }
    config = program.config
    report, compiled = _compile_and_analyze(traced, target, config.memory, groups=groups, top=top,
                                            name=config.name)  # fmt: skip
    rows = program.sharding_table()
    warnings = rule_warnings(rows, program.rules, program.mesh) + report.warnings
    attention = program.attention.describe() if program.attention else ""
    report = dataclasses.replace(report, flops_per_step=hlo.matmul_flops(traced.jaxpr), warnings=warnings,
                                 sharding=rows, attention=attention)  # fmt: skip
    if program.custom_model:  # A user's module: its remat is its own business, no baseline to compare with.
        return report, compiled
    layer_plan = config.remat_plan()
    baseline = report.flops_per_step  # Without remat the step is its own baseline.
    if any(p.remats for p in layer_plan.policies):
        baseline = None
        if count_remat_overhead:  # Tracing the step without remat costs no compile.
            plain = build_program(config.replace("remat.policy=none", "remat.layers={}"), program.mesh)
            baseline = hlo.matmul_flops(plain.step.trace(plain.abstract_state, plain.abstract_batch).jaxpr)
    return dataclasses.replace(report, flops_no_remat=baseline, remat=layer_plan.describe()), compiled


def plan_function(
    fn: Callable | Any,
    *abstract_args,
    target: Target,
    memory: MemoryConfig | None = None,
    groups: Mapping[str, Any] | None = None,
    name: str = "function",
    top: int = 10,
) -> MemoryReport:
    """Plans any jitted function on abstract arguments (``jax.ShapeDtypeStruct`` with shardings over
    ``target.devices``): bring your own model and step. ``groups`` names argument subtrees
    (e.g. ``{"params": abstract_params}``) whose per-device bytes the report lists separately."""
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    traced = jitted.trace(*abstract_args)
    report = analyze(traced, target, memory or MemoryConfig(), groups=groups or {}, top=top, name=name)
    return dataclasses.replace(report, flops_per_step=hlo.matmul_flops(traced.jaxpr))


def per_device_bytes(tree, *, host: bool = False) -> int:
    """Bytes one device holds of a tree of sharded abstract (or concrete) arrays in its own memory, or
    with ``host=True`` in pinned host memory (``memory.offload_optimizer``)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        on_host = getattr(leaf.sharding, "memory_kind", None) == "pinned_host"
        if on_host != host:
            continue
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def analyze(
    traced,
    target: Target,
    memory: MemoryConfig,
    *,
    groups: Mapping[str, Any],
    top: int = 10,
    name: str = "run",
) -> MemoryReport:
    """Lowers and compiles a traced step for ``target`` and reads XLA's memory analysis."""
    return _compile_and_analyze(traced, target, memory, groups=groups, top=top, name=name)[0]


def _compile_and_analyze(
    traced, target: Target, memory: MemoryConfig, *, groups: Mapping[str, Any], top: int, name: str
) -> tuple[MemoryReport, jax.stages.Compiled]:
    limit = budget(memory, target.memory_bytes, target.allocator_limit, deviceless=target.deviceless)
    start = time.perf_counter()
    with _persistent_cache_off(), tempfile.TemporaryDirectory(prefix="shardmem-xla-") as dump:
        try:
            # XLA's own remat pass logs to stderr when a plan exceeds the device; the report says it.
            with native_stderr_silenced():
                compiled = traced.lower().compile(
                    compiler_options={"xla_dump_to": dump, "xla_dump_hlo_as_text": True}
                )
        except Exception as e:  # XLA raises plain runtime errors for programs it cannot compile.
            raise PlanError(f"XLA could not compile the step for {target.label}: {e}") from None
        seconds = time.perf_counter() - start
        top_buffers, live_peak = hlo.live_at_peak(dump, top=top)
        collectives = hlo.collective_bytes(compiled.as_text() or "")
    stats = compiled.memory_analysis()
    if stats is None:
        raise PlanError(f"XLA gave no memory analysis for {target.label}")

    per_device = {key: per_device_bytes(tree) for key, tree in groups.items()}
    host_arguments = sum(per_device_bytes(tree, host=True) for tree in groups.values())
    arguments = stats.argument_size_in_bytes
    accounted = sum(per_device.values())
    xla_host = (stats.host_temp_size_in_bytes + stats.host_argument_size_in_bytes
                + stats.host_output_size_in_bytes - stats.host_alias_size_in_bytes)  # fmt: skip
    per_device.update(
        outputs=stats.output_size_in_bytes,
        temp=stats.temp_size_in_bytes,
        alias=stats.alias_size_in_bytes,
        host=max(xla_host, host_arguments),
        code=stats.generated_code_size_in_bytes,
    )  # fmt: skip
    if host_arguments and not stats.host_argument_size_in_bytes:
        arguments -= host_arguments  # The CPU compiler counts pinned-host arrays among the arguments.
    resident = arguments + stats.output_size_in_bytes - stats.alias_size_in_bytes
    xla_peak = getattr(stats, "peak_memory_in_bytes", 0) or 0
    if target.platform == "cpu" or not xla_peak:
        # The CPU compiler's peak ignores temporaries; add them (an upper bound, marked approximate).
        peak = resident + stats.temp_size_in_bytes
    else:
        peak = xla_peak
    per_device["peak"] = int(peak)
    for key in ("params", "optimizer", "batch"):
        per_device.setdefault(key, 0)

    cross_check = {
        "analytic_argument_bytes": accounted,
        "compiled_argument_bytes": arguments,
        "matches": not groups or accounted == arguments,
        "live_range_peak_bytes": live_peak,
    }
    warnings = []
    if groups and accounted != arguments:
        warnings.append(
            f"analytic argument bytes ({accounted}) differ from XLA's ({arguments}): some "
            "arguments are laid out or sharded differently than their shardings say"
        )
    mesh = _mesh_of(groups)
    return MemoryReport(
        name=name, target=target.name, target_label=target.label, approximate=target.approximate,
        devices=len(target.devices), mesh=mesh, per_device=per_device,
        device_memory_bytes=target.memory_bytes, budget_bytes=limit, fits=peak <= limit,
        deviceless_margin=memory.deviceless_margin if target.deviceless else 0.0,
        flops_per_step=0.0, flops_no_remat=None, top_buffers=top_buffers, collectives=collectives,
        cross_check=cross_check, remat="", warnings=warnings, compile_seconds=seconds,
    ), compiled  # fmt: skip


@contextlib.contextmanager
def _persistent_cache_off():
    """Compiles for real: a persistent-cache hit would skip XLA, and with it the dump the report reads.
    JAX decides once per process whether the cache is used, so the decision is reset around the compile."""
    try:
        from jax._src import compilation_cache  # No public switch exists for this yet.

        reset = compilation_cache.reset_cache
    except (ImportError, AttributeError):  # Another JAX: plan anyway; a cache hit only loses the dump.
        yield
        return
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    reset()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        reset()


def _mesh_of(groups: Mapping[str, Any]) -> dict[str, int]:
    for leaf in jax.tree.leaves(dict(groups)):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if mesh is not None:
            return dict(mesh.shape)
    return {}
