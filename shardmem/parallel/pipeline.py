"""Pipeline parallelism: the layer stack split into stages over a ``stage`` mesh axis.

    pipeline = Pipeline(stages=4, micro_batches=8)          # GPipe; repeats=2 for the circular schedule
    x_BxLxD = pipeline.run(model.layers, x_BxLxD, plan)      # in place of remat_scan(model.layers, ...)
    pipeline.bubble_fraction                                 # (S - 1) / (M * R + S - 1)

The scan-over-ticks formulation (as in MaxText): every tick, each of the S stages runs its chunk of K
layers on one micro-batch -- one ``jax.vmap`` over the stage dimension of the state ``[S, mb, L, D]``,
sharded over ``stage`` (``spmd_axis_name``) -- and the outputs shift one stage on (``jnp.roll``, which XLA
turns into a collective-permute). Stage 0 reads micro-batch ``t % M`` from a buffer holding the inputs;
the last stage writes its output back into that buffer, where, in the circular schedule (``repeats`` R > 1,
chunk ``(r, s)`` = layers ``(r * S + s) * K ...``), stage 0 picks it up again for the next repeat. A whole
step is ``M * R + S - 1`` ticks, of which each stage idles ``S - 1``: the bubble. Every device runs the
same program on same-shaped buffers, so one device's compiled peak is every stage's.

Stages need not be even (GPipe only): ``layer_counts`` gives each stage's number of contiguous layers
(``pipeline.stages: ["0-7", "8-15", "16-22", "23-29"]`` in the config, see :func:`parse_stages`); without
it the split is the most even one, the first stages one layer more (30 layers on 4 stages: 8, 8, 7, 7).
One program runs every stage, so each runs ``max(layer_counts)`` layer slots per tick; a stage's slots
past its own layers repeat its last layer with the output masked to the input (``jnp.where``), so they
cost their FLOPs (counted in the plan) but change nothing and get zero gradients.

Parameters stay stored as the model stacks them (``[n_layers, ...]``, the ``layers`` axis sharded over
``stage`` when the stage count divides ``n_layers``, else replicated over it: :meth:`Pipeline.storage_rules`),
so a checkpoint does not depend on the stage count or the split. With R = 1 and an even split stage ``s``
holds its own contiguous layers and nothing moves; with R > 1 its chunks are strided, and with uneven
stages each stage's layers are gathered into ``[S, K_max, ...]`` in the step: XLA moves them into place
each step (the plan's collectives show the bytes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardmem.errors import ConfigError
from shardmem.parallel.rules import Rules, constrain
from shardmem.remat import LayerPlan, layer_span, remat_scan

#: The mesh axis whose size is the number of pipeline stages.
STAGE_AXIS = "stage"


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """``stages`` pipeline stages, ``micro_batches`` micro-batches per step, ``repeats`` layer chunks per
    stage (1: GPipe; more: the circular schedule)."""

    stages: int
    micro_batches: int
    repeats: int = 1
    layer_counts: tuple[int, ...] = ()  # Layers per stage, in order (empty: the most even split).

    def split(self, n_layers: int) -> tuple[int, ...]:
        """Returns each stage's number of layers: ``layer_counts``, else the most even split of
        ``n_layers``, the first stages one layer more (30 on 4 stages: 8, 8, 7, 7)."""
        if self.layer_counts:
            return self.layer_counts
        base, extra = divmod(n_layers, self.stages)
        return (base + 1,) * extra + (base,) * (self.stages - extra)

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

    @property
    def ticks(self) -> int:
        """Steps of the schedule: every micro-batch through every chunk, plus the fill and drain."""
        return self.micro_batches * self.repeats + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """Share of each stage's ticks spent idle: ``(S - 1) / (M * R + S - 1)`` (GPipe for R = 1)."""
        return (self.stages - 1) / self.ticks

    def describe(self) -> str:
        """Returns e.g. "4 stages x 8 micro-batches (GPipe): bubble (4-1)/(8+4-1) = 27.3%"."""
        s, m, r = self.stages, self.micro_batches, self.repeats
        schedule = "GPipe" if r == 1 else f"circular, {r} layer chunks per stage"
        formula = f"({s}-1)/({m}" + (f"x{r}" if r > 1 else "") + f"+{s}-1)"
        return f"{s} stages x {m} micro-batches ({schedule}): bubble {formula} = {self.bubble_fraction:.1%}"

    @classmethod
    def from_json(cls, data: dict) -> Pipeline:
        """The inverse of :meth:`to_json` (a report's ``pipeline`` entry)."""
        return cls(data["stages"], data["micro_batches"], data["repeats"])

    def to_json(self, n_layers: int | None = None) -> dict:
        """Returns the schedule as JSON-ready data (the plan's ``pipeline`` entry); with ``n_layers``, also
        the layers per stage and the padded (masked) layer slots."""
        out = {"stages": self.stages, "micro_batches": self.micro_batches, "repeats": self.repeats,
               "ticks": self.ticks, "bubble_fraction": self.bubble_fraction}  # fmt: skip
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

    def run(self, layers: nnx.Module, x_BxLxD: jax.Array, plan: LayerPlan) -> jax.Array:
        """Runs stacked layers (as :func:`~shardmem.remat.remat_scan` does) through the pipeline schedule;
        returns the last layer's output for the whole batch, in its rows' order."""
        graphdef, params, rest = nnx.split(layers, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ConfigError(
                f"mesh.axes.stage={self.stages}: the layers hold variables other than parameters (batch "
                "statistics, RNG streams), which a pipeline cannot carry between stages; set "
                "mesh.axes.stage=1"
            )
        n_layers = jax.tree.leaves(params)[0].shape[0]
        self.check(n_layers, plan)
        s, m, r = self.stages, self.micro_batches, self.repeats
        counts = self.split(n_layers)
        even = len(set(counts)) == 1  # Always with R > 1 (check), whose chunks split a stage's layers.
        k = n_layers // (s * r) if even else max(counts)
        chunk_plan = self.chunk_plan(plan, n_layers)
        logical = nnx.to_pure_dict(nnx.get_partition_spec(params))
        starts = [sum(counts[:i]) for i in range(s)]

        def to_chunks(leaf, names):
            # [n_layers, ...] -> [R, S, K, ...]: chunk (r, s) holds layers (r * S + s) * K ... + K - 1.
            rest_names = tuple(names)[1:] if names is not None else (None,) * (leaf.ndim - 1)
            if even:
                chunked = leaf.reshape(r, s, k, *leaf.shape[1:])
            else:  # Static slices, each stage's padded with copies of its last layer (masked in the run).
                chunked = jnp.stack([
                    jnp.concatenate([leaf[a:a + n], *[leaf[a + n - 1:a + n]] * (k - n)]) if n < k
                    else leaf[a:a + n] for a, n in zip(starts, counts, strict=True)
                ])[None]  # fmt: skip
            return constrain(chunked, (None, "layers", None, *rest_names))

        chunks = jax.tree.map(to_chunks, nnx.to_pure_dict(params), logical,
                              is_leaf=lambda x: x is None or isinstance(x, P))  # fmt: skip
        stage_ids_S = jnp.arange(s)
        # Which of each stage's K slots hold one of its layers (None: all do).
        valid_SxK = None if even else jnp.arange(k)[None, :] < jnp.asarray(counts)[:, None]

        def stage(weights, x_mbxLxD, valid_K=None):
            return remat_scan(nnx.merge(graphdef, weights, rest), x_mbxLxD, chunk_plan, mask=valid_K)

        run_stages = jax.vmap(stage, spmd_axis_name=STAGE_AXIS)

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

        def circular_stage(weights, x_mbxLxD, repeat):  # weights [K, R, ...]: every repeat of the chunk.
            module = nnx.merge(graphdef, weights, rest)
            return remat_scan(module, x_mbxLxD, chunk_plan, prepare=select_repeat(repeat))

        run_circular = jax.vmap(circular_stage, spmd_axis_name=STAGE_AXIS)
        if r > 1:  # [R, S, K, ...] -> [S, K, R, ...]: each stage's layers with all their repeats.
            chunks = jax.tree.map(lambda c: jnp.moveaxis(c, 0, 2), chunks)

        batch = x_BxLxD.shape[0]
        # Micro-batch i takes every M-th row, so each device keeps its own rows (as gradient accumulation).
        micro_MxBxLxD = x_BxLxD.reshape(batch // m, m, *x_BxLxD.shape[1:]).swapaxes(0, 1)
        # One copy per stage of the micro-batch buffer, sharded over stage: only stage 0's is read, but a
        # replicated buffer would need a broadcast from the last stage every tick.
        buffer_SxMxBxLxD = constrain(jnp.broadcast_to(micro_MxBxLxD, (s, *micro_MxBxLxD.shape)),
                                     ("layers", None, "batch", "seq", None))  # fmt: skip
        state_SxBxLxD = constrain(jnp.zeros_like(buffer_SxMxBxLxD[:, 0]), ("layers", "batch", "seq", None))
        at_stage0 = (stage_ids_S == 0).reshape(s, *(1,) * (state_SxBxLxD.ndim - 1))

        def tick(carry, t):
            state_SxBxLxD, buffer_SxMxBxLxD = carry
            fresh_SxBxLxD = jax.lax.dynamic_index_in_dim(buffer_SxMxBxLxD, t % m, 1, keepdims=False)
            inputs_SxBxLxD = jnp.where(at_stage0, fresh_SxBxLxD, state_SxBxLxD)
            if r == 1:
                weights = jax.tree.map(lambda c: c[0], chunks)
                out_SxBxLxD = (run_stages(weights, inputs_SxBxLxD) if valid_SxK is None
                               else run_stages(weights, inputs_SxBxLxD, valid_SxK))  # fmt: skip
            else:  # Stage s is at repeat (t - s) // M (clipped in the fill and the drain).
                repeat_S = jnp.clip((t - stage_ids_S) // m, 0, r - 1)
                out_SxBxLxD = run_circular(chunks, inputs_SxBxLxD, repeat_S)
            # Stage s's output moves to stage s + 1, the last stage's to stage 0: a collective-permute.
            shifted_SxBxLxD = constrain(jnp.roll(out_SxBxLxD, 1, axis=0), ("layers", "batch", "seq", None))
            slot = (t - (s - 1)) % m  # The micro-batch the last stage just finished (from tick S - 1 on).
            old_SxBxLxD = jax.lax.dynamic_index_in_dim(buffer_SxMxBxLxD, slot, 1, keepdims=False)
            written = jnp.where(t >= s - 1, shifted_SxBxLxD, old_SxBxLxD)
            buffer_SxMxBxLxD = jax.lax.dynamic_update_index_in_dim(buffer_SxMxBxLxD, written, slot, 1)
            return (shifted_SxBxLxD, buffer_SxMxBxLxD), None

        with jax.named_scope("pipeline"):
            (_, buffer_SxMxBxLxD), _ = jax.lax.scan(tick, (state_SxBxLxD, buffer_SxMxBxLxD),
                                                    jnp.arange(self.ticks))  # fmt: skip
            # Stage 0's buffer holds the results; a masked sum over stages is one all-reduce of the
            # batch's activations (taking index 0 of a stage-sharded axis would gather all S copies).
            out_MxBxLxD = jnp.sum(jnp.where(at_stage0[:, None], buffer_SxMxBxLxD, 0), axis=0)
        out_BxLxD = out_MxBxLxD.swapaxes(0, 1).reshape(x_BxLxD.shape)
        return constrain(out_BxLxD, ("batch", "seq", None))


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
