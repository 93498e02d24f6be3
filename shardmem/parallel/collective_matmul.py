"""Tensor-parallel matmuls overlapped with the sequence-parallel collectives around them: "collective
matmuls" (Wang et al., ASPLOS 2023; Megatron-LM and NeMo's ``tp_comm_overlap``).

    q, k, v = gather_matmul(project_qkv, h_BxLxD, weights, weight_axes, output_axes)
    out_BxLxD = matmul_scatter(project_out, ctx_BxLxHxK, w_out, weight_axes, input_axes)
    out_BxLxD = gather_matmul_scatter(project_in, activation, project_out, h_BxLxD, ...)   # an MLP

With sequence parallelism (``rules.residual_seq`` over the tensor axis) each of the ``n`` devices of the
tensor axis holds ``1/n`` of the residual stream's tokens. A column-parallel projection (queries, keys,
values; the MLP's gate and up) needs all of them: an all-gather, then the matmul. A row-parallel one (the
attention's output, the MLP's down projection) makes a partial sum of every token: the matmul, then a
reduce-scatter. Done whole, the matmul waits for the gather and the scatter for the matmul. Here both run
in ``n`` steps inside ``jax.shard_map`` over the tensor axis, a step's transfer (``jax.lax.ppermute``)
under another step's matmul:

- the gather (:func:`gather_matmul`): step ``i`` multiplies the tokens of the device ``i`` places to the
  right (its own first) while those of the next arrive;
- the scatter (:func:`matmul_scatter`): step ``i`` multiplies the tokens of the device ``i`` places to
  the right while the previous step's partial sum travels to its owner; each device adds the ``n - 1``
  it receives to its own in one pass (a ring that adds as it goes would add ``n - 1`` times).

Their backward passes run the same way (``jax.custom_vjp``): the gather's sends the input gradient's
partial sums to their owners while the input's chunks arrive again for the weight gradient (so a layer
keeps its share of the tokens, as Megatron's sequence-parallel linear layers do); the scatter's receives
the output gradient's chunks, each feeding the input's gradient and the weight's. In an MLP
(:func:`gather_matmul_scatter`) the chunks go from one to the other as they are, never assembled.

XLA would undo the chunking: its dot merger joins the chunks' matmuls into one (they share the weight),
and every transfer then runs before it. An ``optimization_barrier`` after each step ties what the next
step multiplies to the transfer in flight, so each transfer has a matmul to hide under, which the
latency-hiding scheduler then runs beside it -- where the schedule has the memory to: past its memory
limit the scheduler overlaps nothing, these transfers or XLA's own collectives (BENCHMARKS.md, issue 38
item 3). The shard_map is manual over the tensor axis alone; the compiler splits the rest (the batch over
data axes, the sequence over context, weights over FSDP) as everywhere. Where the tensor axis splits the
rows, a device keeps the gathered rows in its own order, its own first (every op between a gather and its
scatter treats rows alike), so no chunk is placed at a traced index. Not in a pipeline's stages
(:func:`resolve` says why).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardmem.errors import ConfigError
from shardmem.finetune.lora import Adapted
from shardmem.finetune.quant import Quantized
from shardmem.parallel.rules import Rules, activation_spec, active, manual_axes, spec_axes

#: ``project(x_chunk, weights)``: the projection(s) of a chunk of tokens, linear in ``x_chunk``.
Project = Callable


def overlap_axis(rules: Rules, mesh_shape) -> str | None:
    """Returns the mesh axis that sequence parallelism adds to the layers' sequence split and that the
    tensor-parallel weights are split over (``heads``, ``kv_heads`` and ``mlp`` all on it): the axis
    the collective matmuls exchange chunks over. None where there is no such axis of several devices."""
    seq = set(rules.mesh_axes("seq") or ())
    extra = [a for a in rules.mesh_axes("residual_seq") or () if a not in seq]
    if len(extra) != 1 or mesh_shape[extra[0]] == 1:
        return None
    axis = extra[0]
    weights = {rules.mesh_axes(name) for name in ("heads", "kv_heads", "mlp")}
    return axis if weights == {(axis,)} else None


def resolve(requested: bool, rules: Rules, mesh, *, reference_model: bool, pipelined: bool) -> bool:
    """Whether the reference model's projections run as collective matmuls: ``overlap.tensor_parallel``
    (``requested``), which needs sequence parallelism with an overlap axis (:func:`overlap_axis`), the
    reference model and no pipeline (a ConfigError where it cannot be).

    Not in pipeline stages: 1F1B runs each stage's op in a ``jax.lax.switch`` branch, so the devices of
    other stages run other branches, and a collective-permute's rendezvous spans every device of its
    source-target pairs, not one tensor group as an all-gather's replica groups do (8 CPU devices
    deadlocked, or paired permutes of different branches); GPipe's stages are vmapped."""
    if not requested:
        return False
    key = "overlap.tensor_parallel=true"
    if not reference_model:
        raise ConfigError(f"{key} runs the reference model's projections as collective matmuls, but the "
                          "model is your own (model.factory); remove the key")  # fmt: skip
    if overlap_axis(rules, mesh.shape) is None:
        seq, residual = rules.mesh_axes("seq") or (), rules.mesh_axes("residual_seq") or ()
        names = ("heads", "kv_heads", "mlp")
        weights = ", ".join(f"rules.{n}={list(rules.mesh_axes(n) or ())}" for n in names)
        raise ConfigError(
            f"{key} overlaps sequence parallelism's all-gathers and reduce-scatters: it needs one mesh axis "
            f"of more than one device that rules.residual_seq={list(residual)} adds to rules.seq="
            f"{list(seq)} and that splits the tensor-parallel weights ({weights}); e.g. rules.residual_seq: "
            "[tensor] with heads, kv_heads and mlp on tensor, or remove the key"
        )
    if pipelined:
        raise ConfigError(f"{key}: a pipeline's stages run their layers without collective matmuls (1F1B "
                          "runs a stage's op in a switch branch the other stages skip, which their transfers "
                          "cannot span); remove the key or the stage axis")  # fmt: skip
    return True


