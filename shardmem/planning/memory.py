"""The memory reporter: compile a program's real step ahead of time and say whether it fits.

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
import re
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from shardmem._quiet import native_stderr_silenced
from shardmem.config import Config, MemoryConfig
from shardmem.errors import ConfigError, DoesNotFit, PlanError
from shardmem.finetune.weights import check_init_from
from shardmem.parallel import collective_matmul
from shardmem.parallel.mesh import build_mesh
from shardmem.parallel.pipeline import Pipeline
from shardmem.parallel.rules import rule_warnings, sharding_table, unused_path_rules
from shardmem.parallel.schedule import IDLE, OP
from shardmem.planning import codegen, cost, hlo, kernel_cache, overlap
from shardmem.planning.targets import (
    Target,
    ensure_cpu_devices,
    link_domains,
    precision_notes,
    resolve_target,
    tpu_notes,
    tpu_slice,
)
from shardmem.program import LossFn, ModelFactory, Program, build_program
from shardmem.units import format_bytes

#: The per-device figures of a report, in the order tables show them.
CATEGORIES = (
    "params",
    "frozen",
    "optimizer",
    "model_state",
    "batch",
    "kv_cache",
    "outputs",
    "temp",
    "alias",
    "host",
    "code",
    "peak",
)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """What one compiled step needs per device, against the budget of the target it was compiled for.

    ``per_device`` holds integer bytes for :data:`CATEGORIES`. ``flops_per_step`` counts every matrix
    multiplication of the whole step across all devices, recomputation included (what HFU counts);
    ``flops_no_remat`` the model's: the same step without any recomputation, remat's or the attention
    kernel's own (what MFU counts: :func:`model_flops`; None when not computed).
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
    #: Every buffer over the compiled step's schedule (XLA's buffer assignment); what the timeline draws.
    schedule: hlo.BufferSchedule | None = dataclasses.field(default=None, repr=False, compare=False)
    attention: str = ""  # The attention kernel planned, and what a stand-in stands for.
    # How sequence parallelism's collectives run around the tensor-parallel matmuls ("": none to run).
    tensor_parallel: str = ""
    jax_version: str = jax.__version__  # Plans move with the XLA version (BENCHMARKS.md).
    # XLA options the compile used beyond the defaults (memory.compiler_options, and any retry's).
    compiler_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The pipeline schedule (stages, micro_batches, repeats, ticks, bubble_fraction); empty without one.
    pipeline: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: The predicted step time on the target (:mod:`shardmem.planning.cost`); None where it has no spec.
    step_time: cost.StepTime | None = None
    step_time_note: str = ""  # Why there is no estimate, or what it leaves out.
    # The most host memory loading finetune.init_from holds at once (0: nothing to load).
    load_host_bytes: int = 0
    #: The optimized HLO the figures were read from (for the step-time estimate).
    module: hlo.HloModule | None = dataclasses.field(default=None, repr=False, compare=False)
    #: What the device has for the step: ``budget_bytes`` without the deviceless margin (0: not known).
    usable_bytes: int = 0
    #: The budget's terms: memory.usable_fraction (or --memory-fraction) and memory.reserve (0.0: not known).
    usable_fraction: float = 0.0
    reserve_bytes: int = 0
    #: Whether the deviceless margin was taken on the temporaries alone (a serving function's budget:
    #: ``usable_bytes`` - margin x temporaries), not on the whole budget (a training step's).
    margin_on_temporaries: bool = False

    @property
    def margin_bytes(self) -> int:
        """Budget minus peak: negative when the step does not fit."""
        return self.budget_bytes - self.per_device["peak"]

    @property
    def tight(self) -> bool:
        """Whether the peak is over the budget only by the deviceless margin: within what the device has
        for the step (``usable_bytes``), so it likely fits; the margin covers the largest gap measured
        between a deviceless compile and the real GPU's, not a gap every compile has."""
        return not self.fits and self.per_device["peak"] <= self.usable_bytes

    @property
    def verdict(self) -> str:
        """``"fits"`` (within the budget), ``"tight"`` (see :attr:`tight`) or ``"does not fit"`` (over what
        the device has for the step, even if the deviceless compile were exact)."""
        return "fits" if self.fits else "tight" if self.tight else "does not fit"

    @property
    def recompute_overhead(self) -> float | None:
        """Extra matmul FLOPs from recomputation (remat's, and the attention kernel's own), as a fraction
        of the model's FLOPs: never negative."""
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
            "tensor_parallel": self.tensor_parallel,
            "per_device": self.per_device,
            "device_memory_bytes": self.device_memory_bytes,
            "budget_bytes": self.budget_bytes,
            "deviceless_margin": self.deviceless_margin,
            "usable_bytes": self.usable_bytes,
            "usable_fraction": self.usable_fraction,
            "reserve_bytes": self.reserve_bytes,
            "margin_on_temporaries": self.margin_on_temporaries,
            "fits": self.fits,
            "verdict": self.verdict,
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
            "compiler_options": self.compiler_options,
            "pipeline": self.pipeline,
            "step_time": self.step_time.to_json() if self.step_time else None,
            "step_time_note": self.step_time_note,
            "load_host_bytes": self.load_host_bytes,
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
    if tpu_slice(name):  # The slice gives the chips and hosts; mesh.hosts and devices_per_host do not apply.
        return resolve_target(name)
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
    return resolve_target(
        name, n_devices=n_devices, hosts=config.mesh.hosts, allocator_fraction=config.memory.usable_fraction
    )


