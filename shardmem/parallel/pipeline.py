"""Pipeline parallelism: the layer stack split into stages over a ``stage`` mesh axis.

    pipeline = Pipeline(stages=4, micro_batches=8)          # GPipe; repeats=2 for the circular schedule
    x_BxLxD = pipeline.run(model.layers, x_BxLxD, plan)      # in place of remat_scan(model.layers, ...)
    pipeline.bubble_fraction                                 # (S - 1) / (M * R + S - 1)
    Pipeline(4, 8, schedule="1f1b").in_flight                # 7 = 2 * S - 1 micro-batches' residuals

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

    loss = pipeline.loss(model.layers, x_BxLxD, plan, head_params, targets_BxL, head_loss)

Each tick every stage runs one forward pass (``jax.vjp`` of its chunk: the output, and the residuals it
keeps in a ring of :attr:`Pipeline.in_flight` slots, less the weights) and one backward pass (the
pullback of a pass whose output gradient arrived, from its slot). The last chunk's output goes through
``head_loss`` in the tick it is made, whose gradient starts that micro-batch's backward at once; each
gradient reaches the stage before one tick later. Micro-batches go in groups of S, each group through
all R repeats, so a pass at stage s, repeat r waits ``2 * ((R - r) * S - 1 - s)`` ticks for its backward
and the ring needs ``min(M * R, 2 * R * S - 1)`` slots whatever M: the peak stays flat as micro-batches
are added. (Megatron-LM's 1F1B keeps ``S - s`` micro-batches at stage s; its stages run out of step, a
forward on one while its neighbour runs a backward. Here every stage runs the same program in step, so a
micro-batch takes a tick per stage each way, and the first stage holds about twice as many.) The first
``R * S - 1`` ticks run forwards alone and the last ``R * S - 1`` backwards alone, so the bubble is
``(S - 1) / (M * R + S - 1)``, GPipe's and circular's. The gradients come out of a ``jax.custom_vjp``
whose forward runs the schedule, so the step differentiates the loss as any other. Every stage runs the
head on its output, masked but for the last stage's last chunk (one program for all): the plan counts
those FLOPs.

Stages need not be even (GPipe and 1F1B): ``layer_counts`` gives each stage's number of contiguous layers
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
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardmem.errors import ConfigError
from shardmem.parallel.rules import Rules, constrain
from shardmem.remat import LayerPlan, layer_span, remat_scan

#: The mesh axis whose size is the number of pipeline stages.
STAGE_AXIS = "stage"

#: ``pipeline.schedule``: how the micro-batches go through the stages (see the module docstring).
SCHEDULES = {
    "gpipe": "every micro-batch forward, then every one backward (JAX differentiates the forward ticks)",
    "circular": "GPipe with pipeline.repeats layer chunks per stage: a smaller bubble",
    "1f1b": "a forward and a backward each tick: the residuals of at most 2 x stages - 1 micro-batches",
    "interleaved": "1F1B with pipeline.repeats layer chunks (virtual stages) per stage: a smaller bubble",
}


class _Stages(NamedTuple):
    """The layers as the stages run them (:meth:`Pipeline._stages`)."""

    weights_S: dict  # The stored parameters with a leading stage axis: [S, K, ...] or [S, K, R, ...].
    run_stage: Callable  # (weights, x_bxLxD, repeat, valid_K) -> one stage's chunk applied to x.
    valid_SxK: jax.Array | None  # Which of each stage's K layer slots hold a layer (None: all do).


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """``stages`` pipeline stages, ``micro_batches`` micro-batches per step, ``repeats`` layer chunks per
    stage, run by ``schedule`` (a key of :data:`SCHEDULES`; None: GPipe, or circular for ``repeats`` > 1)."""

    stages: int
    micro_batches: int
    repeats: int = 1
    layer_counts: tuple[int, ...] = ()  # Layers per stage, in order (empty: the most even split).
    schedule: str | None = None  # None: "gpipe", or "circular" for repeats > 1.

    def __post_init__(self):
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
        """Steps of the schedule: every micro-batch through every chunk, plus the fill and drain (each of
        the forward and backward loops for GPipe; 1F1B's one loop runs both, forwards alone in its first
        ``R * S - 1`` ticks and backwards alone in its last ``R * S - 1``)."""
        m, r, s = self.micro_batches, self.repeats, self.stages
        return m * r + r * s + s - 2 if self.runs_loss else m * r + s - 1

    @property
    def bubble_fraction(self) -> float:
        """Share of each stage's time spent idle: ``(S - 1) / (M * R + S - 1)``, every schedule's (GPipe
        and 1F1B for R = 1; Narayanan et al. 2021, eq. 1 and its interleaved form)."""
        return (self.stages - 1) / (self.micro_batches * self.repeats + self.stages - 1)

    @property
    def in_flight(self) -> int:
        """Micro-batch passes through one stage chunk whose residuals a stage holds at its peak: every
        tick's for GPipe and circular (JAX saves each forward tick's for the backward pass, idle ones
        too), ``min(M * R, 2 * R * S - 1)`` for 1F1B and interleaved (a ring of that many slots: a pass
        at stage s waits ``2 * ((R - r) * S - 1 - s)`` ticks for its backward)."""
        m, r, s = self.micro_batches, self.repeats, self.stages
        return min(m * r, 2 * r * s - 1) if self.runs_loss else m * r + s - 1

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
        return cls(data["stages"], data["micro_batches"], data["repeats"], schedule=data.get("schedule"))

    def to_json(self, n_layers: int | None = None) -> dict:
        """Returns the schedule as JSON-ready data (the plan's ``pipeline`` entry); with ``n_layers``, also
        the layers per stage and the padded (masked) layer slots."""
        out = {"stages": self.stages, "micro_batches": self.micro_batches, "repeats": self.repeats,
               "schedule": self.schedule, "ticks": self.ticks, "bubble_fraction": self.bubble_fraction,
               "in_flight": self.in_flight}  # fmt: skip
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

    def _stages(self, layers: nnx.Module, plan: LayerPlan) -> _Stages:
        """Returns the layers as each stage runs them: their weights with a leading stage axis and the
        one-stage function the schedules vmap over it."""
        graphdef, params, rest = nnx.split(layers, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ConfigError(
                f"mesh.axes.stage={self.stages}: the layers hold variables other than parameters (batch "
                "statistics, RNG streams), which a pipeline cannot carry between stages; set "
                "mesh.axes.stage=1"
            )
        n_layers = jax.tree.leaves(params)[0].shape[0]
        self.check(n_layers, plan)
        s, r = self.stages, self.repeats
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
        # [R, S, K, ...] -> [S, K, ...] (R = 1) or [S, K, R, ...]: each stage's layers, all their repeats.
        weights_S = jax.tree.map((lambda c: c[0]) if r == 1 else (lambda c: jnp.moveaxis(c, 0, 2)), chunks)
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

        def run_stage(weights, x_mbxLxD, repeat, valid_K):
            """One stage's chunk at ``repeat`` (weights [K, ...], or [K, R, ...] for R > 1) on ``x``."""
            module = nnx.merge(graphdef, weights, rest)
            if r > 1:
                return remat_scan(module, x_mbxLxD, chunk_plan, prepare=select_repeat(repeat))
            return remat_scan(module, x_mbxLxD, chunk_plan, mask=valid_K)

        return _Stages(weights_S, run_stage, valid_SxK)

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

    def loss(self, layers: nnx.Module, x_BxLxD: jax.Array, plan: LayerPlan, head_params,
             targets_BxA: jax.Array, head_loss: Callable) -> jax.Array:  # fmt: skip
        """Returns the mean over the micro-batches of ``head_loss(head_params, y_bxLxD, targets_bxA)``,
        ``y`` the last layer's output, the gradients of ``layers``, ``head_params`` and ``x_BxLxD``
        computed by the 1F1B schedule (:attr:`schedule` ``1f1b`` or ``interleaved``) as it runs: see the
        module docstring. Differentiate it as any loss; its backward pass only scales those gradients."""
        stages = self._stages(layers, plan)
        s, m, r = self.stages, self.micro_batches, self.repeats
        chunks, slots = r * s, self.in_flight
        stage_ids_S = jnp.arange(s)
        is_first, is_last = stage_ids_S == 0, stage_ids_S == s - 1
        spec = ("layers", "batch", "residual_seq", None)
        pullback_layout: dict = {}  # The forward pullback's structure, recorded when it is traced.

        def forward(weights, x_bxLxD, repeat, valid_K):
            """One stage's chunk forward; returns its output and the residuals its backward needs, less
            the weights (the same every tick, so not stored per micro-batch)."""

            def run(w, x):
                return stages.run_stage(w, x, repeat, valid_K)

            y_bxLxD, pullback = jax.vjp(run, weights, x_bxLxD)
            leaves, pullback_layout["treedef"] = jax.tree.flatten(pullback)
            weight_at = {id(w): i for i, w in enumerate(jax.tree.leaves(weights))}
            pullback_layout["weight_at"] = [weight_at.get(id(leaf)) for leaf in leaves]
            return y_bxLxD, [leaf for leaf in leaves if id(leaf) not in weight_at]

        def backward(weights, residuals, dy_bxLxD):
            """One stage's chunk backward from the residuals ``forward`` kept: (d weights, d input)."""
            weight_leaves, stored = jax.tree.leaves(weights), iter(residuals)
            at_weights = pullback_layout["weight_at"]
            leaves = [next(stored) if at is None else weight_leaves[at] for at in at_weights]
            return jax.tree.unflatten(pullback_layout["treedef"], leaves)(dy_bxLxD)

        def head(head_params, y_bxLxD, targets_bxA, scale):
            loss, pullback = jax.vjp(lambda h, y: head_loss(h, y, targets_bxA), head_params, y_bxLxD)
            return (loss, *pullback(scale))

        def store(ring_NxA, slot, live, new_A):
            old_A = jax.lax.dynamic_index_in_dim(ring_NxA, slot, 0, keepdims=False)
            return jax.lax.dynamic_update_index_in_dim(ring_NxA, jnp.where(live, new_A, old_A), slot, 0)

        def load(ring_NxA, slot):
            return jax.lax.dynamic_index_in_dim(ring_NxA, slot, 0, keepdims=False)

        valid_axis = 0 if stages.valid_SxK is not None else None
        forward_S = jax.vmap(forward, in_axes=(0, 0, 0, valid_axis), spmd_axis_name=STAGE_AXIS)
        backward_S = jax.vmap(backward, spmd_axis_name=STAGE_AXIS)
        head_S = jax.vmap(head, in_axes=(None, 0, None, 0), spmd_axis_name=STAGE_AXIS)
        store_S = jax.vmap(store, spmd_axis_name=STAGE_AXIS)
        load_S = jax.vmap(load, spmd_axis_name=STAGE_AXIS)

        def where_S(mask_S, a, b):
            return jax.tree.map(lambda x, y: jnp.where(mask_S.reshape(s, *(1,) * (x.ndim - 1)), x, y), a, b)

        def position(order):
            """Micro-batch and repeat of a stage's forward pass number ``order`` (its backward passes run
            the repeats in reverse): groups of S micro-batches, each group through all R repeats."""
            group, within = order // chunks, order % chunks
            return jnp.clip(group * s + within % s, 0, m - 1), within // s

        def schedule(weights_S, head_params, micro_MxbxLxD, targets_MxbxA):
            """Runs every tick; returns the loss and the gradients of the three differentiable inputs."""
            # One copy per stage of the inputs and of their gradients, sharded over stage (as in run).
            inputs_SxMxbxLxD = constrain(jnp.broadcast_to(micro_MxbxLxD, (s, *micro_MxbxLxD.shape)),
                                         ("layers", None, "batch", "residual_seq", None))  # fmt: skip
            zeros_SxbxLxD = constrain(jnp.zeros_like(inputs_SxMxbxLxD[:, 0]), spec)
            _, residual_shapes = jax.eval_shape(forward_S, weights_S, zeros_SxbxLxD, stage_ids_S,
                                                stages.valid_SxK)  # fmt: skip
            carry = dict(
                forward_in=zeros_SxbxLxD, backward_in=zeros_SxbxLxD,
                rings=[jnp.zeros((s, slots, *a.shape[1:]), a.dtype) for a in residual_shapes],
                d_weights=jax.tree.map(jnp.zeros_like, weights_S),
                d_head=jax.tree.map(lambda h: jnp.zeros((s, *h.shape), h.dtype), head_params),
                d_inputs=jnp.zeros_like(inputs_SxMxbxLxD), loss=jnp.zeros((s,), jnp.float32),
            )  # fmt: skip

            def tick(carry, t, forwards, backwards):
                carry = dict(carry)
                dy_head_S = None
                if forwards:
                    order_S = t - stage_ids_S  # Each stage's forward pass number.
                    valid_S = (order_S >= 0) & (order_S < m * r)
                    _, repeat_S = position(order_S)
                    fresh = jax.lax.dynamic_index_in_dim(inputs_SxMxbxLxD, position(t)[0], 1, keepdims=False)
                    x_SxbxLxD = where_S(is_first & (repeat_S == 0), fresh, carry["forward_in"])
                    y_SxbxLxD, residuals = forward_S(weights_S, constrain(x_SxbxLxD, spec), repeat_S,
                                                     stages.valid_SxK)  # fmt: skip
                    rings = zip(carry["rings"], residuals, strict=True)
                    carry["rings"] = [store_S(ring, order_S % slots, valid_S, new) for ring, new in rings]
                    # The last chunk's output goes through the head, whose gradient starts its backward.
                    ends_S = valid_S & is_last & (repeat_S == r - 1)
                    targets = jax.lax.dynamic_index_in_dim(targets_MxbxA, position(t - (s - 1))[0], 0, False)
                    loss_S, d_head_S, dy_head_S = head_S(head_params, y_SxbxLxD, targets,
                                                         jnp.where(ends_S, 1.0 / m, 0.0))  # fmt: skip
                    carry["loss"] = carry["loss"] + jnp.where(ends_S, loss_S / m, 0.0)
                    carry["d_head"] = jax.tree.map(jnp.add, carry["d_head"], d_head_S)
                    # Stage s's output moves to stage s + 1, the last's to stage 0: a collective-permute.
                    carry["forward_in"] = constrain(jnp.roll(y_SxbxLxD, 1, axis=0), spec)
                if backwards:
                    # Each stage's backward pass number: the last stage's first runs in the tick of its
                    # forward, and each pass reaches the stage before one tick later.
                    order_S = t - (chunks - 1) - (s - 1 - stage_ids_S)
                    valid_S = (order_S >= 0) & (order_S < m * r)
                    micro_S, reverse_S = position(order_S)
                    repeat_S = r - 1 - reverse_S
                    forward_order_S = order_S // chunks * chunks + repeat_S * s + order_S % s
                    dy_SxbxLxD = carry["backward_in"]
                    if dy_head_S is not None:
                        dy_SxbxLxD = where_S(is_last & (repeat_S == r - 1), dy_head_S, dy_SxbxLxD)
                    residuals = [load_S(ring, forward_order_S % slots) for ring in carry["rings"]]
                    # An idle stage's pass gets a zero output gradient, so zero weight gradients: added
                    # unmasked, so XLA may move their data-parallel all-reduce out of the loop.
                    dy_SxbxLxD = where_S(valid_S, dy_SxbxLxD, jnp.zeros_like(dy_SxbxLxD))
                    d_weights_S, dx_SxbxLxD = backward_S(weights_S, residuals, constrain(dy_SxbxLxD, spec))
                    carry["d_weights"] = jax.tree.map(jnp.add, carry["d_weights"], d_weights_S)
                    # Stage 0's first chunk gives the gradient of the layers' input.
                    at = position(t - (chunks - 1) - (s - 1))[0]
                    old = jax.lax.dynamic_index_in_dim(carry["d_inputs"], at, 1, keepdims=False)
                    new = where_S(valid_S & is_first & (repeat_S == 0), dx_SxbxLxD, old)
                    carry["d_inputs"] = jax.lax.dynamic_update_index_in_dim(carry["d_inputs"], new, at, 1)
                    # Stage s's input gradient moves to stage s - 1, stage 0's to the last stage.
                    carry["backward_in"] = constrain(jnp.roll(dx_SxbxLxD, -1, axis=0), spec)
                return carry, None

            # Fill: forwards only; steady: a forward and a backward each tick; drain: backwards only.
            phases = (("fill", 0, chunks - 1, True, False),
                      ("steady", chunks - 1, m * r + s - 1, True, True),
                      ("drain", m * r + s - 1, m * r + chunks + s - 2, False, True))  # fmt: skip
            for name, first, stop, forwards, backwards in phases:
                if stop > first:
                    with jax.named_scope(f"pipeline_{name}"):
                        body = functools.partial(tick, forwards=forwards, backwards=backwards)
                        carry, _ = jax.lax.scan(body, carry, jnp.arange(first, stop))
            # Masked sums over stages: one all-reduce each (taking index 0 of a stage-sharded axis would
            # gather all S copies).
            d_micro = jnp.sum(jnp.where(is_first.reshape(s, 1, 1, 1, 1), carry["d_inputs"], 0), axis=0)
            d_head = jax.tree.map(lambda d: jnp.sum(d, axis=0), carry["d_head"])
            return jnp.sum(carry["loss"]), (carry["d_weights"], d_head, d_micro)

        @jax.custom_vjp
        def pipelined(weights_S, head_params, micro_MxbxLxD, targets_MxbxA):
            return schedule(weights_S, head_params, micro_MxbxLxD, targets_MxbxA)[0]

        def scaled(grads, g):
            return (*jax.tree.map(lambda d: (g * d).astype(d.dtype), grads), None)

        pipelined.defvjp(schedule, scaled)
        return pipelined(stages.weights_S, head_params, self._micro_batches(x_BxLxD),
                         self._micro_batches(targets_BxA))  # fmt: skip


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
