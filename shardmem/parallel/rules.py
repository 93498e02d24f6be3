"""Partition rules: logical axis names (and parameter-path patterns) -> mesh axes -> NamedShardings.

    rules = Rules.from_config({"embed": "fsdp", "heads": "tensor"}, mesh_axes=mesh.axis_names)
    shardings = rules.shardings(mesh, abstract_params)      # tree of NamedSharding
    with rules.activate(mesh): ...                           # lets model code call constrain()

Semantics follow Flax/MaxText logical axis rules: a logical name maps to one mesh axis, several, or none
(replicated). A mesh axis is used at most once per array: a later dimension that asks for an axis already
used is left unsharded there. Path rules (regex -> spec) take precedence, for models without logical names.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardmem.errors import ConfigError, did_you_mean, one_of

MeshAxes = tuple[str, ...] | None

#: Defaults for the reference model; a config's ``rules`` entries replace these key by key.
DEFAULT_RULES: dict[str, MeshAxes] = {
    "batch": ("data", "fsdp", "expert"),
    "seq": ("context",),  # Context parallelism: each sequence split over the context axis.
    # The residual stream's sequence (layer inputs, norms, residual adds: outside the tensor-parallel
    # matmuls); [context, tensor] is sequence parallelism (whose axes split the batch where they divide
    # it: residual_spec). Unset, it follows rules.seq.
    "residual_seq": ("context",),
    "embed": ("fsdp", "context"),  # Weights are also split over the devices that share a sequence.
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": None,
    "mlp": ("tensor",),
    "layers": ("stage",),  # Pipeline stages hold their own layers (shardmem.parallel.pipeline).
    "norm": None,
    "expert": ("expert",),  # Mixture-of-experts weights; tokens reach them by all-to-all.
}

#: Logical names used by activations rather than parameters (never reported as unused rules).
ACTIVATION_AXES = ("batch", "seq", "residual_seq")

_active: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "shardmem_rules", default=None
)


def _as_axes(value: object, key: str) -> MeshAxes:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value) or None
    raise ConfigError(f"{key}={value!r}: give a mesh axis name, a list of them, or null")


@dataclasses.dataclass(frozen=True)
class Rules:
    """Ordered logical-name rules and parameter-path rules; see the module docstring."""

    logical: tuple[tuple[str, MeshAxes], ...]
    by_path: tuple[tuple[str, tuple[MeshAxes, ...]], ...] = ()
    user_keys: tuple[str, ...] = ()

    @staticmethod
    def from_config(
        logical: Mapping[str, object] | None,
        mesh_axes: Sequence[str],
        by_path: Mapping[str, Sequence[object]] | None = None,
    ) -> Rules:
        """Validates the config's ``rules`` (merged over :data:`DEFAULT_RULES`) and ``param_rules``.

        A user rule that names a mesh axis the mesh does not have is an error; default rules simply
        drop such axes.
        """
        merged: dict[str, MeshAxes] = {}
        for name, axes in DEFAULT_RULES.items():
            kept = tuple(a for a in axes or () if a in mesh_axes)
            merged[name] = kept or None
        for name, value in (logical or {}).items():
            merged[name] = _check_axes(_as_axes(value, f"rules.{name}"), f"rules.{name}", mesh_axes)
        if "residual_seq" not in (logical or {}):
            merged["residual_seq"] = merged["seq"]
        seq, residual = merged["seq"] or (), merged["residual_seq"] or ()
        if tuple(residual[: len(seq)]) != tuple(seq):
            fix = [*seq, *(a for a in residual if a not in seq)]
            raise ConfigError(
                f"rules.residual_seq={list(residual) or None} with rules.seq={list(seq)}: the residual "
                f"stream splits each sequence as the layers do (rules.seq), then further (sequence "
                f"parallelism); use rules.residual_seq: {fix}"
            )
        paths: list[tuple[str, tuple[MeshAxes, ...]]] = []
        for pattern, spec in (by_path or {}).items():
            key = f"param_rules.{pattern!r}"
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"{key}: not a valid regular expression ({e})") from None
            if not isinstance(spec, list | tuple):
                raise ConfigError(f"{key}={spec!r}: give a list with one entry per dimension")
            entries = tuple(_check_axes(_as_axes(s, key), key, mesh_axes) for s in spec)
            paths.append((pattern, entries))
        return Rules(tuple(merged.items()), tuple(paths), tuple(logical or ()))

    def mesh_axes(self, logical_name: str | None) -> MeshAxes:
        """Returns the mesh axes a logical axis name maps to (None: replicated)."""
        return dict(self.logical).get(logical_name) if logical_name else None

    def spec(self, logical_axes: Sequence[str | None]) -> P:
        """Returns the PartitionSpec for an array with these logical axes."""
        return _dedupe([self.mesh_axes(name) for name in logical_axes])

    def batch_only_axes(self) -> tuple[str, ...]:
        """The batch rule's mesh axes that no other rule (nor a parameter-path rule) uses: plain data
        parallelism, over which every device holds the same weights."""
        others = {a for name, axes in self.logical if name != "batch" for a in axes or ()}
        others |= {a for _, entries in self.by_path for axes in entries for a in axes or ()}
        return tuple(a for a in self.mesh_axes("batch") or () if a not in others)

    def seq_only_axes(self, mesh: Mesh) -> tuple[str, ...]:
        """The ``seq`` rule's mesh axes (context parallelism, size > 1) when no parameter rule (nor a
        parameter-path rule) uses them: every device of the sequence holds the same weights, so a
        device's own positions' weight gradients can be summed by hand and reduced once."""
        params = {a for name, axes in self.logical if name not in ACTIVATION_AXES for a in axes or ()}
        params |= {a for _, entries in self.by_path for axes in entries for a in axes or ()}
        seq = tuple(a for a in self.mesh_axes("seq") or () if mesh.shape[a] > 1)
        return seq if seq and not set(seq) & params else ()

    def gradient_axes(self, mesh: Mesh) -> tuple[str, ...]:
        """The mesh axes a parameter's gradient is summed over and ``optimizer.shard_over_data`` splits
        its optimizer state (and the gradient it reads) over, where the parameter is replicated over them:
        the batch rule's axes, and the context axes that split no weight (:meth:`seq_only_axes`; Megatron's
        distributed optimizer splits over data x context)."""
        batch = self.spec(("batch",))
        return (*spec_axes(batch[0] if batch else None), *self.seq_only_axes(mesh))

    def matches_path(self, path: str) -> bool:
        """Whether a parameter-path rule applies to ``path``."""
        return self.path_rule(path) is not None

    def path_rule(self, path: str) -> str | None:
        """Returns the pattern of the first parameter-path rule that applies to ``path``."""
        return next((pattern for pattern, _ in self.by_path if re.search(pattern, path)), None)

    def param_spec(self, path: str, logical_axes: Sequence[str | None] | None, ndim: int) -> P:
        """Returns the PartitionSpec of one parameter: the first matching path rule, else its logical
        axes through the rules."""
        pattern = self.path_rule(path)
        if pattern is None:
            return self.spec(logical_axes or (None,) * ndim)
        entries = dict(self.by_path)[pattern]
        if len(entries) != ndim:
            raise ConfigError(
                f"param_rules.{pattern!r} matches {path}, which has {ndim} dimensions, "
                f"but gives {len(entries)} entries; give one per dimension"
            )
        return _dedupe(list(entries))

    def shardings(self, mesh: Mesh, abstract_state: nnx.State | object):
        """Returns a tree of NamedShardings matching ``abstract_state`` (an ``nnx.State`` whose
        variables carry logical axis metadata), checking that every sharded dimension divides."""
        logical = nnx.get_partition_spec(abstract_state)

        def one(path, leaf, names):
            key = path_str(path)
            spec = self.param_spec(key, tuple(names) if names is not None else None, leaf.ndim)
            check_divisible(key, leaf.shape, spec, mesh, tuple(names or ()), path_rule=self.path_rule(key))
            return NamedSharding(mesh, spec)

        values = nnx.to_pure_dict(abstract_state)
        names = nnx.to_pure_dict(logical)
        return jax.tree_util.tree_map_with_path(one, values, names, is_leaf=_is_spec)

    @contextlib.contextmanager
    def activate(self, mesh: Mesh) -> Iterator[None]:
        """Makes :func:`constrain` apply these rules on ``mesh`` while the context is open."""
        token = _active.set((mesh, self))
        try:
            yield
        finally:
            _active.reset(token)


def _is_spec(x) -> bool:
    return isinstance(x, P) or x is None


def _check_axes(axes: MeshAxes, key: str, mesh_axes: Sequence[str]) -> MeshAxes:
    for axis in axes or ():
        if axis not in mesh_axes:
            raise ConfigError(
                f"{key} names mesh axis {axis!r}, which the mesh does not have"
                f"{did_you_mean(axis, mesh_axes)}; mesh axes are {one_of(mesh_axes)} (mesh.axes)"
            )
    return axes


def _dedupe(entries: list[MeshAxes]) -> P:
    used: set[str] = set()
    out = []
    for axes in entries:
        kept = tuple(a for a in axes or () if a not in used)
        used.update(kept)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def split_over(shape, spec: P, axes: Sequence[str], mesh: Mesh) -> P:
    """``spec`` (of an array of ``shape``) with the mesh ``axes`` it does not use yet added, after the axes
    already there, to the first dimension they divide; ``spec`` itself where none does (small tensors such
    as norms) or every axis is used."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for entry in entries for a in spec_axes(entry)}
    extra = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
    if not extra:
        return spec
    for dim, size in enumerate(shape):
        current = spec_axes(entries[dim])
        if size % math.prod(mesh.shape[a] for a in current + extra) == 0:
            entries[dim] = current + extra if current else (extra[0] if len(extra) == 1 else extra)
            return P(*entries)
    return spec


