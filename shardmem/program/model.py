"""The model a program runs: its factory, resolved from the config, and its variables on abstract shapes.

    factory = resolve_factory(config, None, custom=False, attention=attention, pipeline=None)
    model = abstract_model(factory, mesh, rules, seed=0)     # nnx.eval_shape: nothing is allocated
    model.params["layers"]["wq"].sharding                    # NamedSharding(mesh, P(None, "fsdp", "tensor"))

The factory builds the reference :class:`~shardmem.models.llama.Llama` (its layers in pipeline stages
where the mesh has them), ``model.factory`` from the config (any Flax NNX module, or a Linen one through
:func:`shardmem.models.linen.from_linen`) called with ``model.options``, or a ``model_factory`` passed in
code. One that takes a ``remat`` argument receives the per-layer :class:`~shardmem.remat.LayerPlan`, and
``remat.modules`` wraps the submodules it names in a model of your own
(:class:`~shardmem.remat.ModulePlan`). Only ``nnx.Param`` variables are parameters; a model's other
variables (batch statistics, RNG streams) are its ``rest``, their typed PRNG keys kept as raw data
(:class:`TypedKeys`) so that a state holds plain arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardmem.config import Config
from shardmem.errors import ConfigError, one_of
from shardmem.models.attention import AttentionKernel
from shardmem.models.llama import CHECKPOINT_TAGS, PRESETS, Llama
from shardmem.models.user import import_object, search_from, takes
from shardmem.parallel.pipeline import Pipeline
from shardmem.parallel.rules import Rules
from shardmem.remat import LayerPlan, ModulePlan, remat_modules

ModelFactory = Callable[..., nnx.Module]


@dataclasses.dataclass(frozen=True)
class Factory:
    """How the model is built: ``build(rngs)`` with its remat applied, and which remat that is."""

    build: ModelFactory
    custom: bool  # A model of your own (model.factory or model_factory=), not the reference model.
    remat_plan: LayerPlan | None  # The per-layer plan the model applies (None: the model remats itself).
    module_plan: ModulePlan  # remat.modules, applied to the model's submodules.
    # The module_plan patterns that named a module: NNX ones when the model is built, Linen ones when traced.
    module_matches: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(frozen=True)
class Model:
    """The model resolved on abstract shapes: its factory, graph and variables with their shardings.

    ``abstract_params`` are all of the model's parameters (``jax.ShapeDtypeStruct``), ``param_shardings``
    and ``param_logical`` their shardings and logical axis names; ``abstract_rest`` its other variables
    (typed keys as raw data, :class:`TypedKeys`) and ``rest_shardings`` theirs. ``storage`` is the rules
    the variables are stored by: the config's, with a pipeline's stage split of the layers.
    """

    factory: Factory
    graphdef: Any
    abstract_params: Any
    param_shardings: Any
    param_logical: Any
    abstract_rest: Any
    rest_shardings: Any
    keys: TypedKeys
    storage: Rules

    @property
    def params(self):
        """The model's parameters with their shardings: what pretrained weights load into."""
        return sharded(self.abstract_params, self.param_shardings)

    @property
    def has_rest(self) -> bool:
        """Whether the model has variables other than ``nnx.Param``."""
        return bool(jax.tree.leaves(self.abstract_rest))


def resolve_factory(
    config: Config,
    model_factory: ModelFactory | None,
    *,
    custom: bool,
    attention: AttentionKernel | None,
    pipeline: Pipeline | None,
    collective_matmuls: bool = False,
) -> Factory:
    """Returns how the model is built: ``model_factory`` (a model passed in code, the user's whatever the
    config's model section says), else the config's; raises ConfigError for remat settings the reference
    model cannot take."""
    if not custom and config.remat.tags:
        raise ConfigError(
            f"remat.tags={config.remat.tags} lists the checkpoint_name tags of a model of your own, but the "
            f"model is the reference one (model.preset or model fields), which tags "
            f"{', '.join(CHECKPOINT_TAGS)}; "
            "remove remat.tags (remat.custom picks among those), or pass your model as model_factory="
        )
    if not custom and config.remat.modules:
        raise ConfigError(
            f"remat.modules={config.remat.modules} wraps layers of a model of your own, but the model is the "
            "reference one (model.preset or model fields), whose layers take remat.policy and remat.layers; "
            "use those, or pass your model as model_factory="
        )
    if model_factory is not None:
        plan = config.remat_plan(user_model=True)  # A model passed in code is the user's, whatever the YAML.
        factory = _with_options(model_factory, plan, {}) if takes(model_factory, "remat") else model_factory
    else:
        factory = default_model_factory(config, None if custom else attention, pipeline, collective_matmuls)
    takes_remat = getattr(factory, "takes_remat", not custom)
    modules = config.module_plan(user_model=True) if custom else ModulePlan()
    matched: set[str] = set()  # The remat.modules patterns that named a module, for the plan's warnings.
    if modules:
        factory = _with_module_remat(factory, modules, matched)
    return Factory(factory, custom, config.remat_plan(custom) if takes_remat else None, modules, matched)