def describe(enabled: bool, rules: Rules, mesh, *, reference_model: bool, pipelined: bool) -> str:
    """The plan's line on how sequence parallelism's collectives run ("" without them)."""
    axis = overlap_axis(rules, mesh.shape)
    if axis is None:
        return ""
    n = mesh.shape[axis]
    if enabled:
        return (f"collective matmuls: sequence parallelism's all-gathers and reduce-scatters over {axis}={n} "
                f"in {n} chunks under the projections (overlap.tensor_parallel)")  # fmt: skip
    if not reference_model or pipelined:
        return ""
    return (f"sequence parallelism's all-gathers and reduce-scatters over {axis}={n} whole around the "
            "projections; overlap.tensor_parallel: true runs them in chunks under them")  # fmt: skip


def gather_matmul(project: Project, x, weights: tuple, weight_axes, output_axes) -> tuple:
    """Returns ``project(x gathered over the overlap axis, weights)``, a tuple of arrays, the gather run in
    chunks under the matmuls. ``x`` is a residual-stream activation (``[batch, seq, d_model]``) split
    over the overlap axis (:func:`overlap_axis`) as sequence parallelism splits it; ``weights`` a tuple
    of plain, quantized or adapted values (:func:`shardmem.finetune.lora.project` reads them) with
    logical axes ``weight_axes`` (one tuple each); ``output_axes`` name each output's dimensions, whose
    tensor-parallel one comes back split."""
    layout = _Layout.of(x.shape)
    weights, weight_specs = layout.weights(weights, weight_axes, x.dtype)
    gather = _gather(project, layout, assembled=True)
    specs = (layout.spec(None), weight_specs)
    out_specs = tuple(map(layout.spec, output_axes))
    body = layout.shard_map(lambda x, w: gather(layout.merge(x), w), specs, out_specs)
    return tuple(layout.unchunk(y) for y in body(layout.chunk(x), weights))


def matmul_scatter(project: Project, x, weight, weight_axes, input_axes):
    """Returns ``project(x, weight)`` summed over the overlap axis and split over it as the residual
    stream is (a reduce-scatter), run in chunks under the matmuls. ``x`` holds every token of the
    device's rows, its tensor-parallel dimension (named in ``input_axes``) split."""
    layout = _Layout.of((*x.shape[:2], 1))
    (weight,), (weight_spec,) = layout.weights((weight,), (weight_axes,), x.dtype)
    scatter = _scatter(project, layout, assembled=True)
    # x enters whole (chunked inside the custom_vjp): it is then the very value the layer saves for the
    # backward pass (the attention's output), not a reshaped copy saved beside it.
    specs = (layout.spec(input_axes, chunked=False), weight_spec)
    body = layout.shard_map(lambda x, w: layout.split(scatter(x, w)), specs, layout.spec(None))
    return layout.unchunk(body(x, weight))