def plan(
    config: Config,
    target: str | None = None,
    *,
    model_factory: ModelFactory | None = None,
    loss_fn: LossFn | None = None,
    batch: Any = None,
    compiler_options: Mapping[str, Any] | None = None,
    top: int = 10,
    count_remat_overhead: bool = True,
) -> MemoryReport:
    """Compiles the config's training step for ``target`` and returns its :class:`MemoryReport`.

    ``model_factory(rngs)``, ``loss_fn(model, batch)`` and ``batch`` plan a model of your own (as
    :func:`~shardmem.program.build_program` takes them; or ``model.factory``, ``train.loss`` and
    ``data.batch`` in the config) with the config's mesh, rules and remat. ``compiler_options`` are XLA
    options added to ``memory.compiler_options``.
    """
    if compiler_options:
        options = {**config.memory.compiler_options, **compiler_options}
        config = dataclasses.replace(
            config, memory=dataclasses.replace(config.memory, compiler_options=options)
        )
    resolved = make_target(config, target)
    mesh = build_mesh(config.mesh.axes, resolved.devices)
    program = build_program(config, mesh, model_factory=model_factory, loss_fn=loss_fn, batch=batch)
    report, _ = plan_program(program, resolved, top=top, count_remat_overhead=count_remat_overhead)
    return report