def spec_axes(entry) -> tuple[str, ...]:
    """Returns the mesh axes of one PartitionSpec entry as a tuple."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def check_divisible(
    key: str, shape: Sequence[int], spec: P, mesh: Mesh, logical=(), *, path_rule: str | None = None
) -> None:
    """Raises ConfigError when a sharded dimension is not a multiple of its mesh axes' product;
    ``path_rule`` names the ``param_rules`` pattern that gave ``spec``, if one did."""
    for dim, (size, entry) in enumerate(zip(shape, spec, strict=False)):
        axes = spec_axes(entry)
        shards = math.prod(mesh.shape[a] for a in axes)
        if size % shards:
            name = logical[dim] if dim < len(logical) and logical[dim] else f"dimension {dim}"
            sizes = ", ".join(f"mesh.axes.{a}={mesh.shape[a]}" for a in axes)
            fits = [d for d in range(1, size + 1) if size % d == 0 and d <= 64]
            rule, other = f"rule {name} -> {list(axes)}", f"map {name} to other axes in rules"
            if path_rule is not None:
                rule = f"param_rules.{path_rule!r} puts dimension {dim} on {list(axes)}"
                other = f"change entry {dim} of param_rules.{path_rule!r}"
            elif name == "kv_heads" and len(axes) == 1 and shards % size == 0:
                # More devices than KV heads: each KV head on shards // size of them (as vLLM holds them).
                (axis,) = axes
                pair = f"[{axis}, {axis}_rep]"
                raise ConfigError(
                    f"{key}: kv_heads has size {size}, which {sizes} does not divide ({rule}); to hold each "
                    f"KV head on {shards // size} devices, split the axis: mesh.axes.{axis}={size} and "
                    f"mesh.axes.{axis}_rep={shards // size}, with rules heads, mlp and vocab on {pair} "
                    f"(kv_heads stays on [{axis}]); or use a mesh axis size among {fits}"
                )
            raise ConfigError(
                f"{key}: {name} has size {size}, which {sizes} does not divide ({rule}); "
                f"use a mesh axis size among {fits}, or {other}"
            )


def active() -> tuple[Mesh, Rules] | None:
    """Returns the mesh and rules of the open :meth:`Rules.activate` context (None outside one), for model
    code that must split work per device itself (``jax.shard_map`` around a fused kernel)."""
    return _active.get()


def manual_axes() -> set[str]:
    """The mesh axes an enclosing ``jax.shard_map`` body splits by hand (the 1F1B pipeline's, gradient
    accumulation's over the sequence)."""
    return set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())