def gather_matmul_scatter(project_in: Project, activation: Callable, project_out: Project, x,
                          weights_in: tuple, weight_in_axes, weight_out, weight_out_axes):  # fmt: skip
    """Returns ``project_out(activation(*project_in(x gathered, weights_in)), weight_out)``, reduce-
    scattered: :func:`gather_matmul` then :func:`matmul_scatter` in one shard_map, ``activation`` (per
    token, e.g. a gated MLP's) applied to each chunk of tokens as it is made, so that none is assembled."""
    layout = _Layout.of(x.shape)
    weights_in, specs_in = layout.weights(weights_in, weight_in_axes, x.dtype)
    (weight_out,), (spec_out,) = layout.weights((weight_out,), (weight_out_axes,), x.dtype)
    gather, scatter = _gather(project_in, layout), _scatter(project_out, layout)

    def body(x, weights_in, weight_out):
        hidden = [activation(*ys) for ys in gather(layout.merge(x), weights_in)]
        return layout.split(scatter(hidden, weight_out))

    specs = (layout.spec(None), specs_in, spec_out)
    mapped = layout.shard_map(body, specs, layout.spec(None))
    return layout.unchunk(mapped(layout.chunk(x), weights_in, weight_out))


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where the overlap axis ``axis`` (of ``n`` devices) splits the residual stream's tokens: dimension
    ``dim`` (the rows, or the sequence) of ``size``, split over other mesh axes first (``outer_size``
    devices of data or context axes, left to the compiler), then over ``axis``. Chunked, that dimension
    is ``[outer_size, n, rest]``; the shard_map splits its ``n`` by hand, so a device's chunk of tokens is
    ``[outer_size, 1, rest]``, the chunk of device ``k`` the ``k``-th."""

    axis: str
    n: int
    dim: int
    size: int
    outer_size: int
    rules: Rules

    @staticmethod
    def of(residual_shape) -> _Layout:
        mesh, rules = active()
        axis = overlap_axis(rules, mesh.shape)
        spec = activation_spec(("batch", "residual_seq", None), residual_shape)
        dim = next(d for d, entry in enumerate(spec) if axis in spec_axes(entry))
        axes = spec_axes(spec[dim])
        outer_size = math.prod(mesh.shape[a] for a in axes[: axes.index(axis)])
        return _Layout(axis, mesh.shape[axis], dim, residual_shape[dim], outer_size, rules)

    def chunk(self, a):
        """``a`` (an array with the residual stream's leading dimensions) with ``dim`` in chunks."""
        d = self.dim
        return a.reshape(*a.shape[:d], self.outer_size, self.n, -1, *a.shape[d + 1 :])

    def unchunk(self, a):
        d = self.dim
        return a.reshape(*a.shape[:d], self.size, *a.shape[d + 3 :])

    def merge(self, a):
        """A chunk ``[..., outer_size, 1, rest, ...]`` as an activation ``[..., outer_size x rest, ...]``."""
        d = self.dim
        return a.reshape(*a.shape[:d], -1, *a.shape[d + 3 :])

    def split(self, a):
        """The inverse of :meth:`merge`."""
        d = self.dim
        return a.reshape(*a.shape[:d], self.outer_size, 1, -1, *a.shape[d + 1 :])

    @property
    def rotated(self) -> bool:
        """Whether chunks sit in each device's own order (the rows are split: see the module docstring)."""
        return self.dim == 0

    def position(self, offset: int):
        """Where the chunk of the device ``offset`` places to its right sits in a chunked array: ``offset``
        itself in a rotated layout, else that device's index (traced)."""
        if self.rotated:
            return offset % self.n
        return (jax.lax.axis_index(self.axis) + offset) % self.n

    def take(self, a, offset: int):
        """The chunk of the device ``offset`` places to the right from chunked ``a``, merged."""
        index = self.position(offset)
        if self.rotated:
            return self.merge(jax.lax.slice_in_dim(a, index, index + 1, axis=self.dim + 1))
        return self.merge(jax.lax.dynamic_slice_in_dim(a, index, 1, axis=self.dim + 1))

    def assemble(self, chunks):
        """The chunked array of ``chunks`` (merged), the ``i``-th that of the device ``i`` places to the
        right: concatenated in a rotated layout, else each put at its device's index."""
        chunks = [self.split(c) for c in chunks]
        if self.rotated:
            return jnp.concatenate(chunks, axis=self.dim + 1)
        shape = list(chunks[0].shape)
        shape[self.dim + 1] = self.n
        out = jnp.zeros(shape, chunks[0].dtype)
        for offset, chunk in enumerate(chunks):
            out = jax.lax.dynamic_update_slice_in_dim(out, chunk, self.position(offset), axis=self.dim + 1)
        return out

    def spec(self, logical_axes, chunked: bool = True):
        """The shard_map spec (over ``axis`` alone) of a chunked array (or, not ``chunked``, an array)
        whose dimensions, as named by ``logical_axes``, the rules split over ``axis``; None: a chunk of
        tokens, split by chunk."""
        if logical_axes is None:
            return P(*[None] * (self.dim + 1), self.axis)
        entries = []
        for i, name in enumerate(logical_axes):
            entry = self.axis if self.axis in (self.rules.mesh_axes(name) or ()) else None
            entries += [None, None, None] if i == self.dim and chunked else [entry]
        return P(*entries)

    def weight_spec(self, value, logical_axes):
        """A weight's shard_map spec, over ``axis`` as the rules split it; for an adapted value a pytree:
        ``A`` split as the matrix's inputs, ``B`` as its outputs, their rank whole (``FineTune``'s)."""

        def spec(names):
            return P(*(self.axis if self.axis in (self.rules.mesh_axes(n) or ()) else None for n in names))

        if isinstance(value, Adapted):
            ins, outs = logical_axes[: value.input_dims], logical_axes[value.input_dims :]
            return Adapted(spec(logical_axes), spec((*ins, None)), spec((None, *outs)), value.scale,
                           value.input_dims)  # fmt: skip
        return spec(logical_axes)

    def receive(self, x, offset: int):
        """``x`` of the device ``offset`` places to the right (every device sends its own)."""
        return jax.lax.ppermute(x, self.axis, [(k, (k - offset) % self.n) for k in range(self.n)])

    def send(self, x, offset: int):
        """What the device ``offset`` places to the left sent: every device sends ``x`` to the device
        ``offset`` places to its right."""
        return jax.lax.ppermute(x, self.axis, [(k, (k + offset) % self.n) for k in range(self.n)])

    def weights(self, values, logical_axes, dtype) -> tuple[tuple, tuple]:
        """``(values, shard_map specs)`` of weights (with their logical axes) for the shard_map: a quantized
        base dequantized to ``dtype`` (its codes' and scales' blocks need not split over ``axis`` as the
        matrix does: ``FineTune.fit_shardings`` keeps such ones whole), and each gathered over the axes
        other than ``axis`` (FSDP's) here, once: inside, every chunk's matmul would gather it again."""
        values = tuple(_dequantized(v, dtype) for v in values)
        specs = tuple(self.weight_spec(v, a) for v, a in zip(values, logical_axes, strict=True))
        mesh, _ = active()

        def gather(leaf, spec):
            return jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, spec))

        def split_elsewhere(names) -> bool:  # Over an axis besides the overlap axis (FSDP's, context's).
            return any(a != self.axis for entry in self.rules.spec(names) for a in spec_axes(entry))

        gathered = tuple(jax.tree.map(gather, v, s) if split_elsewhere(a) else v
                         for v, s, a in zip(values, specs, logical_axes, strict=True))  # fmt: skip
        return gathered, specs

    def shard_map(self, body, in_specs, out_specs):
        """``jax.shard_map`` manual over ``axis`` (inside 1F1B's body, which splits others by hand, on its
        abstract mesh), and over the axes no rule maps: under the gradient accumulation's per-group
        ``vmap`` its ``spmd_axis_name`` axes, which the vmap adds to the specs (left to the compiler,
        JAX 0.10 lowered that to a manual computation that does not verify)."""
        mesh, rules = active()
        manual = manual_axes()
        if manual:
            mesh = jax.sharding.get_abstract_mesh()
        mapped = {a for _, axes in rules.logical for a in axes or ()}
        carried = {a for a in mesh.axis_names if a not in mapped | manual and mesh.shape[a] > 1}
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names={self.axis, *carried}, check_vma=False)  # fmt: skip