def plan_program(
    program: Program,
    target: Target,
    *,
    function: str | None = None,
    top: int = 10,
    count_remat_overhead: bool = True,
    reads_init_from: bool = True,
) -> tuple[MemoryReport, jax.stages.Compiled]:
    """Plans a built program (its mesh over ``target.devices``), whatever its kind: compiles one of its
    jitted functions on their abstract arguments (``function``, by name; default its first, a training
    program's step) and returns the report with the compiled function, which runs on attached devices:
    ``shardmem train`` steps with it rather than compiling again. ``reads_init_from=False``: the
    weights come from elsewhere (a resumed run's checkpoint), so ``finetune.init_from`` is not checked."""
    # Headers only, before the compile.
    unchecked = check_init_from(program, planning=True) if reads_init_from else []
    planned = program.function(function)
    traced = planned.trace()
    config = program.config
    memory = config.memory
    if planned.compiler_options:  # The function's own options, which its jit runs with; the user's win.
        options = {**planned.compiler_options, **memory.compiler_options}
        memory = dataclasses.replace(memory, compiler_options=options)
    try:
        report, compiled = _compile_and_analyze(traced, target, memory, groups=planned.groups, top=top,
                                                overlap_off=planned.overlap_off,
                                                name=config.name)  # fmt: skip
    except PlanError as error:
        known = _known_failure(program, target)
        if known is None:
            raise
        raise PlanError(f"{known}. {error}") from None
    rows = program.sharding_table()
    warnings = (
        unchecked + rule_warnings(rows, program.rules, program.mesh) + unused_path_rules(rows, program.rules)
    )
    layer_plan, modules = program.remat_plan, program.module_plan
    tags = hlo.checkpoint_tags(traced.jaxpr)
    warnings += _remat_warnings(config, layer_plan, tags)
    warnings += _module_warnings(modules, program.module_matches, tags) + report.warnings
    warnings += _optimizer_warnings(config) if program.description.training else []
    # Serving unrolls its layers on purpose (and compiles them to one layer's kernels): no advice to scan.
    warnings += _slow_compile_warnings(report) if program.description.training is not None else []
    warnings += tpu_notes(target, config.memory, report.per_device["peak"])
    warnings += precision_notes(target, config.precision.compute)
    serving = program.description.serving
    if serving is not None:  # The cache's layers' window (a model of your own's too), over its positions.
        window, length = serving.layout.window, serving.max_len
    elif program.custom_model:
        window, length = None, 0
    else:
        window, length = config.model.layer_window, config.model.seq_len
    m, layers = config.model, None
    if not program.custom_model and m.windows_vary:  # Each layer's own window (Block._window).
        window, layers = m.sliding_window, (len(set(m.sliding_layers)), m.n_layers)
    window = window if window is not None and window < length else None  # Else masks nothing.
    softcap = None if program.custom_model else m.attention_softcap
    by_index = serving is None  # Training's scanned layers pick their window by index; serving's know it.
    attention = program.attention.describe(window, softcap, layers, by_index) if program.attention else ""
    tensor_parallel = collective_matmul.describe(program.collective_matmuls, program.rules, program.mesh,
                                                 reference_model=not program.custom_model,
                                                 pipelined=program.pipeline is not None)  # fmt: skip
    # Every device runs the same program, one stage's shard of every buffer: its peak is every stage's.
    pipeline = program.pipeline.to_json(config.model.n_layers) if program.pipeline else {}
    # A 1F1B step's FLOPs: each op as often as the schedule runs it (hlo.matmul_flops).
    shares = op_shares(program)
    report = dataclasses.replace(report, flops_per_step=hlo.matmul_flops(traced.jaxpr, shares),
                                 warnings=warnings, sharding=rows, attention=attention,
                                 tensor_parallel=tensor_parallel, pipeline=pipeline,
                                 load_host_bytes=_load_host_bytes(program))  # fmt: skip
    rematted = hlo.remat_count(traced.jaxpr) > 0
    if layer_plan is None and not modules:  # A model that remats itself: no plan of ours to compare with.
        # A step without any jax.checkpoint is its own baseline, less its attention kernel's recompute.
        baseline = None if rematted else model_flops(program, traced.jaxpr, planned.name)
        report = dataclasses.replace(report, remat="the model's own", flops_no_remat=baseline)
    else:
        policies = (layer_plan.policies if layer_plan else ()) + tuple(p for _, p in modules.rules)
        label = "; ".join(
            part for part in (layer_plan.describe() if layer_plan else "", modules.describe()) if part
        )
        if any(p.remats for p in policies) and not rematted:  # Never report a remat that did not happen.
            report = dataclasses.replace(report, warnings=[*report.warnings, (
                f"remat {label}: the traced step has no jax.checkpoint, so nothing is recomputed and this is "
                "the plan without remat; a jax.jit inside the model (nn.jit) may have reused a trace made "
                "without it: plan in a fresh process")])  # fmt: skip
            label += " (not applied)"
        # Tracing the step again without recomputation costs no compile, but may be skipped.
        baseline = (
            model_flops(program, traced.jaxpr, planned.name) if count_remat_overhead or not rematted else None
        )
        report = dataclasses.replace(report, flops_no_remat=baseline, remat=label)
    return with_step_time(report, target, program.mesh, traced.jaxpr, config.interconnect,
                          planned.tokens), compiled  # fmt: skip


def op_shares(program: Program) -> dict[int, float] | None:
    """The share of a 1F1B step's ticks and stages that runs each op (:func:`hlo.matmul_flops`'s
    ``op_shares``: each op counted as often as the schedule runs it); None for any other program."""
    pipeline = program.pipeline
    return pipeline.op_shares if pipeline is not None and pipeline.runs_loss else None


