"""How the mesh divides a program's work, resolved from the config and checked once: pipeline stages,
context (sequence) shards, micro-batches over the batch's devices, and the GPU overlap options the step
then compiles without.

    pipeline = pipeline_for(config, mesh)                 # None without a stage axis
    shards = context_shards(config, mesh, rules, custom=False, batch_shape=None)

Each raises ConfigError for a layout the program cannot run, naming the config keys and the fix.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import Mesh

from shardmem.config import Config
from shardmem.errors import ConfigError
from shardmem.parallel.pipeline import STAGE_AXIS, Pipeline, parse_stages
from shardmem.parallel.rules import Rules, sequence_parallel, spec_axes
from shardmem.program.accumulation import deferred_axes
from shardmem.program.batch import is_leaf as is_batch_leaf


def pipeline_for(
    config: Config, mesh: Mesh, custom: bool = False, rules: Rules | None = None
) -> Pipeline | None:
    """Returns the pipeline schedule for a mesh with a ``stage`` axis of size > 1 (None otherwise),
    checked against the model's depth, remat plan and partition rules."""
    stages = dict(mesh.shape).get(STAGE_AXIS, 1)
    if stages == 1:
        return None
    if custom:
        raise ConfigError(
            f"mesh.axes.stage={stages}: pipeline parallelism splits the reference decoder's layer stack; a "
            "model of your own cannot be split into stages; shard it with data, fsdp or tensor axes, or "
            "set mesh.axes.stage=1"
        )
    n_layers, ranges = config.model.n_layers, config.pipeline.stages
    counts = parse_stages(ranges, n_layers) if ranges is not None else ()
    train, schedule = config.train, config.pipeline
    pipeline = Pipeline(stages, train.micro_batches, schedule.repeats, counts, schedule.schedule,
                        grad_dtype=config.precision.master,
                        split_gradients=config.optimizer.shard_over_data)  # fmt: skip
    pipeline.check(n_layers, config.remat_plan())
    # 1F1B splits a chunk's backward in two parts of its layers, each about a forward's work, so that a
    # tick's ops cost alike (three parts under full remat, a forward each by FLOPs, planned slower on
    # Megatron-LM's 39B: the forward's tensor-parallel all-reduces are exposed); a chunk of one layer
    # runs its backward whole.
    pipeline = dataclasses.replace(pipeline, backward_parts=min(2, pipeline.chunk_layers(n_layers)))
    rules = rules or Rules.from_config(config.rules, mesh.axis_names, config.param_rules)
    stage_users = [
        (name, axes) for name, axes in rules.logical if name != "layers" and STAGE_AXIS in (axes or ())
    ]
    pipeline.check_rules(rules.mesh_axes("layers"), stage_users)
    return pipeline


def context_shards(config: Config, mesh: Mesh, rules: Rules, custom: bool, batch_shape) -> int:
    """Returns how many devices each sequence is split over (``rules.seq``), checking that context
    parallelism applies: the reference dense model, a sequence of 2 x context chunks, the batch elsewhere."""
    seq_axes = rules.mesh_axes("seq") or ()
    shards = math.prod(mesh.shape[a] for a in seq_axes)
    idle = mesh.shape.get("context", 1) > 1 and "context" not in seq_axes
    if idle and "context" not in (rules.mesh_axes("batch") or ()):
        raise ConfigError(
            f"mesh.axes.context={mesh.shape['context']} but rules.seq={list(seq_axes) or None} does not use "
            "it, so its devices would repeat the same work; set rules.seq: context (the default) or "
            "mesh.axes.context=1"
        )
    if shards == 1:
        return 1
    where = f"rules.seq={list(seq_axes)} splits each sequence over {shards} devices"
    if custom:
        raise ConfigError(
            f"{where}, but context parallelism is the reference model's (its attention gathers keys and "
            "values over the sequence's devices); a model of your own cannot use it: set "
            "mesh.axes.context=1 (and rules.seq: null)"
        )
    if config.model.n_experts:
        raise ConfigError(
            f"{where}, but model.n_experts={config.model.n_experts}: the experts' capacity fills in "
            "sequence order, which a split sequence does not keep; set mesh.axes.context=1, or use an "
            "expert axis instead"
        )
    shared = set(seq_axes) & set(rules.mesh_axes("batch") or ())
    if shared:
        raise ConfigError(
            f"{where}, and rules.batch={list(rules.mesh_axes('batch'))} uses {', '.join(sorted(shared))} "
            "too; a mesh axis splits either the batch or the sequence: remove it from rules.batch"
        )
    length = batch_shape[1] - 1 if batch_shape is not None else config.model.seq_len
    if length % (2 * shards):
        step = 2 * shards
        below, above = length // step * step, (length // step + 1) * step
        fits = [c for c in range(1, mesh.size + 1) if mesh.size % c == 0 and length % (2 * c) == 0]
        raise ConfigError(
            f"model.seq_len={length} is not a multiple of 2 x {shards} = {step}: {where}, in "
            f"2 x {shards} chunks for causal load balance; use a seq_len that is a multiple of {step} "
            f"(e.g. {' or '.join(str(x) for x in (below, above) if x)}), or mesh.axes.context among {fits}"
        )
    return shards