def _dequantized(value, dtype):
    if isinstance(value, Adapted) and isinstance(value.base, Quantized):
        base = value.base.dequantize(dtype)
        return Adapted(base, value.lora_a, value.lora_b, value.scale, value.input_dims)
    return value.dequantize(dtype) if isinstance(value, Quantized) else value


def _barrier(*values):
    """Ties the values together: nothing reads one before all are made (a step's transfers, its matmuls,
    and what the next step multiplies, so that the next matmul can neither join this one nor run first)."""
    return jax.lax.optimization_barrier(values)


def _weight_grad(project: Project, x, weights, cotangent):
    return jax.vjp(lambda w: project(x, w), weights)[1](cotangent)[0]


def _accumulate(total, grad):
    # In float32, as the whole matmul accumulates (XLA adds the chunks' bf16 products in one pass either way).
    grad = jax.tree.map(lambda g: g.astype(jnp.float32), grad)
    return grad if total is None else jax.tree.map(jnp.add, total, grad)


def _cast_like(grad, weights):
    return jax.tree.map(lambda g, w: g.astype(w.dtype), grad, weights)


def _sum(own, received: list):
    """The device's own partial sum and those its peers sent it, added in one pass."""
    return functools.reduce(jnp.add, received, own)


def _gather(project: Project, layout: _Layout, assembled: bool = False):
    """``(x_chunk, weights) -> outputs``, inside the shard_map: ``project`` of the chunks of every device
    (a list in step order, the ``i``-th the chunk of the device ``i`` places to the right; with
    ``assembled``, each output assembled by :meth:`_Layout.assemble`). Its backward sends the input
    gradient's partial sums to their owners while the input's chunks arrive again for the weights'."""
    n = layout.n

    def forward(x, weights):
        outputs, chunk = [], x
        for step in range(n):
            ys = project(chunk, weights)
            if step < n - 1:  # The next chunk arrives while this one is multiplied.
                chunk, ys, x = _barrier(layout.receive(x, step + 1), ys, x)
            outputs.append(ys)
        if assembled:
            return tuple(layout.assemble(list(chunks)) for chunks in zip(*outputs, strict=True))
        return outputs

    def backward(residuals, d_outputs):
        x, weights = residuals
        if assembled:
            d_outputs = [tuple(layout.take(d, step) for d in d_outputs) for step in range(n)]
        transpose = jax.linear_transpose(lambda chunk: project(chunk, weights), x)
        order = [*range(1, n), 0]  # The device's own chunk last: its partial sum goes nowhere.
        chunks, sending, received, d_weights = {0: x}, None, [], None
        for k, step in enumerate(order):
            (part,) = transpose(d_outputs[step])  # The input gradient's partial sum for that chunk.
            # Under it: this step's and the next step's chunks of the input arrive, the last partial sum
            # leaves for its owner.
            wanted = [s for s in order[k : k + 2] if s not in chunks]
            transfers = [layout.receive(x, s) for s in wanted]
            if sending is not None:
                transfers.append(layout.send(sending[1], sending[0]))
            transfers, part, x, d_outputs = _barrier(transfers, part, x, d_outputs)
            chunks.update(zip(wanted, transfers, strict=False))
            received += transfers[len(wanted) :]
            d_weights = _accumulate(d_weights, _weight_grad(project, chunks[step], weights, d_outputs[step]))
            sending = (step, part)
        return _sum(sending[1], received), _cast_like(d_weights, weights)

    gather = jax.custom_vjp(forward)
    gather.defvjp(lambda x, weights: (forward(x, weights), (x, weights)), backward)
    return gather