def model_flops(program: Program, jaxpr, function: str | None = None) -> float:
    """Returns the model's matmul FLOPs per call of ``program``'s ``function`` (traced as ``jaxpr``), as
    MFU counts them: without any recomputation, neither remat's nor the attention kernel's own (chunked
    attention's per-block checkpoint, a flash kernel's backward). Where the function has a
    ``jax.checkpoint``, the program's variant without it is traced again (no compile); chunked attention
    then becomes ``xla``, the same products without recomputing each block. So the function's own FLOPs
    are never fewer. A program without a backward pass (serving's) recomputes nothing: its own jaxpr
    counts."""
    shares = op_shares(program)
    if hlo.remat_count(jaxpr) == 0 or program.description.training is None:
        return hlo.matmul_flops(jaxpr, shares, recomputed=False)
    overrides = ["remat.policy=none", "remat.layers={}", "remat.modules={}"]
    kernel = program.attention
    if kernel is not None and kernel.name == "chunked" and kernel.context == 1:
        overrides.append("model.attention=xla")
    plain_jaxpr = program.variant(*overrides).function(function).trace().jaxpr
    return hlo.matmul_flops(plain_jaxpr, shares, recomputed=False)


def _tick_ops(pipeline: dict | None) -> tuple[frozenset[int], ...]:
    """The ops some stage runs at each tick of a 1F1B schedule (a report's ``pipeline`` entry), for the
    step-time model; none for other schedules."""
    if not pipeline:
        return ()
    schedule = Pipeline.from_json(pipeline)
    if not schedule.runs_loss:
        return ()
    return tuple(frozenset(int(op) for op in row if op != IDLE) for row in schedule.table.rows[:, OP, :])


def with_step_time(report: MemoryReport, target: Target, mesh, jaxpr, interconnect=None,
                   tokens_per_step: int | None = None) -> MemoryReport:  # fmt: skip
    """Returns ``report`` with its predicted step time on ``target`` (:mod:`shardmem.planning.cost`), or a
    note saying why a target has none."""
    hardware = cost.Hardware.of(target, interconnect)
    if hardware is None and target.platform == "cpu" and report.module is not None:
        hardware = cost.Hardware.host(len(target.devices))
    if hardware is None or report.module is None:
        note = (f"no step-time estimate: {target.label} is not a GPU shardmem has a spec for "
                "(planning.targets.GPU_TARGETS)")  # fmt: skip
        return dataclasses.replace(report, step_time_note=note)
    idle = report.pipeline.get("bubble_fraction", 0.0) if report.pipeline else 0.0
    tick_ops = _tick_ops(report.pipeline)
    # GPipe's flops count idle stages' work on placeholders, MFU the model's; 1F1B's count each op as
    # often as the schedule runs it (idle ticks none).
    useful = 1.0 if tick_ops else 1.0 - idle
    model_flops = report.flops_no_remat if report.flops_no_remat is not None else None
    domains = link_domains(mesh.devices.flat)
    estimate = cost.estimate_step_time(
        report.module, hardware, domains,
        attention=hlo.fused_attention_kernels(jaxpr), bubble_fraction=idle, tokens_per_step=tokens_per_step,
        model_flops=model_flops * useful if model_flops else None,
        hardware_flops=report.flops_per_step * useful if report.flops_per_step else None,
        tick_ops=tick_ops,
    )  # fmt: skip
    if target.platform not in ("cpu", "tpu"):  # Calibrated on an H200; no TPU measurement backs it.
        estimate = dataclasses.replace(estimate, uncertainty=cost.CALIBRATED_ERROR)
    note = cost.ASSUMPTIONS
    if target.platform == "cpu":
        flops, bandwidth = cost.host_rates()
        note = ("approximate: simulated CPU devices share this machine's cores, so the estimate ranks CPU "
                "layouts (check with shardmem sweep --measure) and is no GPU prediction; the machine's "
                f"rates, {flops / 1e9:,.1f} GFLOP/s and {bandwidth / 1e9:,.1f} GB/s, are measured once per "
                f"process and vary with its load ({cost.HOST_RATES_ENV}=FLOPS,BYTES pins them); "
                + note)  # fmt: skip
    elif target.platform == "tpu":
        note += ("; TPU: not calibrated (the efficiencies were measured on an H200); \"nvlink\" is ICI, "
                 "all of a chip's links, so a collective along one torus axis is predicted fast; \"network\" "
                 "is DCN, between slices")  # fmt: skip
        if len(set(domains)) > 1:
            note += ("; libtpu lowers the collectives between slices to MegaScale sends over DCN, costed as "
                     "ring collectives over the slices at the DCN rate")  # fmt: skip
        if report.module is not None and any(
            '"AsyncCollectiveStart"' in ins.attributes for ins in report.module.by_name.values()
        ):
            note += ("; libtpu's own asynchronous collectives (AsyncCollectiveStart calls, which state "
                     "neither kind nor group) are costed as memory traffic only")  # fmt: skip
    elif target.deviceless:
        note += "; compiled deviceless, without the GPU's autotuning, which picks faster kernels"
    warnings = list(report.warnings or [])
    if estimate.unread_groups:
        warnings.append(
            f"step time: the device groups of {len(estimate.unread_groups)} collectives "
            f"({', '.join(estimate.unread_groups[:3])}) are in a form shardmem cannot read, so they are "
            "costed as groups of every device (an overestimate); please report the HLO line"
        )
    return dataclasses.replace(report, step_time=estimate, step_time_note=note, warnings=warnings)


