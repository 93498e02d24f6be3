"""The fine-tune description of a program: which parameters train, which are frozen, adapted or
quantized, and how their trees are laid out, resolved once from ``finetune:`` and the model's
parameters, before the program is built.

    finetune = FineTune.resolve(config, abstract_params, param_logical, reference_model=True)
    trainable, frozen = finetune.prepare(params, key)         # what the state holds: both pure dicts
    train_shardings, frozen_shardings = finetune.shardings(param_shardings)
    model_params = finetune.assemble(trainable, frozen)       # what nnx.merge gets, in the loss

``trainable`` holds the parameters that train, and at each adapted path ``{"lora_a", "lora_b"}``; the
optimizer sees only it. ``frozen`` holds the frozen parameters in ``finetune.base_dtype``, a quantized
one as ``{"codes", "scales"}``. Paths are the parameters' ``/``-joined keys (``layers/wq``), matched by
the config's globs with :func:`fnmatch.fnmatchcase`. A leading ``layers`` axis is a stack of layers:
each layer gets its own adapter and its own scales.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardmem.errors import ConfigError
from shardmem.finetune.lora import Adapted, weight
from shardmem.finetune.quant import Quantized, group_for, quantize

Path = tuple  # A parameter's keys in the pure-dict tree.


@dataclasses.dataclass(frozen=True)
class Target:
    """One adapted matrix: ``stack`` leading layer axes, then ``input_dims`` input axes, then outputs."""

    stack: int
    input_dims: int


@dataclasses.dataclass(frozen=True)
class FineTune:
    """The resolved ``finetune:`` section for one model (see the module docstring)."""

    frozen: frozenset  # Paths of frozen parameters, adapted ones included.
    adapted: Mapping  # Path -> Target.
    quantized: Mapping  # Path -> block size, for frozen matrices stored quantized.
    rank: int = 8
    scale: float = 2.0  # lora.alpha / lora.rank.
    format: str = "nf4"
    base_dtype: Any = jnp.bfloat16
    adapter_dtype: Any = jnp.float32
    in_model: bool = True  # The model reads Adapted/Quantized values itself (the reference model).

    @staticmethod
    def resolve(config, abstract_params, param_logical, *, reference_model: bool,
                input_dims: Callable[[str], int] = lambda path: 1) -> FineTune | None:  # fmt: skip
        """Returns the description for ``config.finetune`` over the model's parameters (None when
        nothing is frozen), raising ConfigError for a glob that matches no parameter (naming close
        paths) and for adapters or quantization a parameter cannot take. ``input_dims(path)`` says how
        many axes after the layer stack are a matrix's inputs (Flax's kernels: 1)."""
        ft = config.finetune
        if not ft.active:
            return None
        shapes = {path: leaf.shape for path, leaf in _flat(abstract_params).items()}
        logical = dict(_flat(param_logical, is_leaf=lambda x: isinstance(x, P) or x is None))
        names = {path: _name(path) for path in shapes}
        stacks = {path: _stack(logical.get(path)) for path in shapes}

        def matching(key: str, pattern: str, among=None) -> list:
            return _matching(key, pattern, names, shapes if among is None else among)

        lora = ft.lora
        freeze = ft.freeze if ft.freeze is not None else (["*"] if lora else [])
        frozen = {p for pattern in freeze for p in matching("finetune.freeze", pattern)}
        adapted = {}
        for pattern in lora.targets if lora else ():
            for path in matching("finetune.lora.targets", pattern):
                matrix_dims = len(shapes[path]) - stacks[path]
                n_in = input_dims(names[path])
                if matrix_dims < 2 or n_in >= matrix_dims:
                    raise ConfigError(f"finetune.lora.targets: {pattern!r} matches {names[path]} of shape "
                                      f"{list(shapes[path])}, which is not a matrix (after its layer axis); "
                                      "adapt weight matrices only")  # fmt: skip
                split = stacks[path] + n_in
                smallest = min(math.prod(shapes[path][stacks[path] : split]), math.prod(shapes[path][split:]))
                if lora.rank > smallest:
                    raise ConfigError(
                        f"finetune.lora.rank={lora.rank} is larger than {names[path]}'s smaller side "
                        f"({smallest}, of its {list(shapes[path])}): A B has rank {smallest} at most, and "
                        f"the adapter would hold more than the matrix; use a rank of at most {smallest}, or "
                        f"leave {names[path]} out of finetune.lora.targets"
                    )
                adapted[path] = Target(stacks[path], n_in)
        frozen |= set(adapted)
        quantized = {}
        if ft.quantize is not None:
            matrices = [p for p in frozen if len(shapes[p]) - stacks[p] >= 2]
            if not matrices:
                raise ConfigError(
                    "finetune.quantize: no frozen parameter is a matrix; freeze weight matrices "
                    "(finetune.freeze or finetune.lora) or remove finetune.quantize"
                )
            quantized = _quantized(ft.quantize, "finetune.quantize", matrices, names, shapes)
        if not set(shapes) - frozen and not adapted:
            raise ConfigError(
                f"finetune.freeze={freeze} freezes every parameter and finetune.lora adds none: "
                "there is nothing to train; add finetune.lora or freeze fewer"
            )
        precision = config.precision
        return FineTune(
            frozenset(frozen), adapted, quantized,
            rank=lora.rank if lora else 0, scale=lora.alpha / lora.rank if lora else 0.0,
            format=ft.quantize.format if ft.quantize else "",
            base_dtype=jnp.dtype(ft.base_dtype or precision.compute),
            adapter_dtype=jnp.dtype(precision.params), in_model=reference_model,
        )  # fmt: skip

    @staticmethod
    def serving(config, abstract_params, param_logical, *, reference_model: bool) -> FineTune:
        """Returns the description of a serving program's weights: every parameter frozen, stored in
        ``precision.compute``, the matrices ``serve.quantize`` names in 8 or 4 bits (nothing trains, so
        ``finetune.freeze`` and ``lora`` do not apply)."""
        shapes = {path: leaf.shape for path, leaf in _flat(abstract_params).items()}
        logical = dict(_flat(param_logical, is_leaf=lambda x: isinstance(x, P) or x is None))
        names = {path: _name(path) for path in shapes}
        q = config.serve.quantize
        quantized = {}
        if q is not None:
            matrices = [p for p in shapes if len(shapes[p]) - _stack(logical.get(p)) >= 2]
            quantized = _quantized(q, "serve.quantize", matrices, names, shapes)
        return FineTune(frozenset(shapes), {}, quantized, rank=0, scale=0.0, format=q.format if q else "",
                        base_dtype=jnp.dtype(config.precision.compute), in_model=reference_model)  # fmt: skip

    def prepare(self, params, key) -> tuple[dict, dict]:
        """Returns ``(trainable, frozen)`` from the model's full parameters: frozen ones cast (and
        quantized), adapters added (``A`` normal with std ``1/sqrt(d_in)``, ``B`` zero, so the adapted
        model starts as the base one). Traceable: ``jax.eval_shape`` gives the abstract trees."""
        trainable, frozen = {}, {}
        for i, (path, leaf) in enumerate(sorted(_flat(params).items(), key=lambda kv: _name(kv[0]))):
            if path not in self.frozen:
                _put(trainable, path, leaf)
                continue
            base = leaf.astype(self.base_dtype) if path not in self.quantized else None
            if path in self.quantized:
                q = quantize(leaf, self.format, self.quantized[path])
                base = {"codes": q.codes, "scales": q.scales}
            _put(frozen, path, base)
            if path in self.adapted:
                _put(
                    trainable,
                    path,
                    self._adapters(leaf.shape, self.adapted[path], jax.random.fold_in(key, i)),
                )
        return trainable, frozen

    def _adapters(self, shape, target: Target, key) -> dict:
        split = target.stack + target.input_dims
        lead, ins, outs = shape[: target.stack], shape[target.stack : split], shape[split:]
        std = 1 / math.sqrt(math.prod(ins))
        a = jax.random.normal(key, (*lead, *ins, self.rank), self.adapter_dtype) * std
        return {
            "lora_a": a.astype(self.adapter_dtype),
            "lora_b": jnp.zeros((*lead, self.rank, *outs), self.adapter_dtype),
        }

    def shardings(self, param_shardings) -> tuple[dict, dict]:
        """Returns the trainable and frozen trees' shardings from the full parameters': a frozen
        parameter keeps its own, its codes too and its scales where their blocks divide; ``A`` is
        sharded like the matrix's inputs and ``B`` like its outputs (rank axes replicated)."""
        trainable, frozen = {}, {}
        for path, sharding in _flat(param_shardings).items():
            if path not in self.frozen:
                _put(trainable, path, sharding)
                continue
            mesh, spec = sharding.mesh, tuple(sharding.spec)
            if path in self.quantized:
                _put(frozen, path, {"codes": sharding, "scales": sharding})  # Trimmed by fit_shardings.
            else:
                _put(frozen, path, sharding)
            if path in self.adapted:
                target = self.adapted[path]
                split = target.stack + target.input_dims
                padded = spec + (None,) * (64 - len(spec))
                a = P(*padded[:split], None)
                b = P(*padded[: target.stack], None, *padded[split : len(spec)])
                _put(trainable, path, {"lora_a": NamedSharding(mesh, a), "lora_b": NamedSharding(mesh, b)})
        return trainable, frozen

    def logical(self, param_logical) -> tuple[dict, dict]:
        """Returns the logical axis names of the trainable and frozen trees, as :meth:`shardings`
        places them: ``A`` has the matrix's input names and ``None`` for its rank, ``B`` ``None`` then
        its output names; codes and scales keep their matrix's names."""
        trainable, frozen = {}, {}
        for path, names in _flat(param_logical, is_leaf=lambda x: isinstance(x, P) or x is None).items():
            names = tuple(names or ())
            if path not in self.frozen:
                _put(trainable, path, P(*names))
                continue
            _put(
                frozen,
                path,
                {"codes": P(*names), "scales": P(*names)} if path in self.quantized else P(*names),
            )
            if path in self.adapted:
                target = self.adapted[path]
                split = target.stack + target.input_dims
                padded = names + (None,) * (64 - len(names))
                a, b = P(*padded[:split], None), P(*padded[: target.stack], None, *names[split:])
                _put(trainable, path, {"lora_a": a, "lora_b": b})
        return trainable, frozen

    def fit_shardings(self, frozen_shardings, abstract_frozen) -> dict:
        """Returns ``frozen_shardings`` with each quantized tensor's spec trimmed where a sharded axis
        of its (packed) codes or of its scales does not divide: that axis stays whole."""

        def fit(sharding, leaf):
            spec = list(sharding.spec)
            for dim, entry in enumerate(spec):
                axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
                shards = math.prod(sharding.mesh.shape[a] for a in axes)
                if leaf.shape[dim] % shards:
                    spec[dim] = None
            return NamedSharding(sharding.mesh, P(*spec))

        return jax.tree.map(fit, frozen_shardings, abstract_frozen)

    def assemble(self, trainable, frozen) -> dict:
        """Returns the model's full parameter tree: a frozen parameter as its array, Quantized or
        Adapted value; for a model that reads arrays only (``in_model`` False), each materialized in
        its stored dtype (adapted ones in the adapters' dtype)."""
        full: dict = {}
        for path, leaf in _flat(trainable, is_leaf=_is_adapter).items():
            if path not in self.adapted:
                _put(full, path, leaf)
        for path, leaf in _flat(frozen, is_leaf=_is_packed).items():
            value = leaf
            if path in self.quantized:
                value = Quantized(leaf["codes"], leaf["scales"], self.format, self.quantized[path])
            if path in self.adapted:
                adapters = _get(trainable, path)
                value = Adapted(value, adapters["lora_a"], adapters["lora_b"], self.scale,
                                self.adapted[path].input_dims)  # fmt: skip
            if not self.in_model and not isinstance(value, jax.Array | jax.ShapeDtypeStruct):
                dtype = self.adapter_dtype if path in self.adapted else self.base_dtype
                value = weight(value, dtype)
            _put(full, path, value)
        return full