def without_manual(spec: P) -> P:
    """Returns ``spec`` less the mesh axes an enclosing shard_map's body already splits by hand: inside it
    each device sees its own shard along them."""
    manual = manual_axes()
    if not manual:
        return spec

    def keep(entry):
        axes = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a and a not in manual)
        return axes if len(axes) > 1 else axes[0] if axes else None

    return P(*(keep(entry) for entry in spec))


def shard_map(fn: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
    """``jax.shard_map(fn, ...)`` over every axis of ``mesh``, or, inside another shard_map's body (the
    1F1B pipeline's, manual over ``stage`` and the data axes), over the axes still left to the compiler."""
    manual = manual_axes()
    if not manual:
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    in_specs, out_specs = jax.tree.map(
        without_manual, (in_specs, out_specs), is_leaf=lambda x: isinstance(x, P)
    )
    return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=in_specs, out_specs=out_specs,
                         axis_names=set(mesh.axis_names) - manual, check_vma=False)  # fmt: skip


def constrain(x, logical_axes: Sequence[str | None]):
    """Constrains an activation's sharding by logical axis names; a no-op outside
    :meth:`Rules.activate`. The residual stream's tokens (``batch`` and ``residual_seq`` together) are
    split as :func:`residual_spec` says."""
    active = _active.get()
    if active is None:
        return x
    mesh, _ = active
    manual = manual_axes()
    if manual >= set(mesh.axis_names):  # Inside a shard_map's body manual over every axis: nothing to split.
        return x
    spec = activation_spec(logical_axes, x.shape)
    if manual:  # The rest, on the body's mesh, whose manual axes each device already holds its shard of.
        mesh = jax.sharding.get_abstract_mesh()
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def activation_spec(logical_axes: Sequence[str | None], shape) -> P:
    """Returns the spec :func:`constrain` gives an activation of ``shape`` with ``logical_axes`` under the
    active rules (:func:`residual_spec` for the residual stream), less the axes an enclosing shard_map's
    body splits by hand; ``P()`` outside :meth:`Rules.activate`."""
    active = _active.get()
    if active is None:
        return P()
    mesh, rules = active
    return without_manual(residual_spec(rules, mesh, logical_axes, shape) or rules.spec(logical_axes))