def _load_host_bytes(program: Program) -> int:
    """The host memory loading ``finetune.init_from`` needs at most, read from the file's entry size
    where the file is there (float32 where it is not yet)."""
    if program.config.finetune.init_from is None:
        return 0
    from shardmem.finetune.weights import file_entry_bytes, host_bytes

    return host_bytes(program, file_entry_bytes(program.config.finetune.init_from))


def _optimizer_warnings(config: Config) -> list[str]:
    """A setting the chosen optimizer has no use for: sgd keeps no first moment for mu_dtype to narrow;
    float16 compute without a loss scale, whose small gradients underflow to zero."""
    opt, precision = config.optimizer, config.precision
    if opt.name == "sgd" and opt.mu_dtype:
        return [f"optimizer.mu_dtype={opt.mu_dtype} does nothing with optimizer.name=sgd (no first moment "
                "is kept); remove it, or use adam/adamw"]  # fmt: skip
    if precision.compute == "float16" and not precision.loss_scaling:
        return [f"precision.compute=float16 with precision.loss_scale={precision.loss_scale}: float16 holds "
                "nothing below 6e-8, so the backward pass flushes small gradients to zero; set "
                "precision.loss_scale=auto (a dynamic loss scale)"]  # fmt: skip
    return []


#: A compile this slow, with no loop in the program, is worth a line on what makes it slow.
SLOW_COMPILE_SECONDS = 20.0


def _slow_compile_warnings(report: MemoryReport) -> list[str]:
    """A slow compile of a program without loops: its layers are unrolled, and XLA compiles each one."""
    module = report.module
    if report.compile_seconds < SLOW_COMPILE_SECONDS or module is None:
        return []
    if any(ins.opcode == "while" for instructions in module.computations.values() for ins in instructions):
        return []
    return [
        f"the compile took {report.compile_seconds:.0f} s and the step has no loop: the model's layers are "
        "unrolled, so XLA optimizes every one of them (about 1 s of CPU per layer at Gemma-3-4B widths, "
        "BENCHMARKS.md); scan them (nn.scan in Linen, shardmem.remat_scan or nnx.scan in NNX) to compile "
        "one layer once"
    ]


def _remat_warnings(config: Config, layer_plan, traced_tags: set[str]) -> list[str]:
    """Never a silent full recompute: a policy that keeps tags by name when the step has none of them,
    or a remat section the model cannot apply."""
    if layer_plan is None:
        remat = config.remat
        if remat.policy != "none" or remat.layers or remat.custom:
            return [
                f"remat.policy={remat.policy!r} is not applied: the model factory takes no remat argument; "
                "give it one (factory(rngs, remat=plan)) and run its layers with shardmem.remat_scan, or "
                "name its layers in remat.modules (e.g. {'blocks_*': full})"
            ]
        return []
    warnings = [_missing_tags(f"remat policy {policy.name!r}", policy, traced_tags, "layers",
                              "use remat.policy=custom")
                for policy in dict.fromkeys(layer_plan.policies)]  # fmt: skip
    return [w for w in warnings if w]