def _scatter(project: Project, layout: _Layout, assembled: bool = False):
    """``(chunks, weight) -> the device's own chunk of the output, summed over the devices``, inside the
    shard_map: ``chunks`` in :func:`_gather`'s step order (or, with ``assembled``, one array that
    :meth:`_Layout.take` splits). Its backward receives the output gradient's chunks, each feeding the
    input's gradient and the weight's."""
    n = layout.n
    order = [*range(1, n), 0]  # The device's own chunk last: its partial sum goes nowhere.

    def chunks_of(x):
        return [layout.take(layout.chunk(x), step) for step in range(n)] if assembled else list(x)

    def forward(x, weight):
        chunks, received, sending = chunks_of(x), [], None
        for step in order:
            part = project(chunks[step], weight)
            # Under it the last partial sum leaves for its owner; the next matmul waits for both.
            transfers = [layout.send(sending[1], sending[0])] if sending is not None else []
            transfers, part, weight = _barrier(transfers, part, weight)
            received += transfers
            sending = (step, part)
        return _sum(sending[1], received)

    def backward(residuals, d_out):
        x, weight = residuals
        chunks, d_chunks, d_weight = chunks_of(x), [], None
        transpose = jax.linear_transpose(lambda c: project(c, weight), chunks[0])
        cotangent = d_out
        for step in range(n):
            (d_chunk,) = transpose(cotangent)
            d_weight = _accumulate(d_weight, _weight_grad(project, chunks[step], weight, cotangent))
            if step < n - 1:
                cotangent, d_chunk, d_out = _barrier(layout.receive(d_out, step + 1), d_chunk, d_out)
            d_chunks.append(d_chunk)
        d_x = layout.unchunk(layout.assemble(d_chunks)) if assembled else d_chunks
        return d_x, _cast_like(d_weight, weight)

    scatter = jax.custom_vjp(forward)
    scatter.defvjp(lambda x, weight: (forward(x, weight), (x, weight)), backward)
    return scatter
