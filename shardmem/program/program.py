"""A built program, whatever its kind: its description, the jitted functions planning compiles, init.

    program = build_program(config, mesh)          # a TrainingProgram (shardmem.program.step)
    for function in program.functions:             # the training step; a serving program's prefill, decode
        function.trace().lower().compile()         # what shardmem.planning.memory.plan_program does
    state = program.init()

Planning (:func:`shardmem.planning.memory.plan_program`), training, sweeps and tuning consume programs:
a kind of program is a subclass with a builder that takes a :class:`~shardmem.program.description.Description`
and lists its :class:`Function` values, each with the abstract arguments it is compiled with and the
argument groups whose bytes a memory report lists per device.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
from jax.sharding import Mesh

from shardmem.config import Config
from shardmem.finetune import FineTune
from shardmem.models.attention import AttentionKernel
from shardmem.parallel.pipeline import Pipeline
from shardmem.parallel.rules import Rules, sharding_table
from shardmem.program.description import Description
from shardmem.program.model import sharded
from shardmem.remat import LayerPlan, ModulePlan


def loading(jitted: Callable) -> Callable:
    """``jitted`` (pretrained weights in, donated), called without JAX's warning that some donated buffers
    were not usable: a quantized, adapted or fused tensor has no output of its shape to reuse, and the
    donation still frees what it read."""

    @functools.wraps(jitted)
    def call(params):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            return jitted(params)

    return call


@dataclasses.dataclass(frozen=True)
class Function:
    """One jitted function of a program and the abstract arguments (``jax.ShapeDtypeStruct`` with
    shardings) it is planned with. ``groups`` names subtrees of the arguments whose per-device bytes a
    memory report lists (``{"params": ..., "batch": ...}``, in the report's order); ``tokens`` is how
    many tokens one call processes (for tokens per second; None where it is not tokens);
    ``overlap_off`` the GPU overlap options it compiles without (:mod:`shardmem.planning.overlap`);
    ``compiler_options`` the XLA options ``jitted`` carries, which a plan compiles it with too (beneath
    ``memory.compiler_options``)."""

    name: str
    jitted: Any
    arguments: tuple
    groups: Mapping[str, Any]
    tokens: int | None = None
    overlap_off: tuple[str, ...] = ()
    compiler_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def trace(self):
        """Returns ``jitted.trace(*arguments)``: the traced function, ready to lower and compile."""
        return self.jitted.trace(*self.arguments)


@dataclasses.dataclass
class Program(abc.ABC):
    """A program built from a :class:`~shardmem.program.description.Description`: the base of every kind.

    ``init()`` returns the program's state, allocated with its shardings (loaded from
    ``finetune.init_from`` where the config names pretrained weights); ``build`` is the builder that
    made the program, which :meth:`variant` calls again. A kind lists its jitted functions in
    :attr:`functions`. The description's decisions are read through it: ``program.mesh``,
    ``program.rules``, ``program.attention``, ``program.pipeline``, ``program.finetune``, ...
    """

    description: Description
    init: Callable[[], Any]
    build: Callable[[Description], Program]

    kind: ClassVar[str] = ""

    @property
    @abc.abstractmethod
    def functions(self) -> tuple[Function, ...]:
        """The program's jitted functions with their abstract arguments, the main one first."""

    def function(self, name: str | None = None) -> Function:
        """Returns the function called ``name`` (default: the first of :attr:`functions`)."""
        functions = self.functions
        if name is None:
            return functions[0]
        for function in functions:
            if function.name == name:
                return function
        raise ValueError(f"{self.kind} program has no function {name!r}: {[f.name for f in functions]}")

    def variant(self, *overrides: str) -> Program:
        """Returns the program of the same kind for the config with ``key=value`` overrides."""
        return self.build(self.description.resolve_again(*overrides))

    def natural_params(self, params):
        """Returns the model's full parameters (``model_params``' tree) as the model makes them from the
        program's ``params``: a pipeline's stored stacks of layers (:meth:`Pipeline.stored`, the same values
        in the same order) reshaped to ``[n_layers, ...]``; ``params`` itself otherwise."""
        if self.pipeline is None or self.pipeline.repeats == 1:
            return params
        return jax.tree.map(lambda value, model: value.reshape(model.shape), params, self.model_params)

    def sharding_table(self):
        """Returns one :class:`~shardmem.parallel.rules.ShardingRow` per parameter (trainable ones,
        then frozen ones)."""
        d = self.description
        rows = sharding_table(sharded(d.abstract_params, d.param_shardings), d.param_shardings,
                              d.param_logical)  # fmt: skip
        if d.abstract_frozen is not None:
            rows += sharding_table(sharded(d.abstract_frozen, d.frozen_shardings), d.frozen_shardings,
                                   d.frozen_logical)  # fmt: skip
        return rows

    # The description's decisions, read through the program.
    @property
    def config(self) -> Config:
        """The config the program was built from."""
        return self.description.config

    @property
    def mesh(self) -> Mesh:
        """The device mesh (Auto axes)."""
        return self.description.mesh

    @property
    def rules(self) -> Rules:
        """The partition rules."""
        return self.description.rules

    @property
    def attention(self) -> AttentionKernel | None:
        """The attention kernel resolved for the mesh's devices: the reference model's, or the one a model
        of your own attends with in serving (None for one in training: it attends as it says)."""
        return self.description.attention

    @property
    def collective_matmuls(self) -> bool:
        """Whether the reference model's projections run as collective matmuls (overlap.tensor_parallel)."""
        return self.description.collective_matmuls

    @property
    def pipeline(self) -> Pipeline | None:
        """The layers' pipeline stages (None: no stage axis, or stage=1)."""
        return self.description.pipeline

    @property
    def finetune(self) -> FineTune | None:
        """Frozen, adapted and quantized parameters (None: all train)."""
        return self.description.finetune

    @property
    def graphdef(self):
        """The model's NNX graph definition."""
        return self.description.model.graphdef

    @property
    def model_params(self):
        """The model's own parameters (before a fine-tune's split) with their shardings: what
        pretrained weights load into."""
        return self.description.model.params

    @property
    def param_logical(self):
        """The logical axis names of what trains."""
        return self.description.param_logical

    @property
    def frozen_logical(self):
        """The logical axis names of a fine-tune's frozen parameters (None without)."""
        return self.description.frozen_logical

    @property
    def custom_model(self) -> bool:
        """Whether the model is the user's own rather than the reference model."""
        return self.description.model.factory.custom

    @property
    def remat_plan(self) -> LayerPlan | None:
        """The per-layer remat plan the model applies (None: the model remats itself)."""
        return self.description.model.factory.remat_plan

    @property
    def module_plan(self) -> ModulePlan:
        """``remat.modules``, applied to the model's submodules."""
        return self.description.model.factory.module_plan

    @property
    def module_matches(self) -> set[str]:
        """The ``remat.modules`` patterns that named a module (NNX ones when built, Linen ones when
        traced)."""
        return self.description.model.factory.module_matches