def _missing_tags(what: str, policy, traced_tags: set[str], where: str, fix: str) -> str | None:
    """The warning for a policy that keeps tags by name when the step has none of them, or None."""
    named = policy.named_tags()
    if not named or traced_tags & set(named):
        return None
    yours = ", ".join(sorted(traced_tags)) or "none"
    return (f"{what} keeps the tags {', '.join(named)}, but the step tags none of them (its checkpoint_name "
            f"tags: {yours}), so those {where} recompute everything as 'full' would; list your tags in "
            f"remat.tags or {fix}")  # fmt: skip


def _module_warnings(modules, matched: set[str], traced_tags: set[str]) -> list[str]:
    """A ``remat.modules`` pattern that named no module, or whose policy keeps tags the step lacks."""
    warnings = []
    for pattern, policy in modules.rules:
        if pattern not in matched:
            warnings.append(
                f"remat.modules.{pattern}: no module of the model matches {pattern!r}, so nothing is "
                "rematerialized for it; match a submodule's path (decoder/blocks_0), name (blocks_0) or "
                "class name (DecoderBlock)"
            )
        missing = _missing_tags(f"remat.modules.{pattern}={policy.name!r}", policy, traced_tags, "modules",
                                "use another policy")  # fmt: skip
        warnings += [missing] if missing else []
    return warnings


def plan_function(
    fn: Callable | Any,
    *abstract_args,
    target: Target,
    memory: MemoryConfig | None = None,
    groups: Mapping[str, Any] | None = None,
    name: str = "function",
    top: int = 10,
    compiler_options: Mapping[str, Any] | None = None,
) -> MemoryReport:
    """Plans any jitted function on abstract arguments (``jax.ShapeDtypeStruct`` with shardings over
    ``target.devices``): bring your own model and step. ``groups`` names argument subtrees
    (e.g. ``{"params": abstract_params}``) whose per-device bytes the report lists separately."""
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    traced = jitted.trace(*abstract_args)
    memory = memory or MemoryConfig()
    if compiler_options:
        memory = dataclasses.replace(memory, compiler_options={**memory.compiler_options, **compiler_options})
    report = analyze(traced, target, memory, groups=groups or {}, top=top, name=name)
    rows = []
    if groups and "params" in groups:  # The sharding table, from the arguments' own shardings.
        params = groups["params"]
        rows = sharding_table(params, jax.tree.map(lambda leaf: leaf.sharding, params), {})
    report = dataclasses.replace(report, flops_per_step=hlo.matmul_flops(traced.jaxpr), sharding=rows)
    meshes = [leaf.sharding.mesh for leaf in jax.tree.leaves(abstract_args)
              if getattr(getattr(leaf, "sharding", None), "mesh", None) is not None]  # fmt: skip
    if not meshes:
        return report
    return with_step_time(report, target, meshes[0], traced.jaxpr)


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


def _libtpu_figures(message: str) -> tuple[int | None, int | None]:
    """(required, available) bytes from libtpu's "... required for HLO temporaries (23.52G) exceeds
    available HBM (15.75G)", in GiB as it prints them; None for a figure it does not give."""
    figures = [float(x) for x in re.findall(r"\(([\d.]+)G\)", message)]
    if len(figures) != 2:
        return None, None
    return round(figures[0] * (1 << 30)), round(figures[1] * (1 << 30))