def abstract_model(factory: Factory, mesh: Mesh, storage: Rules, *, seed: int) -> Model:
    """Returns the model evaluated on abstract shapes (``nnx.eval_shape``), its variables sharded by the
    ``storage`` rules over ``mesh``; raises ConfigError for a factory that does not return an NNX module
    with parameters."""
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: _checked_model(factory.build(nnx.Rngs(seed))))
    graphdef, abstract_params_state, abstract_rest_state = nnx.split(abstract, nnx.Param, ...)
    param_logical = nnx.to_pure_dict(nnx.get_partition_spec(abstract_params_state))
    abstract_params = nnx.to_pure_dict(abstract_params_state)
    if not jax.tree.leaves(abstract_params):
        raise ConfigError("the model has no nnx.Param variables: there is nothing to train")
    param_shardings = storage.shardings(mesh, abstract_params_state)
    keys = TypedKeys(nnx.to_pure_dict(abstract_rest_state))
    replicated = NamedSharding(mesh, P())
    rest_shardings = storage.shardings(mesh, abstract_rest_state)
    rest_shardings = jax.tree.map(lambda s, impl: s if impl is None else replicated, rest_shardings,
                                  keys.impls, is_leaf=lambda x: x is None)  # fmt: skip
    abstract_rest = jax.eval_shape(keys.unwrap, nnx.to_pure_dict(abstract_rest_state))
    return Model(factory, graphdef, abstract_params, param_shardings, param_logical, abstract_rest,
                 rest_shardings, keys, storage)  # fmt: skip


def sharded(tree, shardings):
    """Returns ``tree``'s leaves as ``jax.ShapeDtypeStruct`` with the matching ``shardings``."""
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        tree,
        shardings,
    )


def default_model_factory(config: Config, attention: AttentionKernel | None = None,
                          pipeline: Pipeline | None = None,
                          collective_matmuls: bool = False) -> ModelFactory:  # fmt: skip
    """Returns ``rngs -> model`` for the config: the reference Llama (its layers in ``pipeline`` stages,
    where given; its projections as collective matmuls with ``collective_matmuls``), or ``model.factory``
    called with ``model.options`` (and ``remat=`` the per-layer plan, where it takes one)."""
    if config.model is None:
        raise ConfigError(
            "the config has no model section; add e.g. model: {preset: tiny} (presets: "
            f"{one_of(PRESETS)}), model: {{factory: mypkg.models:build}}, or pass model_factory="
        )
    plan = config.remat_plan()
    if config.user_model:
        with search_from(config.folder):
            build = import_object(config.model.factory, "model.factory")
        return _with_options(build, plan, config.model.options)

    def factory(rngs: nnx.Rngs) -> nnx.Module:
        return Llama(config.model, rngs=rngs, remat=plan,
                     param_dtype=jnp.dtype(config.precision.params),
                     compute_dtype=jnp.dtype(config.precision.compute), attention=attention,
                     pipeline=pipeline, collective_matmuls=collective_matmuls)  # fmt: skip

    return factory


def _with_options(build: Callable, plan: LayerPlan, options: dict) -> ModelFactory:
    extra = dict(options)
    if takes(build, "remat"):
        extra["remat"] = plan

    def factory(rngs: nnx.Rngs) -> nnx.Module:
        try:
            return build(rngs, **extra)
        except TypeError as e:
            if options and any(f"'{name}'" in str(e) for name in options):
                raise ConfigError(f"model.options={options}: {build.__name__}() says {e}") from None
            raise

    factory.takes_remat = "remat" in extra  # type: ignore[attr-defined]
    return factory


def _with_module_remat(factory: ModelFactory, modules: ModulePlan, matched: set[str]) -> ModelFactory:
    """The factory, its NNX submodules that ``remat.modules`` names wrapped in ``nnx.remat``."""

    def build(rngs: nnx.Rngs) -> nnx.Module:
        model = factory(rngs)  # Anything else is _checked_model's to refuse.
        return remat_modules(model, modules, matched) if isinstance(model, nnx.Module) else model

    return build


def _checked_model(model: Any) -> nnx.Module:
    """Returns ``model`` if it is an NNX module, else raises the ConfigError that says how to make one.
    Called inside ``nnx.eval_shape``, before JAX refuses a non-NNX return value with a TypeError."""
    if isinstance(model, nn.Module):
        name = type(model).__name__
        raise ConfigError(
            f"the model factory returned the Flax Linen module {name}, not a Flax NNX module; wrap it with "
            f"shardmem.models.linen.from_linen: return from_linen({name}(...), example_input, rngs=rngs)"
        )
    if not isinstance(model, nnx.Module):
        raise ConfigError(
            f"the model factory returned a {type(model).__name__}, not a Flax NNX module; return an "
            "nnx.Module (a Linen module: shardmem.models.linen.from_linen(module, example_input, rngs=rngs))"
        )
    return model


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


class TypedKeys:
    """Typed PRNG keys in the model's variables travel as their raw ``uint32`` data (checkpoints hold
    plain arrays); ``wrap`` turns them back into keys of the same implementation."""

    def __init__(self, abstract_rest):
        found = {}

        def record(tree):  # key_impl needs a (traced) key array, not a ShapeDtypeStruct.
            found["impls"] = jax.tree.map(lambda x: jax.random.key_impl(x) if _is_key(x) else None, tree)

        jax.eval_shape(record, abstract_rest)
        self.impls = found["impls"]

    def unwrap(self, tree):
        return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)

    def wrap(self, tree):
        return jax.tree.map(lambda x, impl: x if impl is None else jax.random.wrap_key_data(x, impl=impl),
                            tree, self.impls, is_leaf=lambda x: x is None)  # fmt: skip