def residual_spec(rules: Rules, mesh: Mesh, logical_axes: Sequence[str | None], shape) -> P | None:
    """The spec of a residual-stream activation (``logical_axes`` naming both ``batch`` and
    ``residual_seq``) of ``shape`` under sequence parallelism, or None for the plain rules.

    Sequence parallelism splits the residual stream's tokens (norms, residual adds: per token) over the
    mesh axes that ``rules.residual_seq`` adds to ``rules.seq``; any split of the tokens will do. Split
    along the sequence, as Megatron-LM's ``[s, b, h]`` activations are, a ``[b, s, h]`` array's gathers
    and reduce-scatters around the tensor-parallel matmuls run along its second dimension, and XLA
    transposes every one of them to and from a sequence-major layout (a read and a write of the
    gathered activation each, four per layer and pass: BENCHMARKS.md, issue 38). So where those axes
    divide the device's rows, they split the batch instead: each device holds whole sequences and the
    collectives run along the outermost dimension. Where they do not (one row per device), the sequence;
    and where the batch is split over axes that split the weights too (FSDP's), also the sequence: there
    XLA partitioned the projections back onto such a split by gathering every device's rows rather than
    the weights (torchtitan's Llama 3 70B, FSDP 32 x tensor 8: 8x the step).
    """
    if "batch" not in logical_axes or "residual_seq" not in logical_axes:
        return None
    seq = rules.mesh_axes("seq") or ()
    extra = tuple(a for a in rules.mesh_axes("residual_seq") or () if a not in seq)
    if not extra or set(rules.mesh_axes("batch") or ()) - set(rules.batch_only_axes()):
        return None
    index = list(logical_axes).index("batch")
    entries = [rules.mesh_axes(name) for name in logical_axes]
    entries[index] = (*(entries[index] or ()), *extra)
    entries[list(logical_axes).index("residual_seq")] = seq or None
    spec = _dedupe(entries)
    local = without_manual(spec)  # Inside a shard_map body manual over the data axes: its own rows.
    split = spec_axes(local[index]) if index < len(local) else ()
    return spec if shape[index] % math.prod(mesh.shape[a] for a in split) == 0 else None