def _compile_and_analyze(
    traced,
    target: Target,
    memory: MemoryConfig,
    *,
    groups: Mapping[str, Any],
    top: int,
    name: str,
    overlap_off: tuple[str, ...] = (),
) -> tuple[MemoryReport, jax.stages.Compiled]:
    limit = budget(memory, target.memory_bytes, target.allocator_limit, deviceless=target.deviceless)
    usable = budget(memory, target.memory_bytes, target.allocator_limit)  # The same, without the margin.
    start = time.perf_counter()
    # The GPU overlap options train runs with (overlap.py), the user's memory.compiler_options over them.
    options = overlap.step_options(target, memory.compiler_options, off=overlap_off)
    # Kernels a deviceless compile generated before: skipped again (kernel_cache.py). A user's own wins.
    shared = None if kernel_cache.OPTION in options else kernel_cache.cache_file(target)
    # Kernels it generates now are generated cheaply (codegen.py): XLA's options, not the user's to report.
    internal = codegen.deviceless_options(target, options)
    # JAX 0.12's Pallas Triton kernels read the compute capability off JAX's default device when they do
    # not know a GPU by name (an RTX 3090, A10G, L40S: "No supported GPU devices found"), so a deviceless
    # GPU plan lowers with one of its own devices as the default.
    gpu = target.deviceless and target.platform != "tpu"
    with (
        persistent_cache_off(),
        tempfile.TemporaryDirectory(prefix="shardmem-xla-") as dump,
        kernel_cache.private_copy(shared) as cache,
        jax.default_device(target.devices[0]) if gpu else contextlib.nullcontext(),
    ):
        retried = None
        try:
            compiled, cache = _compile_cached(traced, {**options, **internal}, dump, cache, shared)
        except Exception as e:  # XLA raises plain runtime errors for programs it cannot compile.
            first = _first_line(e)
            if target.platform == "tpu" and "Ran out of memory" in first:
                # XLA's TPU compiler refuses a program over the chip's HBM: a verdict, not a failure.
                raise DoesNotFit(
                    f"does not fit on {target.label}: libtpu's compiler says {first[:240]} Shard more "
                    "(mesh.axes.fsdp over more chips), recompute more (remat.policy), or lower "
                    "train.global_batch; shardmem tune searches these",
                    *_libtpu_figures(first),
                    per_device={key: per_device_bytes(tree) for key, tree in groups.items()},
                ) from None
            retry = target.deviceless and target.platform != "tpu" and TRITON_GEMM not in options
            if not retry or NO_PTXAS in first:
                raise PlanError(_compile_failure(target, first, options)) from None
            # Deviceless GPU compiles can fail to tile a Triton GEMM fusion that autotuning on a real GPU
            # would have replaced; cuBLAS calls compile anywhere.
            options[TRITON_GEMM] = False
            try:
                compiled = _compile(traced, {**options, **internal}, dump)
            except Exception as e2:
                raise PlanError(_compile_failure(target, _first_line(e2), options)) from None
            retried = first
        seconds = time.perf_counter() - start
        schedule = hlo.buffer_schedule(dump)
        top_buffers = hlo.peak_buffers(schedule, top) if schedule else []
        live_peak = schedule.peak_bytes if schedule else None
        text = compiled.as_text() or ""
        module = hlo.parse_module(text)
        collectives = hlo.collective_bytes(module)
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
    tiled = hlo.entry_argument_bytes(text) if target.platform == "tpu" else None
    if tiled and groups and accounted != arguments and tiled == (accounted, arguments):
        # TPU layouts pad to whole tiles: the shapes' bytes match, and padded they are XLA's exactly.
        cross_check.update(matches=True, tile_padding_bytes=arguments - accounted)
    warnings = []
    if retried:
        warnings.append(
            f"the deviceless compile failed with XLA's Triton GEMM fusions ({retried[:90]}); "
            f"planned with {TRITON_GEMM}=false instead, so every matmul is a cuBLAS call: on the Llama "
            "trials of BENCHMARKS.md this setting raised deviceless peaks by 0-23% over the default, so "
            "the verdict errs on the safe side"
        )
    if groups and not cross_check["matches"]:
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
        compiler_options=options, schedule=schedule, module=module, usable_bytes=usable,
        usable_fraction=memory.usable_fraction, reserve_bytes=memory.reserve,
    ), compiled  # fmt: skip


TRITON_GEMM = "xla_gpu_enable_triton_gemm"
# XLA's GPU compiler with no ptxas (nor nvJitLink) to assemble its kernels, even deviceless.
NO_PTXAS = "No PTX compilation provider"