def _matching(key: str, pattern: str, names: Mapping, among) -> list:
    """The paths among ``among`` whose names ``pattern`` matches; a ConfigError naming close ones when
    none does."""
    found = [p for p in among if fnmatch.fnmatchcase(names[p], pattern)]
    if not found:
        pool = [names[p] for p in among]
        close = difflib.get_close_matches(pattern, pool, n=5, cutoff=0.4) or pool[:8]
        which = " of those" if len(among) != len(names) else ""
        raise ConfigError(f"{key}: {pattern!r} matches no parameter{which}; paths such as "
                          f"{', '.join(close)}")  # fmt: skip
    return found


def _quantized(q, key: str, matrices: list, names: Mapping, shapes: Mapping) -> dict:
    """Path -> block size of each matrix that ``q.targets`` (``{key}.targets``) names."""
    quantized = {}
    for pattern in q.targets:
        for path in _matching(f"{key}.targets", pattern, names, matrices):
            quantized[path] = group_for(names[path], shapes[path][-1], q.group, q.format, key)
    return quantized


def _is_adapter(x) -> bool:
    return isinstance(x, dict) and set(x) == {"lora_a", "lora_b"}


def _is_packed(x) -> bool:
    return isinstance(x, dict) and set(x) == {"codes", "scales"}


def _flat(tree, is_leaf=None) -> dict:
    return {tuple(_key(k) for k in path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)}  # fmt: skip


def _key(entry):
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def _name(path: Path) -> str:
    return "/".join(str(k) for k in path)


def _stack(names) -> int:
    """Leading ``layers`` logical axes: a stack of layers, one adapter and one set of scales each."""
    count = 0
    for name in tuple(names or ()):
        if name != "layers":
            break
        count += 1
    return count


def _put(tree: dict, path: Path, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree, path: Path):
    for key in path:
        tree = tree[key]
    return tree