def sequence_parallel() -> bool:
    """Whether the active rules split the residual stream's sequence further than the layers'
    (``rules.residual_seq`` over more mesh axes than ``rules.seq``: sequence parallelism)."""
    active = _active.get()
    if active is None:
        return False
    mesh, rules = active
    shards = [math.prod(mesh.shape[a] for a in rules.mesh_axes(n) or ()) for n in ("residual_seq", "seq")]
    return shards[0] > shards[1]


def path_str(path) -> str:
    """Formats a pytree key path as "layers/wq"."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


@dataclasses.dataclass(frozen=True)
class ShardingRow:
    """One parameter in the sharding table."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical: tuple[str | None, ...]
    spec: P
    bytes_per_device: int
    bytes_total: int


def sharding_table(abstract_params, shardings, logical) -> list[ShardingRow]:
    """Returns one row per parameter: path, shape, logical axes, PartitionSpec and bytes per device."""
    rows = []
    flat_shardings = dict(jax.tree_util.tree_leaves_with_path(shardings))
    flat_logical = dict(jax.tree_util.tree_leaves_with_path(logical, is_leaf=_is_spec))
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params):
        sharding = flat_shardings[path]
        names = flat_logical.get(path)
        itemsize = np.dtype(leaf.dtype).itemsize
        per_device = math.prod(sharding.shard_shape(leaf.shape)) * itemsize
        rows.append(ShardingRow(path_str(path), tuple(leaf.shape), str(leaf.dtype),
                                tuple(names) if names is not None else (), sharding.spec,
                                per_device, math.prod(leaf.shape) * itemsize))  # fmt: skip
    return rows