def _compile(traced, options: Mapping[str, Any], dump: str, cache: str | None = None):
    # XLA's own remat pass logs to stderr when a plan exceeds the device; the report says it.
    extra = {"xla_dump_to": dump, "xla_dump_hlo_as_text": True}
    if cache is not None:
        extra[kernel_cache.OPTION] = cache
    with native_stderr_silenced(watch=True):
        return traced.lower().compile(compiler_options={**options, **extra})


def _compile_cached(traced, options: Mapping[str, Any], dump: str, cache: str | None, shared):
    """Compiles with the kernel cache and returns ``(compiled, cache)``. Where that fails, compiles
    without it, so a cache never fails a plan: if that succeeds, the cache was what XLA refused (a damaged
    file, another version's format, a jaxlib without the option) and is discarded; if not, the program
    is at fault and its error is raised. The cache returned is None once it is not to be used again."""
    if cache is not None:
        try:
            return _compile(traced, options, dump, cache), cache
        except Exception as error:
            with contextlib.suppress(OSError):
                os.unlink(cache)  # Never published: the block publishes only a file XLA wrote.
            if NO_PTXAS in str(error):
                raise  # Not the cache's doing: compiling again without it would fail the same way.
    compiled = _compile(traced, options, dump)
    if cache is not None:
        kernel_cache.discard(shared)
    return compiled, None


def _known_failure(program: Program, target: Target) -> str | None:
    """What a failed compile of ``program`` for ``target`` is known to come from, with the fix (None:
    nothing known). XLA's GPU compiler fails on residuals offloaded to host memory inside the tick loop
    of GPipe and the circular schedule (JAX 0.10.2 and 0.12: "Expected instruction to have shape equal
    to ..." after layout assignment); 1F1B's ops keep them in a ring of their own in host memory."""
    pipeline = program.pipeline
    if target.platform in ("cpu", "tpu") or pipeline is None or pipeline.runs_loss:
        return None
    plan = program.remat_plan
    if plan is None or not any(policy.offload for policy in plan.policies):
        return None
    one_f_one_b = "interleaved" if pipeline.repeats > 1 else "1f1b"
    return (
        f"remat ({plan.describe()}) offloads residuals to host memory under pipeline.schedule="
        f"{pipeline.schedule}, which XLA's GPU compiler cannot compile (the offloaded residuals inside "
        f"the schedule's tick loop). Set pipeline.schedule: {one_f_one_b}, whose ops keep offloaded "
        "residuals in host memory, or a remat policy that does not offload"
    )


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _compile_failure(target: Target, what: str, options: Mapping[str, Any]) -> str:
    if NO_PTXAS in what and codegen.CUDA_DIR in options:
        return (
            f"XLA's GPU compiler found no ptxas to assemble the kernels of the step for {target.label} in "
            f"memory.compiler_options.{codegen.CUDA_DIR}={options[codegen.CUDA_DIR]!r}: name a CUDA "
            "toolkit with bin/ptxas there, or remove the option (deviceless plans need no real ptxas)"
        )
    if NO_PTXAS in what:
        return (
            f"XLA's GPU compiler found no ptxas to assemble the kernels of the step for {target.label} "
            "(shardmem's stand-in could not run: is the temporary folder mounted noexec?). Install it with "
            "`pip install nvidia-cuda-nvcc-cu12` (shardmem's Linux install includes it), or name a CUDA "
            "toolkit with memory.compiler_options={xla_gpu_cuda_data_dir: /usr/local/cuda}"
        )
    used = f" with {', '.join(f'{k}={v}' for k, v in options.items())}" if options else ""
    return (
        f"XLA could not compile the step for {target.label}{used}: {what[:300]}. This is a compiler "
        "failure, not a memory verdict: try other XLA options in memory.compiler_options, plan for "
        "another target, or report it with the command that failed"
    )


@contextlib.contextmanager
def persistent_cache_off():
    """Compiles for real: a persistent-cache hit would skip XLA, and with it the dump the report reads.
    JAX decides once per process whether the cache is used, so the decision is reset around the compile.
    Compiles side by side (a serving plan's two) share one such block around them all: each restores what
    it found, which a block entered by another thread may have changed."""
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
