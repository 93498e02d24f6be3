"""Pipeline parallelism: the layer stack split into stages over a ``stage`` mesh axis.

    pipeline = Pipeline(stages=4, micro_batches=8)          # GPipe; repeats=2 for the circular schedule
    x_BxLxD = pipeline.run(model.layers, x_BxLxD, plan)      # in place of remat_scan(model.layers, ...)
    pipeline.bubble_fraction                                 # (S - 1) / (M * R + S - 1)
    Pipeline(4, 8, schedule="1f1b").in_flight                # 4 = S micro-batches' residuals, at most

The scan-over-ticks formulation (as in MaxText): every tick, each of the S stages runs its chunk of K
layers on one micro-batch -- one ``jax.vmap`` over the stage dimension of the state ``[S, mb, L, D]``,
sharded over ``stage`` (``spmd_axis_name``) -- and the outputs shift one stage on (``jnp.roll``, which XLA
turns into a collective-permute). Stage 0 reads micro-batch ``t % M`` from a buffer holding the inputs;
the last stage writes its output back into that buffer, where, in the circular schedule (``repeats`` R > 1,
chunk ``(r, s)`` = layers ``(r * S + s) * K ...``), stage 0 picks it up again for the next repeat. A whole
step is ``M * R + S - 1`` ticks, of which each stage idles ``S - 1``: the bubble. Every device runs the
same program on same-shaped buffers, so one device's compiled peak is every stage's.

GPipe and circular leave the backward pass to JAX, which saves every forward tick's residuals until the
backward loop runs them in reverse: a stage holds ``M * R + S - 1`` micro-batch passes of residuals, so the
peak grows with the micro-batches. ``schedule="1f1b"`` (and ``"interleaved"``, its circular form with
``repeats`` virtual stages) runs the backward itself, so the loss runs in the last stage:

    loss = pipeline.loss(model.layers, plan, tokens_BxL, targets_BxL, embed=embed, embed_params=table_VxD,
                         head_loss=head_loss, head_params=head_params)

1F1B runs its stages out of step, as Megatron-LM's: a stage runs a forward while its neighbour runs a
backward. One SPMD program does that with ``jax.shard_map`` over ``stage`` (each device its own stage),
running each tick the op its stage takes, each op a loop run once there and never elsewhere (so XLA
updates the tick's state in place, where a ``jax.lax.switch`` copied it: :func:`_run_one_of`): a chunk's
forward, or one of ``backward_parts`` parts of its backward (a backward is about two forwards' work, so
in two parts a tick costs about a forward whatever it runs, and no stage waits long on a neighbour), or
nothing. The ops run the chunk's layers by hand (:class:`shardmem.remat.SlotRun`): each layer reads its
weights out of the stage's ``[repeats, layers, ...]`` at the op's repeat as it runs, the forward writes
each layer's residuals (its ``jax.vjp`` pullback's, less the weights) into a ring of passes at the op's
slot, and a backward part reads its layers' back from there, adding each layer's weight gradient into the
stage's sums at its slot as it makes it. No op copies its chunk's weights, its residuals or its gradient
out whole. What a stage makes goes to both neighbours (two ``ppermute``
calls; on the ticks of an in-phase table where every stage runs a forward, to the next alone:
``ScheduleTable.hand_offs``); the one it is for queues it. Which op each stage runs at each tick is a
table built in Python by running the schedule (:mod:`shardmem.parallel.schedule`): with R = 1 Megatron's
1F1B, stage s holding ``S - s`` micro-batches' residuals (the first stage ``S``, whatever M: the peak
stays flat as micro-batches are added); with R > 1 Megatron's interleaved order and warm-up, ``2 (S - 1) +
(R - 1) S + 1`` chunk passes at the first stage, each of one chunk's residuals. Both tables are
``(M R + S - 1) (1 + parts)`` ticks long, so the bubble is the formula's (an interleaved table of whole
backwards, chunks of one layer, keeps its forwards and backwards in phase: more ticks, the formula's
time). The first
chunk's forward embeds its micro-batch (``embed``, so no stage holds the whole batch's embedded inputs or
their gradient) and the last chunk's runs the head and the loss, whose gradient starts that micro-batch's
backward. The body splits the batch by hand too, over the data axes that split nothing else
(:meth:`Rules.batch_only_axes`), and the sequence over the context axes that split no weight
(:meth:`Rules.seq_only_axes`, :func:`shardmem.parallel.context.split_by_hand`): each device sums its own
rows' and positions' weight gradients over the ticks (in ``grad_dtype``), and they are reduced once after
the last: all-reduced, or, where the optimizer reads a layer's gradient split over those axes
(``optimizer.shard_over_data``, ZeRO-1: Megatron's distributed optimizer), reduce-scattered to its pieces
(half the bytes); the compiler splits the tensor and FSDP axes inside it as everywhere. The gradients come
out of a ``jax.custom_vjp`` whose forward runs the schedule, so the step differentiates the loss as any
other.

Stages need not be even (GPipe and 1F1B): ``layer_counts`` gives each stage's number of contiguous layers
(``pipeline.stages: ["0-7", "8-15", "16-22", "23-29"]`` in the config, see :func:`parse_stages`); without
it the split is the most even one, the first stages one layer more (30 layers on 4 stages: 8, 8, 7, 7).
One program runs every stage, so each runs ``max(layer_counts)`` layer slots per tick; a stage's slots
past its own layers repeat its last layer with the output masked to the input (``jnp.where``), so they
cost their FLOPs (counted in the plan) but change nothing and get zero gradients.

With R = 1 parameters stay stored as the model stacks them (``[n_layers, ...]``, the ``layers`` axis
sharded over ``stage`` when the stage count divides ``n_layers``, else replicated over it:
:meth:`Pipeline.storage_rules`), so a checkpoint does not depend on the stage count or the split; with
an even split stage ``s`` holds its own contiguous layers and nothing moves, with uneven stages each
stage's layers are gathered into ``[S, K_max, ...]`` in the step (XLA moves them into place each step:
the plan's collectives show the bytes). With R > 1 a stage's chunks are strided, so each stack is stored
as ``[R, n_layers / R, ...]`` (:meth:`Pipeline.stored`: the same values in order, split over ``stage`` on
the second axis) and each stage stores its own chunks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardmem.errors import ConfigError
from shardmem.parallel import schedule as ops
from shardmem.parallel.rules import Rules, constrain, shard_map, spec_axes, split_over
from shardmem.parallel.rules import active as rules_active
from shardmem.parallel.schedule import ScheduleTable, schedule_table
from shardmem.remat import LayerPlan, SlotRun, layer_span, remat_scan

#: The mesh axis whose size is the number of pipeline stages.
STAGE_AXIS = "stage"
#: The named scope of the 1F1B schedule's scan over ticks (what the FLOP count and the replay look for).
SCOPE_1F1B = "pipeline_1f1b"

#: ``pipeline.schedule``: how the micro-batches go through the stages (see the module docstring).
SCHEDULES = {
    "gpipe": "every micro-batch forward, then every one backward (JAX differentiates the forward ticks)",
    "circular": "GPipe with pipeline.repeats layer chunks per stage: a smaller bubble",
    "1f1b": "each stage alternates forwards and backwards: the residuals of at most stages micro-batches",
    "interleaved": "1F1B with pipeline.repeats layer chunks (virtual stages) per stage: a smaller bubble",
}


class _Stages(NamedTuple):
    """The layers as the stages run them (:meth:`Pipeline._stages`)."""

    # The stored parameters with a leading stage axis: [S, K, ...] or [S, K, R, ...] (GPipe, circular), or
    # [S, R, K, ...] (1F1B: repeat-major, so that one chunk's weights are one contiguous slice).
    weights_S: dict
    run_stage: Callable  # (weights [K, ...] or [K, R, ...], x_bxLxD, repeat, valid_K) -> its chunk on x.
    run_chunk: Callable  # (a chunk's weights [K, ...], x_bxLxD) -> x.
    slot_run: Callable  # (a stage's weights [R, K, ...], valid_K) -> its chunks' SlotRun (1F1B's ops).
    valid_SxK: jax.Array | None  # Which of each stage's K layer slots hold a layer (None: all do).
    logical: dict  # The layers' logical axes, as the model stacks them: ("layers", ...) per weight.


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """``stages`` pipeline stages, ``micro_batches`` micro-batches per step, ``repeats`` layer chunks per
    stage, run by ``schedule`` (a key of :data:`SCHEDULES`; None: GPipe, or circular for ``repeats`` > 1).
    1F1B sums the gradients over the micro-batches in ``grad_dtype``: float32 for narrower weights with
    master weights (``precision.master``), as Megatron-LM sums into float32 main gradients; with
    ``split_gradients`` (``optimizer.shard_over_data``) it reduce-scatters the layers' over the batch's
    devices, as Megatron's distributed optimizer does, where it all-reduces them otherwise."""

    stages: int
    micro_batches: int
    repeats: int = 1
    layer_counts: tuple[int, ...] = ()  # Layers per stage, in order (empty: the most even split).
    schedule: str | None = None  # None: "gpipe", or "circular" for repeats > 1.
    backward_parts: int = 2  # 1F1B: the ticks a chunk's backward takes (about a forward's work each).
    grad_dtype: str | None = None  # 1F1B: the dtype gradients are summed in (None: each parameter's).
    split_gradients: bool = False  # 1F1B: the optimizer reads the gradients split over the batch axes.

    def __post_init__(self):
        if self.backward_parts < 1:
            raise ValueError(
                f"Pipeline.backward_parts={self.backward_parts}: a backward runs in 1 or more parts"
            )
        if self.schedule is None:
            object.__setattr__(self, "schedule", "gpipe" if self.repeats == 1 else "circular")

    @property
    def runs_loss(self) -> bool:
        """Whether the schedule runs the loss and the backward pass itself (1F1B: :meth:`loss`) rather
        than the layers alone, differentiated by JAX (:meth:`run`)."""
        return self.schedule in ("1f1b", "interleaved")

    def split(self, n_layers: int) -> tuple[int, ...]:
        """Returns each stage's number of layers: ``layer_counts``, else the most even split of
        ``n_layers``, the first stages one layer more (30 on 4 stages: 8, 8, 7, 7)."""
        if self.layer_counts:
            return self.layer_counts
        base, extra = divmod(n_layers, self.stages)
        return (base + 1,) * extra + (base,) * (self.stages - extra)

    def chunk_layers(self, n_layers: int) -> int:
        """Layer slots of one stage chunk: ``n_layers / (S * R)``, or the largest stage's layers."""
        return n_layers // (self.stages * self.repeats) if self.repeats > 1 else max(self.split(n_layers))

    def padded_slots(self, n_layers: int) -> int:
        """Layer slots that run masked (stages with fewer layers than the largest): ``S * K_max - n``."""
        counts = self.split(n_layers)
        return self.stages * max(counts) - n_layers

    def storage_rules(self, rules: Rules, n_layers: int) -> Rules:
        """Returns the rules the stored parameters use: ``rules``, with the ``stage`` axis dropped from the
        ``layers`` rule when the stage count does not divide ``n_layers`` (a stored ``[n_layers, ...]``
        axis cannot be split unevenly; the step gathers each stage's layers instead)."""
        if n_layers % self.stages == 0:
            return rules

        def kept(name, axes):
            return tuple(a for a in axes if a != STAGE_AXIS) or None if name == "layers" and axes else axes

        return dataclasses.replace(rules, logical=tuple((n, kept(n, a)) for n, a in rules.logical))

    def stored(self, params, logical):
        """Returns ``params`` (a pure dict of arrays or ShapeDtypeStructs; ``logical`` their logical axes)
        as the step keeps them: with R > 1 each stack of layers ``[n_layers, ...]`` as ``[R, n_layers / R,
        ...]``, the same values in the same order. The ``layers`` rule then splits the second axis, so
        stage s stores its own chunk of every repeat (layers ``(r * S + s) * K ...``) where a split
        ``n_layers`` axis would give it contiguous layers, and every step would move nearly all of them
        (XLA all-gathered GPT-3 175B's whole MLP weights to reshape them). R = 1: ``params`` itself."""
        if self.repeats == 1:
            return params

        def store(leaf, names):
            if not _is_stack(names):
                return leaf
            shape = (self.repeats, leaf.shape[0] // self.repeats, *leaf.shape[1:])
            if isinstance(leaf, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(shape, leaf.dtype)
            return leaf.reshape(shape)

        return jax.tree.map(store, params, logical, is_leaf=_is_names)

    def stored_logical(self, logical):
        """The logical axes of :meth:`stored` parameters: a stack's leading axis, its repeats, unnamed
        (every stage holds all its repeats). :meth:`Program.natural_params
        <shardmem.program.Program.natural_params>` turns stored parameters back into the model's."""
        if self.repeats == 1:
            return logical
        return jax.tree.map(lambda names: P(None, *names) if _is_stack(names) else names, logical,
                            is_leaf=_is_names)  # fmt: skip

    def stored_shardings(self, shardings, logical):
        """The shardings of :meth:`stored` parameters, from the stacks' as the model makes them: the
        repeats axis whole, the rest split as before (``layers`` over ``stage``)."""
        if self.repeats == 1:
            return shardings

        def store(sharding, names):
            return NamedSharding(sharding.mesh, P(None, *sharding.spec)) if _is_stack(names) else sharding

        return jax.tree.map(store, shardings, logical, is_leaf=_is_names)

    @property
    def table(self) -> ScheduleTable:
        """The 1F1B schedule's table of ticks (:func:`~shardmem.parallel.schedule.schedule_table`); only
        for :attr:`runs_loss`."""
        return schedule_table(self.stages, self.micro_batches, self.repeats, self.backward_parts)

    @property
    def op_shares(self) -> dict[int, float]:
        """The share of the 1F1B table's ticks and stages that runs each op (IDLE the rest), by op code:
        what a step's FLOPs count of each (:func:`shardmem.planning.hlo.matmul_flops`)."""
        ops_TxS = self.table.rows[:, ops.OP, :]
        codes, counts = np.unique(ops_TxS, return_counts=True)
        return {int(code): float(count / ops_TxS.size) for code, count in zip(codes, counts, strict=True)}

    @property
    def ticks(self) -> int:
        """Steps of the schedule: every micro-batch through every chunk, plus the fill and drain (each of
        the forward and backward loops for GPipe; for 1F1B, a tick runs a chunk's forward or one of its
        backward parts on each stage)."""
        m, r, s = self.micro_batches, self.repeats, self.stages
        return self.table.ticks if self.runs_loss else m * r + s - 1

    @property
    def bubble_fraction(self) -> float:
        """Share of each stage's time spent idle: ``(S - 1) / (M * R + S - 1)``, every schedule's (GPipe
        and 1F1B for R = 1; Narayanan et al. 2021, eq. 1 and its interleaved form; the 1F1B tables idle
        exactly that share of their ticks, or of their time where they keep forwards and backwards in
        phase: :func:`~shardmem.parallel.schedule.schedule_table`)."""
        return (self.stages - 1) / (self.micro_batches * self.repeats + self.stages - 1)

    @property
    def in_flight(self) -> int:
        """Micro-batch passes through one stage chunk whose residuals a stage holds at its peak: every
        tick's for GPipe and circular (JAX saves each forward tick's for the backward pass, idle ones
        too); for 1F1B the first stage's ``S`` (stage s holds ``S - s``, as Megatron-LM's), for
        interleaved Megatron's ``2 (S - 1) + (R - 1) S + 1`` (of chunks 1/R of a stage)."""
        m, r, s = self.micro_batches, self.repeats, self.stages
        return self.table.ring_slots if self.runs_loss else m * r + s - 1

    def describe(self) -> str:
        """Returns e.g. "4 stages x 8 micro-batches (GPipe): bubble (4-1)/(8+4-1) = 27.3%, 11 micro-batch
        passes in flight per stage"."""
        s, m, r = self.stages, self.micro_batches, self.repeats
        name = {"gpipe": "GPipe", "circular": "circular", "1f1b": "1F1B", "interleaved": "interleaved 1F1B"}
        schedule = name[self.schedule] + (f", {r} layer chunks per stage" if r > 1 else "")
        formula = f"({s}-1)/({m}" + (f"x{r}" if r > 1 else "") + f"+{s}-1)"
        bubble = f"bubble {formula} = {self.bubble_fraction:.1%}"
        in_flight = f"{self.in_flight} micro-batch passes in flight per stage"
        return f"{s} stages x {m} micro-batches ({schedule}): {bubble}, {in_flight}"

    @classmethod
    def from_json(cls, data: dict) -> Pipeline:
        """The inverse of :meth:`to_json` (a report's ``pipeline`` entry)."""
        return cls(
            data["stages"],
            data["micro_batches"],
            data["repeats"],
            schedule=data.get("schedule"),
            backward_parts=data.get("backward_parts", 2),
        )

    def to_json(self, n_layers: int | None = None) -> dict:
        """Returns the schedule as JSON-ready data (the plan's ``pipeline`` entry); with ``n_layers``, also
        the layers per stage and the padded (masked) layer slots."""
        out = {"stages": self.stages, "micro_batches": self.micro_batches, "repeats": self.repeats,
               "schedule": self.schedule, "ticks": self.ticks, "bubble_fraction": self.bubble_fraction,
               "in_flight": self.in_flight}  # fmt: skip
        if self.runs_loss:
            out["backward_parts"] = self.backward_parts
        if n_layers is not None:
            out["layers_per_stage"] = list(self.split(n_layers))
            out["padded_slots"] = self.padded_slots(n_layers)
            out["layers_sharded_over_stage"] = n_layers % self.stages == 0
        return out

    def check(self, n_layers: int, plan: LayerPlan | None = None) -> None:
        """Raises ConfigError unless ``n_layers`` split into stages and chunks and ``plan`` gives each layer
        slot the same policy in every stage chunk (one program runs every stage)."""
        s, m, r = self.stages, self.micro_batches, self.repeats
        chunks = s * r
        if r > 1 and n_layers % chunks:
            fits = [k for k in range(2, n_layers + 1) if n_layers % (k * r) == 0][:6]
            fix = f"a stage count that does ({', '.join(map(str, fits)) or 'none with these repeats'})"
            if n_layers % s == 0:
                repeats = [q for q in range(1, n_layers // s + 1) if n_layers % (s * q) == 0]
                fix += f", or pipeline.repeats among {repeats}"
            raise ConfigError(
                f"mesh.axes.stage={s} x pipeline.repeats={r} = {chunks} layer chunks do not divide "
                f"model.n_layers={n_layers}; the circular schedule needs equal chunks: use {fix}, or "
                f"pipeline.repeats=1 for uneven stages"
            )
        if self.layer_counts and len(self.layer_counts) != s:
            raise ConfigError(
                f"pipeline.stages has {len(self.layer_counts)} ranges but mesh.axes.stage={s}; give one "
                f"range of layers per stage"
            )
        if sum(self.split(n_layers)) != n_layers:
            raise ConfigError(
                f"pipeline.stages covers {sum(self.split(n_layers))} layers but model.n_layers={n_layers}; "
                f"the ranges must cover every layer once"
            )
        if n_layers < s:
            raise ConfigError(
                f"mesh.axes.stage={s} is more than model.n_layers={n_layers}: every stage needs a layer of "
                f"its own; use at most {n_layers} stages"
            )
        if m < s:
            at_s, at_4s = Pipeline(s, s, r).bubble_fraction, Pipeline(s, 4 * s, r).bubble_fraction
            raise ConfigError(
                f"train.micro_batches={m} is fewer than mesh.axes.stage={s}: every stage needs a "
                f"micro-batch of its own; use at least {s} (bubble (S-1)/(M*R+S-1): {at_s:.0%} at {s}, "
                f"{at_4s:.0%} at {4 * s})"
            )
        if self.schedule == "interleaved" and m % s:
            fits = sorted({m // s * s, (m // s + 1) * s} - {0})
            raise ConfigError(
                f"train.micro_batches={m} with pipeline.schedule=interleaved: it runs the micro-batches in "
                f"groups of mesh.axes.stage={s}; use a multiple of {s} ({' or '.join(map(str, fits))})"
            )
        if plan is None:
            return
        policies = plan.for_layers(n_layers).policies
        first: dict[int, int] = {}  # Slot -> the first layer that runs in it.
        for layer, slot in self._slots(n_layers):
            ref = first.setdefault(slot, layer)
            if policies[layer] != policies[ref]:
                raise ConfigError(
                    f"remat.layers: every pipeline stage runs the same program on its layer slots, so a "
                    f"slot must have the same policy in every stage chunk; layer {layer} (slot {slot}) has "
                    f"{policies[layer].name!r} but layer {ref} (slot {slot} of an earlier chunk) has "
                    f"{policies[ref].name!r}; give each position of a chunk the same policy in every chunk "
                    f"(e.g. remat.policy alone)"
                )

    def _slots(self, n_layers: int) -> list[tuple[int, int]]:
        """Returns ``(layer, slot)``: the position each layer takes in its stage chunk."""
        if self.repeats > 1:
            k = n_layers // (self.stages * self.repeats)
            return [(layer, layer % k) for layer in range(n_layers)]
        out, start = [], 0
        for count in self.split(n_layers):
            out += [(start + slot, slot) for slot in range(count)]
            start += count
        return out

    def check_rules(self, layers_axes, stage_users: list[tuple[str, tuple[str, ...]]]) -> None:
        """Raises ConfigError unless ``rules.layers`` maps to the ``stage`` axis alone (``layers_axes``)
        and no other rule uses it (``stage_users``: the rules that do, as (name, mesh axes)): the stages
        hold their own layers through the ``layers`` rule and hand the micro-batches on over ``stage``."""
        if tuple(layers_axes or ()) != (STAGE_AXIS,):
            shown = list(layers_axes) if layers_axes else None
            raise ConfigError(
                f"rules.layers={shown} with mesh.axes.stage={self.stages}: each pipeline stage holds its "
                "own layers through rules.layers, so it must be [stage] alone (otherwise every stage stores "
                "weights and optimizer state of layers it never runs); set rules.layers: stage (the "
                "default) or mesh.axes.stage=1"
            )
        if stage_users:
            name, axes = stage_users[0]
            raise ConfigError(
                f"rules.{name}={list(axes)} uses the stage mesh axis (mesh.axes.stage={self.stages}), which "
                f"only rules.layers may use: the pipeline's stages hand the micro-batches on over it; "
                f"remove stage from rules.{name}"
            )

    def chunk_plan(self, plan: LayerPlan, n_layers: int) -> LayerPlan:
        """Returns the remat plan of one chunk's layer slots (the same in every chunk, see :meth:`check`)."""
        policies = plan.for_layers(n_layers).policies
        by_slot: dict[int, object] = {}
        for layer, slot in self._slots(n_layers):
            by_slot.setdefault(slot, policies[layer])
        return LayerPlan(tuple(by_slot[slot] for slot in sorted(by_slot)))

    def _stages(self, layers: nnx.Module, plan: LayerPlan, repeat_major: bool = False) -> _Stages:
        """Returns the layers as each stage runs them: their weights with a leading stage axis (then the
        repeats, where ``repeat_major``) and the functions the schedules run on each stage (vmapped over
        it, or in 1F1B's shard_map)."""
        graphdef, params, rest = nnx.split(layers, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ConfigError(
                f"mesh.axes.stage={self.stages}: the layers hold variables other than parameters (batch "
                "statistics, RNG streams), which a pipeline cannot carry between stages; set "
                "mesh.axes.stage=1"
            )
        logical = nnx.to_pure_dict(nnx.get_partition_spec(params))
        leaf, names = jax.tree.leaves(params)[0], jax.tree.leaves(logical, is_leaf=_is_names)[0]
        n_layers = leaf.shape[0] * (leaf.shape[1] if _is_stored(leaf, names) else 1)
        self.check(n_layers, plan)
        s, r = self.stages, self.repeats
        counts = self.split(n_layers)
        even = len(set(counts)) == 1  # Always with R > 1 (check), whose chunks split a stage's layers.
        k = n_layers // (s * r) if even else max(counts)
        chunk_plan = self.chunk_plan(plan, n_layers)
        starts = [sum(counts[:i]) for i in range(s)]

        def to_chunks(leaf, names):
            # [n_layers, ...] or as stored ([R, n_layers / R, ...], see stored) -> [R, S, K, ...]: chunk
            # (r, s) holds layers (r * S + s) * K ... + K - 1, so a stored stack splits where it is split.
            rest_names = tuple(names)[1:] if names is not None else (None,) * (leaf.ndim - 1)
            layer_shape = leaf.shape[2:] if _is_stored(leaf, names) else leaf.shape[1:]
            if even:
                chunked = leaf.reshape(r, s, k, *layer_shape)
            else:  # Static slices, each stage's padded with copies of its last layer (masked in the run).
                chunked = jnp.stack([
                    jnp.concatenate([leaf[a:a + n], *[leaf[a + n - 1:a + n]] * (k - n)]) if n < k
                    else leaf[a:a + n] for a, n in zip(starts, counts, strict=True)
                ])[None]  # fmt: skip
            # Split as stored, on the forward pass alone: the gradients come back split over the batch's
            # devices where the optimizer reads them so (_scatter_dim), and stay so.
            return _forward_only(lambda c: constrain(c, (None, "layers", None, *rest_names)))(chunked)

        chunks = jax.tree.map(to_chunks, nnx.to_pure_dict(params), logical, is_leaf=_is_names)

        # [R, S, K, ...] -> [S, R, K, ...] (repeat_major), [S, K, ...] (R = 1) or [S, K, R, ...]: each
        # stage's layers, all their repeats.
        def per_stage(c):
            return jnp.moveaxis(c, 0, 1) if repeat_major else c[0] if r == 1 else jnp.moveaxis(c, 0, 2)

        weights_S = jax.tree.map(per_stage, chunks)
        # Which of each stage's K slots hold one of its layers (None: all do).
        valid_SxK = None if even else jnp.arange(k)[None, :] < jnp.asarray(counts)[:, None]

        def select_repeat(repeat):
            # Inside each layer's checkpointed body, so a tick's weights are never saved for the backward
            # pass (a copy of the stage's layers per tick); a masked sum, not a gather per stage, whose
            # transposed scatter fails XLA's GPU verifier (repeated scatter dimensions).
            def pick(w_RxA):
                at_repeat = (jnp.arange(r) == repeat).reshape(r, *(1,) * (w_RxA.ndim - 1))
                return jnp.sum(jnp.where(at_repeat, w_RxA, 0), axis=0)

            def select(layer_params):
                return jax.tree.map(pick, layer_params)

            return select

        def run_chunk(weights, x_mbxLxD, valid_K=None, prepare=None):
            """A chunk's layers (weights [K, ...]) on ``x``."""
            module = nnx.merge(graphdef, weights, rest)
            return remat_scan(module, x_mbxLxD, chunk_plan, prepare=prepare, mask=valid_K)

        def slot_run(weights, valid_K=None):
            """A stage's chunks (weights [R, K, ...], each chunk's K layer slots), run by hand."""
            return SlotRun(nnx.merge(graphdef, weights, rest), chunk_plan, valid_K)

        def run_stage(weights, x_mbxLxD, repeat, valid_K):
            """One stage's chunk at ``repeat`` (weights [K, ...], or [K, R, ...] for R > 1) on ``x``."""
            if r > 1:
                return run_chunk(weights, x_mbxLxD, prepare=select_repeat(repeat))
            return run_chunk(weights, x_mbxLxD, valid_K)

        return _Stages(weights_S, run_stage, run_chunk, slot_run, valid_SxK, logical)

    def _micro_batches(self, x_BxA: jax.Array) -> jax.Array:
        """``[B, ...]`` -> ``[M, B / M, ...]``: micro-batch i takes every M-th row, so each device keeps its
        own rows (as gradient accumulation)."""
        m = self.micro_batches
        return x_BxA.reshape(x_BxA.shape[0] // m, m, *x_BxA.shape[1:]).swapaxes(0, 1)

    def run(self, layers: nnx.Module, x_BxLxD: jax.Array, plan: LayerPlan) -> jax.Array:
        """Runs stacked layers (as :func:`~shardmem.remat.remat_scan` does) through the GPipe or circular
        schedule, differentiated by JAX; returns the last layer's output for the whole batch, in its rows'
        order. The 1F1B schedules run the loss too: :meth:`loss`."""
        stages = self._stages(layers, plan)
        s, m, r = self.stages, self.micro_batches, self.repeats
        stage_ids_S = jnp.arange(s)
        valid_axis = 0 if stages.valid_SxK is not None else None
        run_stages = jax.vmap(stages.run_stage, in_axes=(0, 0, 0, valid_axis), spmd_axis_name=STAGE_AXIS)
        micro_MxBxLxD = self._micro_batches(x_BxLxD)
        # One copy per stage of the micro-batch buffer, sharded over stage: only stage 0's is read, but a
        # replicated buffer would need a broadcast from the last stage every tick.
        buffer_SxMxBxLxD = constrain(jnp.broadcast_to(micro_MxBxLxD, (s, *micro_MxBxLxD.shape)),
                                     ("layers", None, "batch", "residual_seq", None))  # fmt: skip
        state_SxBxLxD = constrain(jnp.zeros_like(buffer_SxMxBxLxD[:, 0]),
                                  ("layers", "batch", "residual_seq", None))  # fmt: skip
        at_stage0 = (stage_ids_S == 0).reshape(s, *(1,) * (state_SxBxLxD.ndim - 1))

        def tick(carry, t):
            state_SxBxLxD, buffer_SxMxBxLxD = carry
            fresh_SxBxLxD = jax.lax.dynamic_index_in_dim(buffer_SxMxBxLxD, t % m, 1, keepdims=False)
            inputs_SxBxLxD = jnp.where(at_stage0, fresh_SxBxLxD, state_SxBxLxD)
            # Stage s is at repeat (t - s) // M (clipped in the fill and the drain).
            repeat_S = jnp.clip((t - stage_ids_S) // m, 0, r - 1)
            out_SxBxLxD = run_stages(stages.weights_S, inputs_SxBxLxD, repeat_S, stages.valid_SxK)
            # Stage s's output moves to stage s + 1, the last stage's to stage 0: a collective-permute.
            shifted_SxBxLxD = constrain(jnp.roll(out_SxBxLxD, 1, axis=0),
                                        ("layers", "batch", "residual_seq", None))  # fmt: skip
            slot = (t - (s - 1)) % m  # The micro-batch the last stage just finished (from tick S - 1 on).
            old_SxBxLxD = jax.lax.dynamic_index_in_dim(buffer_SxMxBxLxD, slot, 1, keepdims=False)
            written = jnp.where(t >= s - 1, shifted_SxBxLxD, old_SxBxLxD)
            buffer_SxMxBxLxD = jax.lax.dynamic_update_index_in_dim(buffer_SxMxBxLxD, written, slot, 1)
            return (shifted_SxBxLxD, buffer_SxMxBxLxD), None

        with jax.named_scope("pipeline"):
            (_, buffer_SxMxBxLxD), _ = jax.lax.scan(tick, (state_SxBxLxD, buffer_SxMxBxLxD),
                                                    jnp.arange(m * r + s - 1))  # fmt: skip
            # Stage 0's buffer holds the results; a masked sum over stages is one all-reduce of the
            # batch's activations (taking index 0 of a stage-sharded axis would gather all S copies).
            out_MxBxLxD = jnp.sum(jnp.where(at_stage0[:, None], buffer_SxMxBxLxD, 0), axis=0)
        out_BxLxD = out_MxBxLxD.swapaxes(0, 1).reshape(x_BxLxD.shape)
        return constrain(out_BxLxD, ("batch", "residual_seq", None))

    def loss(self, layers: nnx.Module, plan: LayerPlan, inputs_BxA: jax.Array, targets_BxA: jax.Array, *,
             embed: Callable, embed_params, head_loss: Callable, head_params) -> jax.Array:  # fmt: skip
        """Returns the mean over the micro-batches of ``head_loss(head_params, y_bxLxD, targets_bxA)``,
        ``y`` the last layer's output on ``embed(embed_params, inputs_bxA)``, the gradients of ``layers``,
        ``embed_params`` and ``head_params`` computed by the 1F1B schedule (:attr:`schedule` ``1f1b`` or
        ``interleaved``) as it runs: the first stage embeds each micro-batch in the tick of its first
        forward, the last runs the head in the tick of its last (see the module docstring). Differentiate
        it as any loss; its backward pass only scales those gradients."""
        active = rules_active()
        if active is None:
            raise ValueError("Pipeline.loss runs inside Rules.activate(mesh): it needs the stage mesh axis")
        mesh, rules = active
        stages = self._stages(layers, plan, repeat_major=True)
        table = schedule_table(self.stages, self.micro_batches, self.repeats, self.backward_parts)
        s, m, n_parts = self.stages, self.micro_batches, self.backward_parts
        k = jax.tree.leaves(stages.weights_S)[0].shape[2]  # [S, R, K, ...]
        if n_parts > k:
            raise ValueError(f"Pipeline.backward_parts={n_parts} is more than a chunk's {k} layers")
        bounds = [round(i * k / n_parts) for i in range(n_parts + 1)]  # Part p: layer slots [b_p, b_p+1).
        spec = ("batch", "residual_seq", None)

        def body(weights_1xS, valid_1xK, embed_params, head_params, inputs_MxbxA, targets_MxbxA, table_TxN):
            """One stage's whole schedule (inside ``jax.shard_map`` over ``stage``): every tick it runs the
            table's op for it, then hands its output on to both neighbours."""
            weights = jax.tree.map(lambda w: w[0], weights_1xS)
            valid_K = None if valid_1xK is None else valid_1xK[0]
            x_shape = jax.eval_shape(embed, embed_params, inputs_MxbxA[0])
            zeros_bxLxD = jnp.zeros(x_shape.shape, x_shape.dtype)
            # The chunk at the op's repeat, run by hand: its forward keeps its residuals in the rings, and
            # backward part p runs its layer slots [b_p, b_p+1) back.
            chunk = stages.slot_run(weights, valid_K)
            # What the ops change: the residual rings (a list per segment of the layers' remat plan), the
            # gradient sums and the loss. Each op takes them all and returns them with its own change, in a
            # loop of its own (_run_one_of): XLA updates them in place.
            # The gradients are summed over the micro-batches in grad_dtype (float32 under master weights).
            zeros = functools.partial(jax.tree.map, lambda a: jnp.zeros(a.shape, self.grad_dtype or a.dtype))
            state = dict(
                rings=chunk.rings(zeros_bxLxD, table.ring_slots),
                d_weights=zeros(weights), d_embed=zeros(embed_params), d_head=zeros(head_params),
                loss=jnp.zeros((), jnp.float32),
            )  # fmt: skip

            def done(state, out=None, kept=None):
                """A branch's results: the state, what it sends on and what it keeps for itself."""
                return (state, constrain(zeros_bxLxD if out is None else out, spec),
                        constrain(zeros_bxLxD if kept is None else kept, spec))  # fmt: skip

            def idle(state, x, dy, inputs, targets, ring, repeat):
                return done(state)

            def run_forward(state, x, dy, inputs, targets, ring, repeat):
                y, rings = chunk.forward((repeat,), constrain(x, spec), state["rings"], ring)
                return done(dict(state, rings=rings), out=y)

            def run_forward_from_input(state, x, dy, inputs, targets, ring, repeat):
                # The first chunk embeds its micro-batch; the embedding's backward needs only the inputs.
                return run_forward(state, embed(embed_params, inputs), dy, inputs, targets, ring, repeat)

            def run_forward_and_head(state, x, dy, inputs, targets, ring, repeat):
                # The last chunk: the head's gradient is the first backward part's input, kept here.
                y, rings = chunk.forward((repeat,), constrain(x, spec), state["rings"], ring)
                loss, pullback = jax.vjp(lambda h, y: head_loss(h, y, targets), head_params, y)
                d_head, dy = pullback(jnp.asarray(1.0 / m, loss.dtype))
                d_head = jax.tree.map(lambda a, d: a + d.astype(a.dtype), state["d_head"], d_head)
                state = dict(state, rings=rings, d_head=d_head, loss=state["loss"] + loss / m)
                return done(state, kept=dy.astype(y.dtype))

            def run_backward(p, to_input=False):
                def branch(state, x, dy, inputs, targets, ring, repeat):
                    dx, d_weights = chunk.backward((repeat,), constrain(dy, spec), state["rings"], ring,
                                                   state["d_weights"], bounds[p], bounds[p + 1])  # fmt: skip
                    state = dict(state, d_weights=d_weights)
                    if to_input:  # The first chunk's part 0: on into the embedding.
                        (d_embed,) = jax.vjp(lambda e: embed(e, inputs), embed_params)[1](dx)
                        d_embed = jax.tree.map(lambda a, d: a + d.astype(a.dtype), state["d_embed"], d_embed)
                        return done(dict(state, d_embed=d_embed))
                    # Part 0's input gradient goes to the stage before; a later part's stays for the next.
                    sent, kept = (dx, None) if p == 0 else (None, dx)
                    return done(state, out=sent, kept=kept)

                return branch

            by_op = {ops.IDLE: idle, ops.FORWARD: run_forward, ops.FORWARD_FROM_INPUT: run_forward_from_input,
                     ops.FORWARD_AND_HEAD: run_forward_and_head,
                     ops.BACKWARD_TO_INPUT: run_backward(0, to_input=True),
                     **{ops.BACKWARD + p: run_backward(p) for p in range(n_parts)}}  # fmt: skip
            branches = [by_op[op] for op in range(len(by_op))]
            # Queues of the inputs and gradients waiting for their op.
            queue = functools.partial(jnp.zeros, dtype=zeros_bxLxD.dtype)
            carry = dict(state=state, inputs=queue((table.input_slots, *zeros_bxLxD.shape)),
                         grads=queue((table.grad_slots, *zeros_bxLxD.shape)))  # fmt: skip

            def tick(carry, row_Nx1, forward=True, back=True):
                """One tick of the table; ``forward``, ``back``: whether some stage receives what the stage
                before, or after, made this tick (else that hand-off is not sent)."""
                op, micro, repeat, ring, source, local, from_before, from_after = row_Nx1[:, 0]  # ops.COLUMNS
                carry = dict(carry)
                x = jax.lax.dynamic_index_in_dim(carry["inputs"], source, 0, keepdims=False)
                dy = jax.lax.dynamic_index_in_dim(carry["grads"], source, 0, keepdims=False)
                inputs, targets = (jax.lax.dynamic_index_in_dim(a, micro, 0, keepdims=False)
                                   for a in (inputs_MxbxA, targets_MxbxA))  # fmt: skip
                operands = (x, dy, inputs, targets, ring, repeat)
                runs = [None if branch is idle else functools.partial(_on_state, branch, operands)
                        for branch in branches]  # fmt: skip
                carry["state"], out, kept = _run_one_of(op, runs, done(carry["state"]))
                carry["grads"] = _put(carry["grads"], local, kept)
                # What a stage made moves to both neighbours; each keeps what the table says is for it.
                ring_of = functools.partial(jax.lax.ppermute, axis_name=STAGE_AXIS)
                if forward:
                    to_next = ring_of(out, perm=[(i, (i + 1) % s) for i in range(s)])
                    carry["inputs"] = _put(carry["inputs"], from_before, to_next)
                if back:
                    to_previous = ring_of(out, perm=[(i, (i - 1) % s) for i in range(s)])
                    carry["grads"] = _put(carry["grads"], from_after, to_previous)
                return carry

            # The loop runs the table's ticks a phase at a time, each phase making only its hand-offs.
            phases = table.hand_offs

            def ticks(carry, rows_PxNx1):
                for phase, (forward, back) in enumerate(phases):
                    carry = tick(carry, rows_PxNx1[phase], forward, back)
                return carry, None

            with jax.named_scope(SCOPE_1F1B):
                rows_TxPxNx1 = table_TxN.reshape(-1, len(phases), *table_TxN.shape[1:])
                carry, _ = jax.lax.scan(ticks, carry, rows_TxPxNx1)

            # Each device's loss and gradients are of its rows' and positions' mean: the batch's mean over
            # the data and sequence axes (reduced once here, not every micro-batch) and the last stage's
            # over the stages.
            def mean(x, over_stages=True):
                x = jax.lax.psum(x, by_hand) / n_by_hand if by_hand else x
                return jax.lax.psum(x, STAGE_AXIS) if over_stages else x

            def reduced(d, dim, names):  # Reduce-scattered over dimension dim, or all-reduced (None).
                if dim is None:
                    return mean(d, over_stages=False)
                # Manual over the compiler's axes too: XLA's partitioner gathers an operand's
                # compiler-split dimensions whole before a reduce-scatter over the body's axes.
                spec = P(None, None, *rules.spec(names)[1:])  # [R, K, ...]; stage's split by hand.
                scatter = functools.partial(jax.lax.psum_scatter, axis_name=by_hand, scatter_dimension=dim,
                                            tiled=True)  # fmt: skip
                return shard_map(scatter, mesh, in_specs=spec, out_specs=spec)(d) / n_by_hand

            state = carry["state"]
            d_weights_1xS = jax.tree.map(lambda d, dim, names: reduced(d, dim, names)[None],
                                         state["d_weights"], scatter, stages.logical)  # fmt: skip
            d_embed, d_head = (jax.tree.map(mean, state[key]) for key in ("d_embed", "d_head"))
            return mean(state["loss"]), (d_weights_1xS, d_embed, d_head)

        # The body splits the stages by hand, the batch over the data axes that split nothing else, and
        # the (zigzag-ordered) sequence over the context axes that split no weight (so each device sums
        # its own rows' and positions' weight gradients over the ticks: context.split_by_hand); the
        # compiler splits the rest (tensor, fsdp) as everywhere.
        data_axes, seq_axes = rules.batch_only_axes(), rules.seq_only_axes(mesh)
        by_hand = (*data_axes, *seq_axes)
        n_by_hand = math.prod(mesh.shape[a] for a in by_hand)
        stage_spec, whole = P(STAGE_AXIS), P()
        rows = P(None, data_axes or None, seq_axes or None)  # [M, b, L]
        weight_specs = jax.tree.map(lambda _: stage_spec, stages.weights_S)
        # Which dimension of each stage's [R, K, ...] gradient sums is reduce-scattered (None: all-reduced).
        # Uneven stages' layers are not stored by stage (storage_rules): all-reduced.
        scatter = jax.tree.map(
            lambda w, names: None if stages.valid_SxK is not None
            else self._scatter_dim(w.shape[1:], names, rules, mesh, by_hand),
            stages.weights_S, stages.logical,
        )  # fmt: skip
        d_weight_specs = jax.tree.map(
            lambda _, dim: stage_spec if dim is None else P(STAGE_AXIS, *[None] * dim, by_hand),
            stages.weights_S, scatter,
        )  # fmt: skip
        embed_specs, head_specs = (jax.tree.map(lambda _: whole, p) for p in (embed_params, head_params))
        valid_spec = None if stages.valid_SxK is None else stage_spec
        sharded = jax.shard_map(
            body, mesh=mesh, axis_names={STAGE_AXIS, *by_hand}, check_vma=False,
            in_specs=(weight_specs, valid_spec, embed_specs, head_specs, rows, rows,
                      P(None, None, STAGE_AXIS)),
            out_specs=(whole, (d_weight_specs, embed_specs, head_specs)),
        )  # fmt: skip
        table_TxNxS = jnp.asarray(table.rows)  # [ticks, ops.COLUMNS, stages]

        def schedule(weights_S, embed_params, head_params, inputs_MxbxA, targets_MxbxA):
            """Runs every tick; returns the loss and the gradients of the three differentiable inputs."""
            valid = stages.valid_SxK
            return sharded(
                weights_S, valid, embed_params, head_params, inputs_MxbxA, targets_MxbxA, table_TxNxS
            )

        @jax.custom_vjp
        def pipelined(weights_S, embed_params, head_params, inputs_MxbxA, targets_MxbxA):
            return schedule(weights_S, embed_params, head_params, inputs_MxbxA, targets_MxbxA)[0]

        # The gradients leave in their parameters' dtypes (summed in grad_dtype, rounded once).
        dtypes = jax.tree.map(lambda a: a.dtype, (stages.weights_S, embed_params, head_params))

        def scaled(grads, g):
            return (*jax.tree.map(lambda d, dtype: (g * d).astype(dtype), grads, dtypes), None, None)

        pipelined.defvjp(schedule, scaled)
        inputs_MxbxA, targets_MxbxA = self._micro_batches(inputs_BxA), self._micro_batches(targets_BxA)
        return pipelined(stages.weights_S, embed_params, head_params, inputs_MxbxA, targets_MxbxA)

    def _scatter_dim(self, shape_RxKxA, names, rules: Rules, mesh: Mesh, by_hand) -> int | None:
        """The dimension of a stage's ``[R, K, ...]`` sums of one weight's gradients to reduce-scatter over
        the ``by_hand`` axes, or None to all-reduce them: where the optimizer reads that gradient split
        over those axes alone (:func:`~shardmem.program.optimizer.gradient_shardings`), on a dimension
        that no axis left to the compiler splits, so that the scattered pieces are its pieces as they are."""
        scattered = tuple(a for a in by_hand if mesh.shape[a] > 1)
        if not (self.split_gradients and scattered):
            return None
        # As stored (see stored): [n_layers, ...], or [R, n_layers / R, ...] with the repeats whole.
        r, k, rest = shape_RxKxA[0], shape_RxKxA[1], shape_RxKxA[2:]
        stored, offset = ((self.stages * k, *rest), 1) if r == 1 else ((r, self.stages * k, *rest), 0)
        spec = rules.spec(self.stored_logical(names))
        split = split_over(stored, spec, rules.gradient_axes(mesh), mesh)
        entries = lambda p: list(p) + [None] * (len(stored) - len(p))  # noqa: E731
        for dim, (before, after) in enumerate(zip(entries(spec), entries(split), strict=True)):
            if before != after:  # The one dimension split_over added axes to, after those it had.
                current = spec_axes(before)
                added = spec_axes(after)[len(current) :]
                return dim + offset if added == scattered and set(current) <= {STAGE_AXIS} else None
        return None


def parse_stages(ranges: Sequence[object], n_layers: int) -> tuple[int, ...]:
    """Returns the layers per stage of ``pipeline.stages`` (e.g. ``["0-7", "8-15", "16-22", "23-29"]``:
    8, 8, 7, 7), raising ConfigError unless the ranges are contiguous, in order and cover every layer of
    ``n_layers`` once."""
    counts, expected = [], 0
    for i, entry in enumerate(ranges):
        key = f"pipeline.stages[{i}]={str(entry)!r}"
        bounds = None if isinstance(entry, bool) else layer_span(str(entry))
        if bounds is None:
            raise ConfigError(f'{key} is not a layer or a range of layers; write e.g. "0-7" or "8"')
        first, last = bounds
        if first > last:
            raise ConfigError(f'{key}: the range runs backwards; write it as "{last}-{first}"')
        if first != expected:
            where = f"the stages must be contiguous, in order: after layer {expected - 1} start at {expected}"
            if i == 0:
                where = "the first stage must start at layer 0"
            raise ConfigError(f"{key} starts at layer {first}; {where}")
        if last >= n_layers:
            raise ConfigError(
                f"{key}: layers run from 0 to {n_layers - 1} (model.n_layers={n_layers}); end the last "
                f"stage at layer {n_layers - 1}"
            )
        counts.append(last - first + 1)
        expected = last + 1
    if not counts:
        raise ConfigError('pipeline.stages=[]: give one range of layers per stage, e.g. ["0-3", "4-7"]')
    if expected != n_layers:
        raise ConfigError(
            f"pipeline.stages[{len(counts) - 1}]={str(ranges[-1])!r} ends at layer {expected - 1} but "
            f"model.n_layers={n_layers}; the stages must cover every layer: end the last one at "
            f"{n_layers - 1}"
        )
    return tuple(counts)


def _is_names(x) -> bool:
    """A leaf of a tree of logical axes (a PartitionSpec of names, or None)."""
    return x is None or isinstance(x, P)


def _is_stack(names) -> bool:
    """Whether a parameter with these logical axes is a stack of layers (``[n_layers, ...]``)."""
    return bool(names) and names[0] == "layers"


def _is_stored(leaf, names) -> bool:
    """Whether a stack of layers is as :meth:`Pipeline.stored` keeps it: one axis more than the model's
    logical axes (which the layers' variables still carry) name."""
    return _is_stack(names) and leaf.ndim == len(names) + 1


def _forward_only(f: Callable) -> Callable:
    """``f`` (a linear function such as a sharding constraint) on the forward pass; its cotangent passes
    back as it comes."""
    f_ = jax.custom_vjp(f)
    f_.defvjp(lambda x: (f(x), None), lambda _, ct: (ct,))
    return f_


def _run_one_of(index, functions: Sequence[Callable | None], carry):
    """Returns ``functions[index](carry)`` (``carry`` where that is None), as ``jax.lax.switch`` would run
    it, but with each function in a while loop that runs once where ``index`` is its own and never
    elsewhere. The loops carry ``carry``, which XLA updates in place; a conditional's branches copy what
    they return (on XLA:GPU all of it, each call: a 1F1B tick's residual rings and gradient sums). The
    loops are named as :data:`~shardmem.parallel.schedule.ONE_OF_SCOPE` says, for the step-time model."""
    for i, function in enumerate(functions):
        if function is None:
            continue
        trips = (index == i).astype(jnp.int32)
        with jax.named_scope(f"{ops.ONE_OF_SCOPE}_{len(functions)}/{i}"):
            _, carry = jax.lax.while_loop(lambda c, trips=trips: c[0] < trips,
                                          lambda c, function=function: (c[0] + 1, function(c[1])),
                                          (jnp.zeros((), jnp.int32), carry))  # fmt: skip
    return carry


def _on_state(branch: Callable, operands: tuple, carry: tuple):
    """A 1F1B op on the state of ``(state, sent, kept)``: ``branch(state, *operands)``."""
    return branch(carry[0], *operands)


def _put(buffer_NxA: jax.Array, slot, value_A: jax.Array) -> jax.Array:
    """Returns ``buffer`` with ``value`` at ``slot``, unchanged where ``slot`` is negative (none)."""
    at = jnp.maximum(slot, 0)
    old_A = jax.lax.dynamic_index_in_dim(buffer_NxA, at, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer_NxA, jnp.where(slot >= 0, value_A, old_A), at, 0)