def rule_warnings(rows: Sequence[ShardingRow], rules: Rules, mesh: Mesh, top: int = 3) -> list[str]:
    """Warns about logical axes no rule maps, user rules never used, and the largest replicated
    parameters (not about replicated ones on a mesh of data parallelism alone, which replicates them all)."""
    known = dict(rules.logical)
    used_names = {n for row in rows for n in row.logical if n}
    warnings = []
    # Devices only along axes that split the batch and no parameter rule names (data parallelism): there
    # every device holds every parameter by design, named or not, so a replicated one is no news.
    batch_axes = rules.mesh_axes("batch") or ()
    rule_axes = {a for n, axes in rules.logical if n not in ACTIVATION_AXES for a in spec_axes(axes)}
    data_only = set(spec_axes(batch_axes)) - rule_axes
    by_design = all(size == 1 for axis, size in mesh.shape.items() if axis not in data_only)
    unmapped = sorted(n for n in used_names if n not in known)
    if unmapped and not by_design:
        warnings.append(
            f"logical axes with no rule (replicated): {', '.join(unmapped)}; add them to rules "
            "(null to replicate on purpose)"
        )
    unnamed = [r.path for r in rows if r.shape and not r.logical and not rules.matches_path(r.path)]
    if unnamed and not by_design:
        shown = ", ".join(unnamed[:5]) + (f" and {len(unnamed) - 5} more" if len(unnamed) > 5 else "")
        warnings.append(
            f"parameters without logical axes (replicated): {shown}; annotate them with "
            "nnx.with_partitioning or add param_rules"
        )
    unused = [k for k in rules.user_keys if k not in used_names and k not in ACTIVATION_AXES]
    if unused:
        names = used_names | set(ACTIVATION_AXES)
        shown = ", ".join(f"{k}{did_you_mean(k, names - {k})}" for k in unused)
        warnings.append(f"rules never used by any parameter: {shown}")
    if mesh.shape.get("expert", 1) > 1 and "expert" in used_names and "expert" not in batch_axes:
        warnings.append(
            f"rules.batch={list(batch_axes)} leaves out mesh axis expert: its {mesh.shape['expert']} devices "
            "repeat the same tokens outside the experts; add it, e.g. rules.batch: [data, fsdp, expert]"
        )
    # A mesh axis that no rule in use names (a typo such as `stages`, or a dense model's `expert`) only
    # repeats the same work on its devices.
    sharding = {a for n in used_names | set(ACTIVATION_AXES) for a in rules.mesh_axes(n) or ()}
    sharding |= {a for _, entries in rules.by_path for entry in entries for a in entry or ()}
    known_axes = {a for axes in DEFAULT_RULES.values() for a in axes or ()} - set(mesh.axis_names)
    for axis in mesh.axis_names:
        if mesh.shape[axis] > 1 and axis not in sharding:
            warnings.append(
                f"mesh.axes.{axis}={mesh.shape[axis]}{did_you_mean(axis, known_axes)} shards nothing: no "
                f"rule this model uses names it, so its {mesh.shape[axis]} devices repeat the same work; "
                "name it in rules (e.g. rules.batch) or remove it"
            )
    # Parameters can only be sharded over the mesh axes their rules name; with all of those of size 1 (pure
    # data parallelism) every device holds every parameter by design.
    param_axes = {a for n in used_names for a in spec_axes(known.get(n))}
    param_axes |= {a for r in rows for entry in r.spec for a in spec_axes(entry)}
    if any(mesh.shape.get(a, 1) > 1 for a in param_axes):
        replicated = [r for r in rows if r.bytes_per_device == r.bytes_total and r.bytes_total > 0]
        replicated.sort(key=lambda r: -r.bytes_total)
        held = sum(r.bytes_per_device for r in rows)  # Tiny ones (norm scales) are not worth a warning.
        big = [r for r in replicated[:top] if r.bytes_total >= max(1 << 20, held // 100)]
        if big:
            listed = ", ".join(f"{r.path} {list(r.shape)}" for r in big)
            warnings.append(f"largest fully replicated parameters (every device holds them whole): {listed}; "
                            "shard them with rules or param_rules")  # fmt: skip
    return warnings


def unused_path_rules(rows: Sequence[ShardingRow], rules: Rules) -> list[str]:
    """Warns about ``param_rules`` patterns that match no parameter path (a typo shards nothing)."""
    paths = [row.path for row in rows]
    unused = [pattern for pattern, _ in rules.by_path if not any(re.search(pattern, p) for p in paths)]
    if not unused:
        return []
    example = ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")
    shown = ", ".join(repr(p) for p in unused)
    return [f"param_rules that match no parameter: {shown}; parameter paths look like {example}"]