def check_micro_batches(config: Config, mesh: Mesh, batch_tree, shardings) -> None:
    train = config.train
    for leaf, sharding in zip(jax.tree.leaves(batch_tree, is_leaf=is_batch_leaf), jax.tree.leaves(shardings),
                              strict=True):  # fmt: skip
        rows = leaf.shape[0]
        if train.micro_batches > 1 and rows % train.micro_batches:
            raise ConfigError(
                f"train.micro_batches={train.micro_batches} does not divide the batch's first dimension "
                f"({rows}, shape {list(leaf.shape)}); every batch array must lead with the global batch"
            )
        spec = sharding.spec
        micro_rows = rows // train.micro_batches
        shards = math.prod(mesh.shape[a] for a in spec_axes(spec[0] if spec else None))
        if micro_rows % shards:
            axes = " x ".join(f"{a}={mesh.shape[a]}" for a in spec_axes(spec[0]))
            raise ConfigError(
                f"train.global_batch={rows} / train.micro_batches={train.micro_batches} gives "
                f"micro-batches of {micro_rows} {'rows' if config.user_model else 'sequences'}, which the "
                f"batch mesh axes ({axes}) cannot split evenly; make train.global_batch / "
                f"train.micro_batches a multiple of {shards}"
            )


def overlap_exceptions(
    config: Config,
    mesh: Mesh,
    rules: Rules,
    param_shardings,
    batch_sharding,
    *,
    rows_independent: bool,
    pipelined: bool,
) -> tuple[str, ...]:
    """Returns the GPU overlap options the step compiles without (:data:`overlap.GPU_OVERLAP` names).

    Both are there to prefetch FSDP weight gathers across layers (and to pipeline gradient
    reduce-scatters), which a step has none of when no parameter is split over a batch axis:

    - Loop double buffering, where the step loops over micro-batches (gradient accumulation or a
      pipeline's ticks) and no parameter is split over a batch axis. XLA unrolls every loop by two, the
      micro-batch loop too; with no pipelined collective to land, that only lets the scheduler start one
      micro-batch's forward (its stacks of activations) before the last one's backward has freed its
      own, and over XLA's memory limit it then rematerializes (tests/test_overlap.py; Llama 3.1 8B at
      context 2 x data 4, 32 micro-batches: 3.1 s of remat clones in an 18.1 s step, BENCHMARKS.md).
      With FSDP the prefetch pays (MPT-70B on 64 A100s, 4 micro-batches: 146 s with it, 151 s without).
    - Pipelined all-gather, with sequence parallelism and gradients accumulated per device over data
      axes (:mod:`shardmem.program.accumulation`): XLA's all-gather pipeliner moves the next
      micro-batch's sequence gathers into the accumulation loop's previous trip and clones the whole
      forward layer loop that feeds them, so every micro-batch's forward ran twice (tests/test_overlap.py;
      Nemotron-4 15B at tensor 4 x data 4, BENCHMARKS.md). With FSDP as well, XLA did not clone (data 2
      x FSDP 2 x tensor 4) and the prefetch stays.
    """
    accumulating = config.train.micro_batches > 1
    batch_axes = set(rules.mesh_axes("batch") or ())
    fsdp = any(a in batch_axes and mesh.shape[a] > 1
               for s in jax.tree.leaves(param_shardings) for e in s.spec for a in spec_axes(e))  # fmt: skip
    if not (pipelined or accumulating) or fsdp:
        return ()
    off = ("loop double buffering",)
    if pipelined or not rows_independent:
        return off
    with rules.activate(mesh):
        if not sequence_parallel():
            return off
    axes = deferred_axes(rules, mesh, param_shardings, batch_sharding, config.train.fsdp_reduce_once)
    return ("pipelined all-gather", *off) if axes else off
