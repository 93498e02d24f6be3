"""The run config: one YAML file, loaded into typed, frozen objects and validated once.

    config = load_config("configs/llama-7b.yaml", overrides=["remat.policy=full"])
    config.model.n_layers, config.mesh.axes, config.remat_plan()

Unknown keys, wrong types and impossible values raise :class:`~shardmem.errors.ConfigError` naming the key
path, the value and the fix. Checks that need the devices (mesh size, divisibility) happen when the mesh
is built.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import yaml

from shardmem.errors import ConfigError, did_you_mean, one_of
from shardmem.finetune.hf_config import disagreements, pretrained_model
from shardmem.finetune.quant import FORMATS
from shardmem.models.attention import ATTENTION_CHOICES
from shardmem.models.kv_cache import KV_DTYPES
from shardmem.models.llama import CHECKPOINT_TAGS, MLP_ACTIVATIONS, PRESETS, ModelConfig
from shardmem.planning.targets import DEFAULT_ALLOCATOR_FRACTION, MIG_TARGETS, TARGET_NAMES, is_target_name
from shardmem.remat import LayerPlan, ModulePlan
from shardmem.units import parse_bandwidth, parse_bytes

DTYPES = ("float32", "bfloat16", "float16")
# Sizes past these are typos (or attacks), not models, and cost a crash or a hang instead of a plan that
# says "does not fit": JAX passes Python ints into traced code as int32 (x64 is off), XLA aborts the
# process when a shape's extent overflows int64, and Python loops over layers. The bounds leave a
# thousandfold room over the largest models trained (16M-token batches, 256k vocabularies, 126 layers).
MAX_DIMENSION = 2**31 - 1  # One model or batch dimension.
MAX_ARRAY_ELEMENTS = 2**50  # One array (4 PiB of float32: over the memory of the largest machines).
MAX_SCORE_ELEMENTS = 2**60  # Attention scores, L x L per head (XLA counts elements and bytes in int64).
MAX_LAYERS = 10_000
MAX_DEVICES = 2**20  # Devices in one mesh.
Bytes = Annotated[int, "bytes"]  # An int in the config that also accepts "1GiB"-style strings.
Bandwidth = Annotated[float, "bytes/s"]  # Bytes per second; also "450GB/s" or "400Gb/s" (bits).


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Named mesh axes (in order; one may be -1) and the host layout.

    ``devices_per_host`` fixes the device count for deviceless targets when an axis is -1.
    """

    # Axis name -> size, outer to inner (the last axis is within a host); one size may be -1 for the rest.
    axes: dict[str, int] = dataclasses.field(default_factory=lambda: {"data": 1, "fsdp": -1, "tensor": 1})
    hosts: int = 1  # Hosts (processes) the devices are spread over, laid out host by host.
    devices_per_host: int | None = None  # Devices per host for deviceless plans (None: 8 when an axis is -1).

    def device_count(self) -> int:
        """Devices a deviceless plan is made for."""
        if self.devices_per_host:
            return self.hosts * self.devices_per_host
        fixed = 1
        for size in self.axes.values():
            fixed *= size if size > 0 else 1
        if -1 in self.axes.values():
            return max(fixed, 8 * self.hosts)  # One 8-GPU node per host by default.
        return fixed


@dataclasses.dataclass(frozen=True)
class UserModelConfig:
    """A model of your own: ``factory`` is an import path ``package.module:function`` (looked up from the
    config file's folder, then the working directory, then ``sys.path``) called as
    ``factory(rngs, **options)`` -- or ``factory(rngs, remat=plan, **options)`` when it takes a ``remat``
    argument, which then receives the per-layer :class:`~shardmem.remat.LayerPlan` for ``n_layers``
    layers (required for ``remat.layers`` ranges)."""

    factory: str  # Import path package.module:function of the function that builds the model.
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # Keyword arguments of the factory.
    n_layers: int | None = None  # The depth remat.layers ranges refer to (the factory gets the plan).


@dataclasses.dataclass(frozen=True)
class RematConfig:
    """``policy`` for every layer, ``layers`` overrides per range, ``custom`` tag actions; ``tags`` are a
    model's own ``checkpoint_name`` tags (the ones ``minimal`` saves and ``offload`` moves to the host;
    default: the reference model's projections). A model passed in code (``model_factory=``) is a model
    of your own even beside a ``model.preset``; ``tags`` with the reference model itself are an error.

    ``modules`` remats the layers of a model of your own that takes no plan (a third party's, whose
    blocks have no ``remat`` argument): pattern -> policy, e.g. ``{"blocks_*": full}``, a glob on a
    submodule's path (``decoder/blocks_3``), name or class name (``DecoderBlock``); each matched
    module's call runs under ``jax.checkpoint`` with that policy (:class:`~shardmem.remat.ModulePlan`:
    Linen modules through ``nn.intercept_methods``, NNX ones through ``nnx.remat``). A pattern that
    matches no module is a warning in the plan."""

    policy: str = "none"  # The policy of every layer that remat.layers does not name.
    layers: dict[str, str] = dataclasses.field(default_factory=dict)  # Range "i" or "i-j" -> policy.
    custom: dict[str, str] = dataclasses.field(default_factory=dict)  # Tag -> save, offload or recompute.
    tags: list[str] = dataclasses.field(default_factory=list)  # Your model's checkpoint_name tags.
    # Submodules of an unedited model by path, name or class glob -> policy (e.g. {"blocks_*": full}).
    modules: dict[str, str] = dataclasses.field(default_factory=dict)


#: Values of ``precision.loss_scale``.
LOSS_SCALES = ("auto", "dynamic", "none")


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """Dtypes: ``params`` for the weights and optimizer, ``compute`` for the forward and backward passes
    (weights are cast where they are used). ``master: float32`` under ``params: bfloat16`` (or float16)
    keeps a float32 copy of the weights in the optimizer state, updates it and rounds it to ``params``
    after each step, with the gradients accumulated in float32 (a 1F1B pipeline's micro-batches too; a
    GPipe one's in the weights' dtype): mixed-precision training as Megatron's
    (bf16 model, fp32 main weights and gradients), which with ``optimizer.shard_over_data`` splits the
    master copy over the data axes as its distributed optimizer does. ``loss_scale``: ``dynamic``
    multiplies the loss by a scale the optimizer keeps
    (:func:`shardmem.program.optimizer.dynamic_loss_scaling`), so that float16 gradients do not underflow,
    skipping the steps that overflow; ``auto`` is ``dynamic`` with float16 compute and ``none`` otherwise
    (bfloat16 has float32's range)."""

    params: str = "float32"  # The weights (and, without master, the optimizer state).
    compute: str = "bfloat16"  # The forward and backward passes.
    loss_scale: str = "auto"  # auto (dynamic with float16), dynamic or none.
    master: str | None = None  # float32: master weights in the optimizer state (None: params are).

    @property
    def loss_scaling(self) -> bool:
        """Whether the step scales the loss dynamically."""
        return self.loss_scale == "dynamic" or (self.loss_scale == "auto" and self.compute == "float16")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The Optax optimizer: ``name`` (adamw, adam, sgd), a linear warmup to ``learning_rate`` over
    ``warmup_steps`` then cosine decay to a tenth of it at ``train.steps``; global-norm clipping at
    ``grad_clip`` (None: off)."""

    name: str = "adamw"  # adamw, adam or sgd.
    learning_rate: float = 3e-4  # The peak rate, reached after warmup_steps.
    weight_decay: float = 0.1  # Decoupled weight decay (adamw).
    warmup_steps: int = 100  # Steps of linear warmup before the cosine decay.
    b1: float = 0.9  # Adam's first-moment decay (sgd uses none of b1, b2, eps, weight_decay).
    b2: float = 0.95  # Adam's second-moment decay.
    eps: float = 1e-8  # Adam's epsilon.
    grad_clip: float | None = 1.0  # Clip the gradients' global norm to this (None: no clipping).
    mu_dtype: str | None = None  # Adam's first moment in this dtype (None: the params dtype).
    shard_over_data: bool = False  # ZeRO-1: state split over the data (and context) axes weights repeat on.


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training run: batch (in sequences) and its split into ``micro_batches`` for gradient
    accumulation (with a ``stage`` mesh axis: the micro-batches of the pipeline schedule), length, seed,
    logging and checkpoint cadence."""

    global_batch: int = 16  # Sequences (rows) per step, over all devices.
    micro_batches: int = 1  # Gradient-accumulation steps per step (with a stage axis: the pipeline's).
    # FSDP gradients reduce-scattered once per step too, accumulated unsharded
    # (shardmem.program.accumulation).
    fsdp_reduce_once: bool = False
    steps: int = 1000  # Steps to train; also the horizon of the learning-rate schedule.
    seed: int = 0  # Seeds the initialization and the data: the batch of step k depends on (seed, k).
    log_every: int = 10  # Steps between logged lines (metrics.jsonl has a line per logged step).
    checkpoint_every: int = 100  # Steps between checkpoints (also saved at the end and on SIGTERM).
    keep_checkpoints: int = 3  # Newest checkpoints kept in runs/<name>/checkpoints.
    tensorboard: bool = False  # Also log to runs/<name>/tensorboard (needs tensorboardX).
    loss: str | None = None  # Import path of loss_fn(model, batch) -> loss or (loss, metrics).


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism over the ``stage`` mesh axis (:mod:`shardmem.parallel.pipeline`), with
    ``train.micro_batches`` micro-batches: ``repeats`` layer chunks per stage (1: GPipe; more: the
    circular schedule, a smaller bubble for moving the strided chunks' weights each step); ``stages``:
    each stage's range of layers, e.g. ``["0-7", "8-15", "16-22", "23-29"]`` (GPipe and 1F1B only;
    default: the most even split, the first stages one layer more); ``schedule``: ``gpipe``,
    ``circular`` (repeats > 1), ``1f1b`` (each stage alternates forwards and backwards, out of step with
    its neighbours, so it holds the residuals of at most stages micro-batches, whatever their number) or
    ``interleaved`` (1F1B with ``repeats`` virtual stages per stage)."""

    repeats: int = 1  # Layer chunks per stage: 1 is GPipe, more the circular schedule.
    stages: list[str | int] | None = None  # Each stage's layers, e.g. ["0-7", "8-15"] (None: most even).
    # gpipe, circular, 1f1b or interleaved (None: gpipe, or circular with repeats > 1).
    schedule: str | None = None


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """``path``: None for the synthetic stream, a text file (bytes), or a ``.npy`` token file.

    For a batch of your own: ``batch`` maps names to ``{shape, dtype, axes}`` (``shape`` may say
    ``global_batch``; ``axes`` are logical names such as ``batch``), and ``source`` is the import path of
    ``batches(step, rows, seed) -> {name: array}``, the rows ``range`` of batch ``step`` that this process
    holds, deterministic per ``(seed, step)``.
    """

    path: str | None = None  # None: synthetic; a text file (bytes as tokens); a .npy file of token ids.
    batch: dict[str, Any] | None = None  # Your batch: name -> {shape, dtype, axes} (None: token batch).
    source: str | None = None  # Import path of batches(step, rows, seed) -> {name: array}.


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """Target to plan for and the budget: device memory x ``usable_fraction`` - ``reserve``, divided by
    1 + ``deviceless_margin`` for GPUs compiled deviceless (a serving plan takes the margin on each
    function's temporaries alone: :mod:`shardmem.planning.serving`)."""

    target: str = "cpu"  # Where to plan for when --target is not given.
    usable_fraction: float = DEFAULT_ALLOCATOR_FRACTION  # The share of device memory the run may use.
    reserve: Bytes = 1 << 30  # Bytes kept free besides (an int, or a size such as 1GiB).
    # On an H200 one measured step needed 15.5% more than its deviceless plan (the real-GPU plan, --target
    # local, was exact): XLA's memory limit, which deviceless compiles now take from usable_fraction as the
    # run's allocator gives it (BENCHMARKS.md); kept until a GPU round measures again.
    deviceless_margin: float = 0.16
    offload_optimizer: bool = False  # Optimizer state in pinned host memory, on the device only to update.
    # XLA options for every compile of the plan (e.g. xla_gpu_enable_triton_gemm: false).
    compiler_options: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class InterconnectConfig:
    """A GPU cluster's wiring for the step-time estimate's collective model
    (:mod:`shardmem.planning.collectives`); null keeps the target's published default
    (:data:`shardmem.planning.targets.GPU_TARGETS`: a DGX/HGX node). Rates are each way and need their
    unit: ``400Gb/s``, ``400 Gbit/s``, ``400Gbps`` (bits) or ``50GB/s``, ``50 GBps`` (bytes).
    ``nvlink``: one GPU to the others of its node (NVLink/NVSwitch; on TPUs ICI); ``network``: one NIC
    to other nodes (e.g. ``400Gb/s`` NDR, ``200Gb/s`` HDR; on TPUs a chip's DCN share); ``nics_per_node``:
    how many (DGX: one per GPU); ``nvls``: the NVSwitch reduces (NVLink SHARP, H100/H200/B200);
    ``sharp``: the InfiniBand switches reduce (SHARP via NCCL's CollNet); ``host``: to host memory
    (PCIe), which offloading uses."""

    nvlink: Bandwidth | None = None  # GPU to GPU inside a node, per GPU each way (null: the target's).
    network: Bandwidth | None = None  # One NIC to other nodes, each way (null: the target's).
    host: Bandwidth | None = None  # GPU to host memory (PCIe), each way (null: the target's).
    nics_per_node: int | None = None  # NICs per node (null: the target's server, one per GPU on DGX).
    nvls: bool | None = None  # NVLink SHARP in the node's NVSwitch (null: the target's).
    sharp: bool | None = None  # InfiniBand SHARP in-network reduction (null: off).


_RATE_KEYS = ("nvlink", "network", "host")  # The Bandwidth fields of InterconnectConfig.


@dataclasses.dataclass(frozen=True)
class OverlapConfig:
    """Communication the step overlaps with compute by how it is written, beside what XLA's scheduler
    overlaps by itself (:mod:`shardmem.planning.overlap`). ``tensor_parallel``: under sequence
    parallelism, the reference model's all-gathers and reduce-scatters around its tensor-parallel
    matmuls run in chunks under them, as collective matmuls (:mod:`shardmem.parallel.collective_matmul`;
    NeMo's ``tp_comm_overlap``). Off by default: XLA overlaps the chunks only where its scheduler has
    memory to spare, and the chunking costs memory-bound kernels of its own (BENCHMARKS.md, issue 38
    item 3): plan both."""

    # Sequence parallelism's collectives in chunks under the tensor-parallel matmuls (collective matmuls).
    tensor_parallel: bool = False


def _rate_text(rate: float) -> str:
    """A rate as text that parses back to the same float: "50GB/s", or exact bytes per second."""
    return f"{rate / 1e9:g}GB/s" if float(f"{rate / 1e9:g}") * 1e9 == rate else f"{rate:.17g}B/s"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA) on the weight matrices whose paths match ``targets`` (globs such as
    ``layers/w[qkvo]``): each gets ``A`` (input x ``rank``) and ``B`` (``rank`` x output), trained, while the
    matrix itself is frozen; the layer computes ``x W + alpha / rank x (x A) B``."""

    rank: int = 8  # Columns of A, rows of B.
    alpha: float = 16.0  # The adapters' output is scaled by alpha / rank.
    targets: list[str] = dataclasses.field(default_factory=list)  # Globs of parameter paths.


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """Frozen weight matrices stored quantized and dequantized where they are used: ``int8``, or 4-bit
    ``int4`` / ``nf4`` (QLoRA's NormalFloat), two codes a byte; one float32 scale per ``group`` entries
    of the last axis (an axis shorter than ``group`` is one group)."""

    format: str = "nf4"  # int8, int4 or nf4.
    group: int = 64  # Entries of the last axis that share one scale.
    targets: list[str] = dataclasses.field(default_factory=lambda: ["*"])  # Globs; frozen matrices only.


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    """Fine-tuning (:mod:`shardmem.finetune`): parameters matching ``freeze`` (globs of paths such as
    ``embedding`` or ``layers/*``) get no gradients and no optimizer state, and are stored in
    ``base_dtype``; ``lora`` adds trainable adapters to matrices, which it freezes (with ``lora`` and no
    ``freeze``, every parameter is frozen, as PEFT does); ``quantize`` stores frozen matrices in 8 or
    4 bits."""

    freeze: list[str] | None = None  # Globs of parameter paths (None: all with lora, else none).
    lora: LoraConfig | None = None  # {rank, alpha, targets}: adapters on these matrices (None: none).
    quantize: QuantizeConfig | None = None  # {format, group, targets}: frozen matrices in 8 or 4 bits.
    base_dtype: str | None = None  # The frozen weights' dtype (None: precision.compute).
    # Pretrained weights: a safetensors file or folder, or a shardmem run (shardmem.finetune.weights).
    init_from: str | None = None
    # A model of your own: parameter path (layers/0/kernel) -> tensor name in init_from, where they differ.
    init_names: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def active(self) -> bool:
        """Whether any parameter is frozen or adapted."""
        return bool(self.freeze) or self.lora is not None

    def differences(
        self, other: FinetuneConfig, keys: Sequence[str] = ("freeze", "lora", "quantize", "base_dtype")
    ) -> list[tuple[str, Any, Any]]:
        """``(finetune.KEY, this value, other's)`` for each of ``keys`` where the two differ; a section
        (``lora``, ``quantize``) field by field where both have it."""
        pairs = []
        for key in keys:
            mine, theirs = getattr(self, key), getattr(other, key)
            if dataclasses.is_dataclass(mine) and dataclasses.is_dataclass(theirs):
                pairs += [(f"finetune.{key}.{f.name}", getattr(mine, f.name), getattr(theirs, f.name))
                          for f in dataclasses.fields(mine)]  # fmt: skip
            else:
                pairs.append((f"finetune.{key}", mine, theirs))
        return [(key, mine, theirs) for key, mine, theirs in pairs if mine != theirs]


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Serving (:mod:`shardmem.program.serving`, ``shardmem generate``, ``shardmem plan --serve``): a
    static batch of ``batch`` prompts, right-padded to ``prompt_len`` tokens, each with room for
    ``max_len`` positions (prompt and generated tokens) in the KV cache. The weights are stored in
    ``precision.compute``, or in 8 or 4 bits with ``quantize`` (its formats are ``finetune.quantize``'s;
    ``finetune.freeze`` and ``lora`` describe training and do not apply); the KV cache in ``kv_dtype``:
    ``int8`` keeps one float32 scale per token and KV head."""

    batch: int = 8  # Sequences prefilled and decoded together.
    prompt_len: int = 512  # Prompt tokens per sequence in a prefill (shorter prompts are padded).
    max_len: int = 2048  # Positions per sequence in the KV cache: the prompt and the tokens generated.
    kv_dtype: str | None = None  # The KV cache's: bfloat16, float16, float32 or int8 (None: compute's).
    quantize: QuantizeConfig | None = None  # {format, group, targets}: weight matrices in 8 or 4 bits.


def _as_lists(value: Any) -> Any:
    """``value`` with every tuple in it a list, as YAML writes sequences."""
    if isinstance(value, dict):
        return {k: _as_lists(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_as_lists(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True)
class Config:
    """One training run, as a YAML file describes it."""

    model: ModelConfig | UserModelConfig | None = None
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    # Logical axis -> mesh axis, list of mesh axes or null (replicated), merged over the default rules.
    rules: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Regex on parameter paths (layers/wq) -> one PartitionSpec entry per dimension; wins over rules.
    param_rules: dict[str, list] = dataclasses.field(default_factory=dict)
    remat: RematConfig = dataclasses.field(default_factory=RematConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    interconnect: InterconnectConfig = dataclasses.field(default_factory=InterconnectConfig)
    overlap: OverlapConfig = dataclasses.field(default_factory=OverlapConfig)
    finetune: FinetuneConfig = dataclasses.field(default_factory=FinetuneConfig)
    serve: ServeConfig = dataclasses.field(default_factory=ServeConfig)
    name: str = "run"  # The run's name, one folder name: runs/<name> (default: the config file's name).
    # The loaded file's folder, where import paths (model.factory, ...) are looked up first; not a key.
    folder: str | None = dataclasses.field(default=None, compare=False, metadata={"internal": True})

    @property
    def user_model(self) -> bool:
        """Whether the model comes from the user (``model.factory``, or no model section at all)."""
        return not isinstance(self.model, ModelConfig)

    def remat_plan(self, user_model: bool | None = None) -> LayerPlan:
        """Returns the per-layer remat plan (for a model of your own without ``model.n_layers``, one
        policy that :meth:`LayerPlan.for_layers` stretches over any depth).

        ``user_model=True`` plans for a model passed in code (``model_factory=``) whatever the model
        section says: ``remat.tags`` are its tags, and a preset's ``n_layers`` is its depth only for
        ``remat.layers`` ranges. The default is :attr:`user_model`."""
        remat = dataclasses.asdict(self.remat)
        if not (self.user_model if user_model is None else user_model):
            return LayerPlan.parse(remat, self.model.n_layers, tags=CHECKPOINT_TAGS)
        n_layers = getattr(self.model, "n_layers", None)
        if n_layers is None and self.remat.layers:
            raise ConfigError(
                f"remat.layers={self.remat.layers} needs the depth of your model: set model.n_layers"
            )
        if not self.remat.layers and not isinstance(self.model, UserModelConfig):
            n_layers = None  # A preset's depth is not a code model's: one policy for any depth.
        tags = self.remat.tags or None
        plan = LayerPlan.parse(remat, n_layers or 1, tags=tags, named=tuple(self.remat.tags) or None)
        return plan if n_layers else dataclasses.replace(plan, any_depth=True)

    def module_plan(self, user_model: bool | None = None) -> ModulePlan:
        """Returns the ``remat.modules`` plan, its policies parsed as :meth:`remat_plan` parses them."""
        custom = self.remat.custom
        if not (self.user_model if user_model is None else user_model):
            return ModulePlan.parse(self.remat.modules, custom, tags=CHECKPOINT_TAGS)
        tags = tuple(self.remat.tags) or None
        return ModulePlan.parse(self.remat.modules, custom, tags=tags, named=tags)

    def to_dict(self) -> dict[str, Any]:
        """Returns plain data that :func:`config_from_dict` turns back into an equal Config."""
        data = _as_lists(dataclasses.asdict(self))  # YAML has lists, not tuples (model.sliding_layers).
        data.pop("folder")
        # Rates carry their unit (a bare number is refused as ambiguous): 5e10 -> "50GB/s".
        data["interconnect"] = {k: _rate_text(v) if k in _RATE_KEYS and v is not None else v
                                for k, v in data["interconnect"].items()}  # fmt: skip
        return data

    def to_yaml(self) -> str:
        """Returns the config as YAML that :func:`load_config` reads back into an equal Config."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, *overrides: str) -> Config:
        """Returns a copy with ``key.path=value`` overrides applied (values parsed as YAML), as
        :func:`load_config` applies them (see :func:`apply_overrides` for ``model.preset``)."""
        changed = config_from_dict(apply_overrides(self.to_dict(), overrides), self.name)
        return dataclasses.replace(changed, folder=self.folder)


# A config is a screenful of YAML; these bounds only stop hostile or broken files early, before they
# cost memory or time (a 50 MB file, an alias "billion laughs" that expands to gigabytes, deep nesting).
CONFIG_MAX_BYTES = 1 << 20
CONFIG_MAX_VALUES = 100_000  # Scalars and collections, counting each alias as often as it is used.
CONFIG_MAX_DEPTH = 64


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's error (8 lines, twice quoting the text) as one: where, what, and the construct it was in."""
    mark = getattr(error, "problem_mark", None)
    if mark is None:
        return f": not valid YAML: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    context, context_mark = getattr(error, "context", None), getattr(error, "context_mark", None)
    within = f" ({context} from line {context_mark.line + 1})" if context and context_mark else ""
    return f", line {mark.line + 1}, column {mark.column + 1}: not valid YAML: {error.problem}{within}"


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Reads a YAML config, applies ``key.path=value`` overrides and validates the result.

    Files over ``CONFIG_MAX_BYTES``, not in UTF-8, nested deeper than ``CONFIG_MAX_DEPTH`` or whose
    aliases expand to more than ``CONFIG_MAX_VALUES`` values are ConfigErrors, found before anything
    is expanded; so is a key written twice in one mapping (YAML would keep the last silently)."""
    path = Path(path)
    text = _read_config_text(path)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        _check_yaml_size(root, path)
        _check_unique_keys(root, path)
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}{_yaml_problem(e)}") from None
    except RecursionError:  # PyYAML composes nested collections recursively.
        raise ConfigError(f"{path}: nested deeper than {CONFIG_MAX_DEPTH} levels; a config needs a few "
                          "(section, key, value)") from None  # fmt: skip
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model, mesh, ...)")
    if raw.get("model") is None and not any(
        o.partition("=")[0].strip().startswith("model") for o in overrides
    ):
        raise ConfigError(
            f"{path}: the config has no model section; add e.g. model: {{preset: tiny}} (presets: "
            f"{one_of(PRESETS)}) or model: {{factory: mypkg.models:build}} for a model of your own"
        )
    merged = apply_overrides(raw, overrides)
    if merged.get("model") is None:  # --set model=null (a model passed in code has no file to load).
        raise ConfigError(f"model is empty: give model.preset ({one_of(PRESETS)}) or model.factory for a "
                          "model of your own, e.g. model: {preset: tiny}")  # fmt: skip
    config = config_from_dict(merged, raw.get("name", path.stem))
    return dataclasses.replace(config, folder=str(path.resolve().parent))


def _read_config_text(path: Path) -> str:
    """The file's text, or a ConfigError when it cannot be read, is too large or is not UTF-8."""
    try:
        with path.open("rb") as file:
            data = file.read(CONFIG_MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read config {str(path)!r}: {e.strerror}; give the path of a YAML config "
                          "such as configs/tiny.yaml") from None  # fmt: skip
    if len(data) > CONFIG_MAX_BYTES:
        raise ConfigError(f"config {str(path)!r} is over {CONFIG_MAX_BYTES >> 20} MiB; a config is a short "
                          "YAML file (see configs/), is this the right file?")  # fmt: skip
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config {str(path)!r} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                          f"{e.start}); save it as UTF-8") from None  # fmt: skip


def _check_yaml_size(root: yaml.Node | None, path: Path) -> None:
    """Raises ConfigError when the composed document, with its aliases expanded, would hold more than
    ``CONFIG_MAX_VALUES`` values, nest deeper than ``CONFIG_MAX_DEPTH`` or refer to itself.

    Works on the node graph, where an alias is one shared node: sizes are added up once per distinct
    node (iteratively, without recursion), so a billion laughs is measured in microseconds."""
    if root is None:
        return
    expanded: dict[int, int] = {}  # id(node) -> values under it, aliases counted at every use
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, children_done = stack.pop()
        if depth > CONFIG_MAX_DEPTH:
            line = node.start_mark.line + 1
            raise ConfigError(f"{path}: nested deeper than {CONFIG_MAX_DEPTH} levels (line {line}); a config "
                              "needs a few (section, key, value)")  # fmt: skip
        children = _yaml_children(node)
        if children_done:
            open_nodes.discard(id(node))
            expanded[id(node)] = 1 + sum(expanded[id(child)] for child in children)
            if expanded[id(node)] > CONFIG_MAX_VALUES:
                raise ConfigError(
                    f"{path}: its aliases (*name) expand to more than {CONFIG_MAX_VALUES:,} values (from "
                    f"line {node.start_mark.line + 1}); a config has a few dozen, write them out instead"
                )
            continue
        if id(node) in expanded:
            continue
        if id(node) in open_nodes:
            line = node.start_mark.line + 1
            raise ConfigError(f"{path}: an alias at line {line} refers to a collection that contains it; "
                              "a YAML config cannot be recursive")  # fmt: skip
        open_nodes.add(id(node))
        stack.append((node, depth, True))
        stack.extend((child, depth + 1, False) for child in children if id(child) not in expanded)


def _check_unique_keys(root: yaml.Node | None, path: Path) -> None:
    """Raises ConfigError naming the key path and both lines when a mapping repeats a key: PyYAML keeps
    the last value and drops the first without a word. Runs after :func:`_check_yaml_size`, so the
    graph is bounded and acyclic; a node shared by aliases is checked once."""
    seen_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(root, "")] if root is not None else []
    while stack:
        node, where = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(node.value))
            continue
        if not isinstance(node, yaml.MappingNode):
            continue
        first_line: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            if key.tag == "tag:yaml.org,2002:merge" or not isinstance(key, yaml.ScalarNode):
                continue  # `<<: *base` may be overridden by the keys after it, by design.
            name, line = _join(where, key.value), key.start_mark.line + 1
            if (key.tag, key.value) in first_line:
                raise ConfigError(
                    f"{path}: key {name!r} is given twice, at lines {first_line[key.tag, key.value]} and "
                    f"{line}; YAML would keep only the second: delete one"
                )
            first_line[key.tag, key.value] = line
            stack.append((value, name))


def _yaml_children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [item for pair in node.value for item in pair]
    return []


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Returns ``raw`` with each ``a.b.c=value`` set (the value is parsed as YAML).

    Setting ``model.preset`` replaces the whole model section with that preset (the keys written in
    ``raw["model"]`` would otherwise override it, all of them in a resolved config); other ``model.*``
    overrides, before or after it, apply on top.
    """
    out = _deep_copy(raw)
    if any(item.partition("=")[0].strip() == "model.preset" for item in overrides):
        out["model"] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: write KEY=VALUE, e.g. --set remat.policy=full")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        glued = _glued_key(value)
        if glued:  # YAML reads {data:3} as the key "data:3" with no value.
            name, _, number = glued.partition(":")
            fixed = text.replace(glued, f"{name}: {number}")
            raise ConfigError(f"--set {item!r}: YAML reads {glued!r} as one key with no value; put a space "
                              f"after the colon: --set '{key.strip()}={fixed}'")  # fmt: skip
        node = out
        parts = key.strip().split(".")
        for depth, part in enumerate(parts[:-1], 1):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                section = ".".join(parts[:depth])
                raise ConfigError(
                    f"--set {item!r}: {section} is a value, not a section; write --set {section}=VALUE"
                )
            node = child
        node[parts[-1]] = value
    return out


def _glued_key(value) -> str | None:
    """Returns a mapping key like "data:3" that has no value (a missing space after a colon), if any."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            if v is None and isinstance(k, str) and ":" in k:
                return k
            found = _glued_key(v)
            if found:
                return found
    return None


def _deep_copy(value):
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def config_from_dict(raw: Mapping[str, Any], name: str = "run") -> Config:
    """Builds and validates a Config from plain data (a parsed YAML file)."""
    raw = dict(raw)
    raw.setdefault("name", name)
    model = raw.get("model")
    if model is not None and not isinstance(model, Mapping):
        raise ConfigError(f"model={model!r}: give a mapping such as {{preset: llama-7b}}")
    if model is not None and "factory" in model:
        user = dict(model)
        if "preset" in user:
            raise ConfigError("model: give either model.preset or model.factory, not both")
        raw["model"] = _build(UserModelConfig, user, "model")
    elif model is not None:
        model = dict(model)
        preset = model.pop("preset", None)
        if preset is not None:
            base = dataclasses.asdict(ModelConfig.preset(str(preset)))
            model = {**base, **model}
        raw["model"] = _pretrained_model(model, raw.get("finetune"))
    config = _build(Config, raw, "")
    _validate(config)
    return config


def _pretrained_model(model: dict, finetune: Any) -> ModelConfig:
    """The model section, its architecture taken from ``finetune.init_from`` where that says what it is
    (a Hugging Face folder's config.json, a shardmem run's config.yaml): the keys the section leaves out
    come from there, and one it writes (or its preset does) must agree
    (:mod:`shardmem.finetune.hf_config`)."""
    init_from = finetune.get("init_from") if isinstance(finetune, Mapping) else None
    source = pretrained_model(init_from)
    if source is None:
        _check_init_from_is_there(model, init_from)
        return _build(ModelConfig, model, "model")
    if "seq_len" not in model:
        longest = (source.hf or {}).get("max_position_embeddings")
        said = f" ({source.where} says max_position_embeddings={longest})" if longest else ""
        raise ConfigError(f"model.seq_len is required: the length of the sequences you train on{said}; the "
                          "rest of the model section comes from finetune.init_from")  # fmt: skip
    written = _build(ModelConfig, {**source.fields, **model}, "model")
    disagreements(
        written, _build(ModelConfig, {**model, **source.fields}, "model"), source.fields, source.where
    )
    return written


def _check_init_from_is_there(model: dict, init_from: Any) -> None:
    """Raises ConfigError naming ``finetune.init_from`` when the model section leaves out keys and the
    path gives no architecture to take them from (not there, a file other than safetensors, a folder
    without a config.json, PEFT's adapters): "model.vocab_size is required; or point finetune.init_from
    at a Hugging Face folder" would send the user to a path they did give."""
    if not isinstance(init_from, str) or not init_from:
        return
    required = [f.name for f in dataclasses.fields(ModelConfig)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]  # fmt: skip
    absent = [name for name in required if name not in model and name != "seq_len"]
    if not absent:
        return
    from shardmem.finetune.safetensors_files import not_weights
    from shardmem.finetune.weights import missing_init_from

    path = Path(init_from).expanduser()
    leaves_out = f"model.{absent[0]}, which the model section leaves out"
    if not path.exists():
        raise ConfigError(f"{missing_init_from(init_from)} (its config.json would give {leaves_out})")
    if ((path if path.is_dir() else path.parent) / "adapter_config.json").is_file():
        raise ConfigError(f"finetune.init_from={init_from!r} is PEFT's adapters (adapter_config.json), not a "
                          "model; give the base model's folder (adapter_config.json's "
                          "base_model_name_or_path), or a merged export (shardmem export without "
                          "--adapters-only)")  # fmt: skip
    if path.is_file() and path.suffix != ".safetensors":
        raise ConfigError(not_weights(init_from, path))
    raise ConfigError(f"finetune.init_from={init_from!r} has no config.json to give {leaves_out}; give the "
                      "Hugging Face model's folder with its config.json, or the whole model section (or a "
                      "model.preset)")  # fmt: skip


def _build(cls, data: Any, key: str):
    """Converts plain data to dataclass ``cls``, checking keys and types against its fields."""
    where = key or "the config"
    if data is None and key:  # "finetune:" with nothing under it.
        raise ConfigError(f"{where} is empty: give it keys ({one_of(_fields(cls))}), write {where}: {{}} for "
                          "the defaults, or leave the section out")  # fmt: skip
    hints = typing.get_type_hints(cls, include_extras=True)
    if not isinstance(data, Mapping):
        # A value that only one key takes ("serve.quantize: nf4"): show it under that key.
        takers = [name for name in _fields(cls) if isinstance(data, str) and hints[name] is str]
        example = f", e.g. {where}={{{takers[0]}: {data}}}" if len(takers) == 1 else ""
        raise ConfigError(f"{where}={data!r}: expected a mapping with keys {one_of(_fields(cls))}{example}")
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    for name in data:
        if name not in fields:
            raise ConfigError(
                f"unknown key {_join(key, name)!r}{did_you_mean(name, fields)}; "
                f"valid keys{' in ' + key if key else ''}: {one_of(fields)}"
            )
    values = {}
    for name, field in fields.items():
        if name in data:
            values[name] = _convert(hints[name], data[name], _join(key, name))
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            hint = (f"; or give model.preset ({one_of(PRESETS)}), or point finetune.init_from at a Hugging "
                    "Face folder, whose config.json gives it" if key == "model" else "")  # fmt: skip
            raise ConfigError(f"{_join(key, name)} is required{hint}")
    return cls(**values)


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else str(name)


def _convert(hint, value: Any, key: str):
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if dataclasses.is_dataclass(hint):
        return value if isinstance(value, hint) else _build(hint, value, key)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}={value!r}: expected a mapping")
        _, value_type = typing.get_args(hint)
        return {str(k): _convert(value_type, v, f"{key}.{k}") for k, v in value.items()}
    if origin is list or hint is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}={value!r}: expected a list")
        return list(value)
    if origin is tuple:  # tuple[T, ...]: a list in YAML.
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}={value!r}: expected a list")
        item = typing.get_args(hint)[0]
        return tuple(_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    if hint is Any:
        return value
    if hint == Bytes:
        try:
            return parse_bytes(value)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None
    if hint == Bandwidth:
        try:
            return parse_bandwidth(value)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None
    if hint is float and not isinstance(value, bool):
        try:
            number = float(value)  # Also a string: YAML 1.1 reads 3e-4 as one.
        except (TypeError, ValueError):
            number = None
        if number is not None and not math.isfinite(number):
            raise ConfigError(f"{key}={value!r}: must be a finite number")
        if number is not None:
            return number
    if hint in (int, str, bool) and isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    raise ConfigError(
        f"{key}={value!r}: expected {getattr(hint, '__name__', hint)}; {_type_fix(key, value, hint)}"
    )


def _type_fix(key: str, value: Any, hint: Any) -> str:
    """How to write ``key``'s value as ``hint`` wants it."""
    if hint is int:
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return f"write it without quotes ({key}: {value.strip()})"
        try:
            number = float(value)
        except (TypeError, ValueError):
            return "give a whole number, e.g. 8"
        if number.is_integer() and not isinstance(value, bool):  # YAML reads 1e4 as a string or a float.
            return f"write it as a whole number ({key}: {int(number)})"
        return "give a whole number, e.g. 8"
    if hint is bool:
        return "give true or false"
    if hint is float:
        return "give a number, e.g. 0.9"
    if hint is str:
        return "give text (quote it if YAML would read it as a number or true/false)"
    return "see docs/reference/config.md for its type"


def _positive(key: str, value: int | float) -> None:
    if value <= 0:
        raise ConfigError(f"{key}={value}: must be positive; give a value above 0")


def _validate_experts(m: ModelConfig) -> None:
    if m.n_experts < 0:
        raise ConfigError(f"model.n_experts={m.n_experts}: use 0 for a dense MLP, or the number of experts")
    if not m.n_experts:
        return
    if not 1 <= m.experts_per_token <= m.n_experts:
        raise ConfigError(
            f"model.experts_per_token={m.experts_per_token}: each token goes to between 1 and "
            f"model.n_experts={m.n_experts} experts; use e.g. {min(2, m.n_experts)}"
        )
    if m.capacity_factor <= 0:
        no_drops = m.n_experts / m.experts_per_token
        raise ConfigError(
            f"model.capacity_factor={m.capacity_factor}: must be positive; 1.25 is usual, "
            f"{no_drops:g} (n_experts / experts_per_token) never drops a token"
        )
    if m.load_balance_weight < 0:
        raise ConfigError(
            f"model.load_balance_weight={m.load_balance_weight}: must not be negative; use e.g. 0.01, "
            "or 0 to train without the load-balancing loss"
        )


def _validate(config: Config) -> None:
    _validate_name(config.name)
    if isinstance(config.model, ModelConfig):
        _validate_model(config.model)
    elif isinstance(config.model, UserModelConfig):
        _import_path("model.factory", config.model.factory)
        if config.model.n_layers is not None:
            _positive("model.n_layers", config.model.n_layers)
    _validate_sizes(config)
    _validate_rest(config)
    _validate_finetune(config.finetune)
    _validate_serve(config.serve)


def _validate_name(name: str) -> None:
    """The run's name is a folder name (runs/<name>, sweep-<name>): one path component, so that a run
    stays inside runs/ and never is runs/ itself."""
    unprintable = [c for c in name if not c.isprintable()]
    if name.strip() in ("", ".", "..") or "/" in name or "\\" in name or unprintable:
        safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-") or "my-run"
        raise ConfigError(f"name={name!r}: the run's name is the folder runs/<name>, so it must be one "
                          "folder name (not empty, '.' or '..', no '/', '\\' or control characters); use "
                          f"e.g. name: {safe}")  # fmt: skip


def _validate_finetune(ft: FinetuneConfig) -> None:
    """The fine-tune section's values; its patterns are checked against the model's parameter paths
    when the program is built (:mod:`shardmem.finetune`)."""
    if ft.base_dtype is not None and ft.base_dtype not in DTYPES:
        raise ConfigError(f"finetune.base_dtype={ft.base_dtype!r}: use {one_of(DTYPES)}, or null for "
                          "precision.compute")  # fmt: skip
    globs = [("finetune.freeze", ft.freeze or [])]
    if ft.lora is not None:
        _positive("finetune.lora.rank", ft.lora.rank)
        _positive("finetune.lora.alpha", ft.lora.alpha)
        if not ft.lora.targets:
            raise ConfigError("finetune.lora.targets is empty; name the matrices to adapt, e.g. "
                              "[layers/wq, layers/wv] or [layers/w*]")  # fmt: skip
        globs.append(("finetune.lora.targets", ft.lora.targets))
    if ft.quantize is not None:
        _validate_quantize(ft.quantize, "finetune.quantize")
        if not ft.active:
            raise ConfigError("finetune.quantize stores frozen weights, but nothing is frozen; add "
                              "finetune.freeze (e.g. ['*']) or finetune.lora")  # fmt: skip
        globs.append(("finetune.quantize.targets", ft.quantize.targets))
    for key, patterns in globs:
        _validate_globs(key, patterns)


def _validate_globs(key: str, patterns: list) -> None:
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{key}: {pattern!r} is not a glob of parameter paths such as layers/wq")


def _validate_quantize(q: QuantizeConfig, key: str) -> None:
    if q.format not in FORMATS:
        raise ConfigError(
            f"{key}.format={q.format!r}{did_you_mean(q.format, FORMATS)}; use {one_of(FORMATS)}"
        )
    _positive(f"{key}.group", q.group)
    if q.format != "int8" and q.group % 2:
        raise ConfigError(f"{key}.group={q.group}: {q.format} packs two codes a byte, so the group must be "
                          f"even; use {q.group + 1}")  # fmt: skip


def _validate_serve(serve: ServeConfig) -> None:
    """The serve section's values; against the model (its cache's heads, the mesh) when the serving
    program is described (:func:`shardmem.program.describe`)."""
    for name in ("batch", "prompt_len", "max_len"):
        _positive(f"serve.{name}", getattr(serve, name))
    if serve.prompt_len > serve.max_len:
        raise ConfigError(f"serve.prompt_len={serve.prompt_len} is longer than serve.max_len="
                          f"{serve.max_len}, the room each sequence has in the KV cache for its prompt and "
                          f"what it generates; raise serve.max_len to at least {serve.prompt_len}, or "
                          "shorten the prompts")  # fmt: skip
    if serve.kv_dtype is not None and serve.kv_dtype not in KV_DTYPES:
        raise ConfigError(f"serve.kv_dtype={serve.kv_dtype!r}{did_you_mean(serve.kv_dtype, KV_DTYPES)}; use "
                          f"{one_of(KV_DTYPES)}, or null for precision.compute")  # fmt: skip
    if serve.quantize is not None:
        _validate_quantize(serve.quantize, "serve.quantize")
        _validate_globs("serve.quantize.targets", serve.quantize.targets)


def _validate_sizes(config: Config) -> None:
    """Raises ConfigError naming the keys when a dimension, a layer count or an array the step would
    build is past the bounds above; products are exact Python ints, so nothing here can overflow."""
    batch = config.train.global_batch
    dims = {"train.global_batch": batch}
    arrays: list[tuple[str, int]] = []  # (the keys that multiply, elements)
    scores = 0
    m = config.model
    if isinstance(m, ModelConfig):
        names = ("vocab_size", "d_model", "n_heads", "n_kv_heads", "d_ff", "seq_len", "n_experts")
        dims |= {f"model.{name}": getattr(m, name) for name in names}
        dims["model.head_dim"] = m.head_size
        _at_most("model.n_layers", m.n_layers, MAX_LAYERS, "the deepest models have a few hundred")
        tokens = batch * m.seq_len
        experts = max(m.n_experts, 1)
        arrays = [
            ("model.vocab_size x model.d_model", m.vocab_size * m.d_model),
            ("model.n_layers x model.n_experts x model.d_model x model.d_ff",
             m.n_layers * experts * m.d_model * m.d_ff),
            ("model.n_layers x model.d_model x model.n_heads x model.head_dim",
             m.n_layers * m.d_model * m.n_heads * m.head_size),
            ("model.n_layers x train.global_batch x model.seq_len x model.d_model",
             m.n_layers * tokens * m.d_model),
            ("train.global_batch x model.seq_len x model.d_ff", tokens * m.d_ff),
            ("train.global_batch x model.seq_len x model.vocab_size", tokens * m.vocab_size),
        ]  # fmt: skip
        scores = batch * m.n_heads * m.seq_len**2
        serve = config.serve  # The KV cache a serving program would hold.
        dims |= {"serve.batch": serve.batch, "serve.max_len": serve.max_len}
        arrays.append(("model.n_layers x serve.batch x serve.max_len x model.n_kv_heads x model.head_dim",
                       m.n_layers * serve.batch * serve.max_len * m.n_kv_heads * m.head_size))  # fmt: skip
    elif isinstance(m, UserModelConfig) and m.n_layers is not None:
        _at_most("model.n_layers", m.n_layers, MAX_LAYERS, "the deepest models have a few hundred")
    for name, leaf in _batch_leaves(config.data.batch or {}, "data.batch"):
        shape = leaf.get("shape") if isinstance(leaf.get("shape"), list) else []
        shape = [batch if size == "global_batch" else size for size in shape]
        if shape and all(isinstance(size, int) for size in shape):
            arrays.append((f"{name}.shape={leaf['shape']}", math.prod(shape)))
            dims |= {f"{name}.shape": max(shape, default=1)}
    for key, value in dims.items():
        _at_most(key, value, MAX_DIMENSION, "JAX computes with 32-bit integers")
    for keys, elements in arrays:
        if elements > MAX_ARRAY_ELEMENTS:
            if " x " in keys:
                keys = ", ".join(f"{key}={_value_of(config, key)}" for key in keys.split(" x "))
            raise ConfigError(
                f"{keys}: an array of that shape would have {elements:.3g} elements, over the "
                f"{MAX_ARRAY_ELEMENTS:.3g} (4 PiB of float32) any machine could hold; is a value mistyped?"
            )
    # Query-chunked attention's scores, stacked over the chunks, have L x L extent (others only
    # blocks of it): bounded by what XLA can describe at all, a shape of 2**63 elements.
    if scores > MAX_SCORE_ELEMENTS:
        raise ConfigError(
            f"train.global_batch={batch}, model.n_heads={m.n_heads}, model.seq_len={m.seq_len}: the "
            f"attention scores (batch x heads x seq_len x seq_len) would have {scores:.3g} elements, "
            f"over the {MAX_SCORE_ELEMENTS:.3g} XLA can describe; is a value mistyped?"
        )


def _at_most(key: str, value: int, limit: int, why: str) -> None:
    if value > limit:
        raise ConfigError(f"{key}={value}: at most {limit:,} ({why}); is the value mistyped?")


def _value_of(config: Config, key: str):
    if key == "model.head_dim":
        return config.model.head_size
    if key == "model.n_experts":
        return max(config.model.n_experts, 1)
    section, _, name = key.partition(".")
    return getattr(getattr(config, section), name)


def _batch_leaves(batch: Mapping[str, Any], key: str):
    """Yields ``(key, {shape, dtype, axes})`` for each array a declared ``data.batch`` names."""
    if not isinstance(batch, Mapping):
        return
    if "shape" in batch:
        yield key, batch
        return
    for name, leaf in batch.items():
        yield from _batch_leaves(leaf, f"{key}.{name}") if isinstance(leaf, Mapping) else ()


def _import_path(key: str, value: str) -> None:
    """Checks the form ``package.module:attribute`` now; importing waits until the program is built."""
    module, _, attribute = value.partition(":")
    names = [*module.split("."), *attribute.split(".")]
    if not module or not attribute or not all(n.isidentifier() for n in names):
        raise ConfigError(
            f"{key}={value!r}: give an import path package.module:function, e.g. mypkg.vit:build"
        )


def _validate_batch(batch: Mapping[str, Any], key: str = "data.batch") -> None:
    """Checks a declared batch: each leaf ``{shape, dtype, axes}``, possibly nested in mappings."""
    if not isinstance(batch, Mapping) or not batch:
        raise ConfigError(f"{key}={batch!r}: give a mapping of names to {{shape, dtype, axes}}")
    items = {"": batch} if "shape" in batch else batch  # One array, or a mapping of named ones.
    for name, leaf in items.items():
        where = f"{key}.{name}" if name else key
        if isinstance(leaf, Mapping) and "shape" not in leaf:
            _validate_batch(leaf, where)
            continue
        if not isinstance(leaf, Mapping):
            raise ConfigError(f"{where}={leaf!r}: give {{shape: [...], dtype: ..., axes: [...]}}")
        unknown = set(leaf) - {"shape", "dtype", "axes"}
        if unknown:
            bad = sorted(unknown)[0]
            raise ConfigError(
                f"unknown key {where}.{bad}{did_you_mean(bad, ('shape', 'dtype', 'axes'))}; "
                "valid keys: shape, dtype or axes"
            )
        shape = leaf.get("shape")
        if not isinstance(shape, list) or not shape:
            raise ConfigError(f"{where}.shape={shape!r}: give a list such as [global_batch, 224, 224, 3]")
        for size in shape:
            if size != "global_batch" and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
                raise ConfigError(f"{where}.shape: {size!r} is neither a positive integer nor global_batch")
        dtype = leaf.get("dtype", "float32")
        try:
            import numpy as np

            np.dtype(dtype)
        except TypeError:
            raise ConfigError(f"{where}.dtype={dtype!r}: not a dtype; use e.g. float32 or int32") from None
        axes = leaf.get("axes")
        if axes is not None and (not isinstance(axes, list) or len(axes) != len(shape)):
            raise ConfigError(
                f"{where}.axes={axes!r}: give one logical name (or null) per dimension of shape {shape}"
            )


def check_layer_index(m: ModelConfig, length: int, stages: int) -> None:
    """Raises ConfigError when the layers run in ``stages`` pipeline stages and differ by their index in
    the stack, which a stage's layers do not have: a window on some layers only (``model.sliding_layers``)
    shorter than sequences of ``length``, or those layers' own RoPE base (``model.local_rope_theta``)."""
    error = layer_index_error(m, length, stages)
    if error is not None:
        raise error


def layer_index_error(m: ModelConfig, length: int, stages: int) -> ConfigError | None:
    """The error :func:`check_layer_index` raises, or None."""
    if not m.windows_vary or stages == 1:
        return None
    layers = f"{len(m.sliding_layers)} of the model's {m.n_layers} layers"
    what = f"model.sliding_window={m.sliding_window} on {layers}"
    if m.rope_varies:
        return ConfigError(
            f"mesh.axes.stage={stages} with {what} (model.sliding_layers) and model.local_rope_theta="
            f"{m.local_rope_theta:g} on those: a pipeline stage's layers do not know which of them slide, so "
            "not which base they rotate with; set mesh.axes.stage=1 (fsdp or tensor parallelism shard the "
            "model instead)"
        )
    if length > m.sliding_window:
        return ConfigError(
            f"mesh.axes.stage={stages} with {what} (model.sliding_layers) and sequences of {length}: a "
            "pipeline stage's layers do not know which of them slide; set mesh.axes.stage=1, or "
            f"model.seq_len to at most {m.sliding_window} (where no layer's window masks anything)"
        )
    return None


def _validate_model(m: ModelConfig) -> None:
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "seq_len"):
        _positive(f"model.{name}", getattr(m, name))
    if m.head_dim is not None:
        _positive("model.head_dim", m.head_dim)
    _positive("model.rope_theta", m.rope_theta)
    _positive("model.norm_eps", m.norm_eps)
    if m.local_rope_theta is not None:
        _positive("model.local_rope_theta", m.local_rope_theta)
    if m.rope_scaling is not None:
        m.rope_scaling.validate()
    if m.sliding_window is not None:
        _positive("model.sliding_window", m.sliding_window)
    if m.sliding_layers is not None:
        if m.sliding_window is None:
            raise ConfigError(f"model.sliding_layers={list(m.sliding_layers)} without model.sliding_window: "
                              "give the window those layers slide with, or leave model.sliding_layers "
                              "out")  # fmt: skip
        wrong = [i for i in m.sliding_layers if not 0 <= i < m.n_layers]
        if wrong or len(set(m.sliding_layers)) != len(m.sliding_layers):
            what = f"{wrong[0]} is not" if wrong else "a layer is listed twice, where each is"
            raise ConfigError(f"model.sliding_layers: {what} a layer of the model's {m.n_layers} (0 to "
                              f"{m.n_layers - 1}); list each sliding layer once, or leave the key out for a "
                              "window on every layer")  # fmt: skip
    for name in ("attention_scale", "attention_softcap", "logit_softcap"):
        if getattr(m, name) is not None:
            _positive(f"model.{name}", getattr(m, name))
    if m.n_heads % m.n_kv_heads:
        divisors = [d for d in range(1, m.n_heads + 1) if m.n_heads % d == 0]
        raise ConfigError(
            f"model.n_kv_heads={m.n_kv_heads} does not divide model.n_heads={m.n_heads}; "
            f"use one of {divisors}"
        )
    if m.head_dim is None and m.d_model % m.n_heads:
        raise ConfigError(
            f"model.d_model={m.d_model} is not a multiple of model.n_heads={m.n_heads}; "
            "change one, or set model.head_dim"
        )
    if m.attention_chunk is not None and (m.attention_chunk < 1 or m.seq_len % m.attention_chunk):
        divisors = [d for d in range(1, m.seq_len) if m.seq_len % d == 0 and d >= min(128, m.seq_len // 4)]
        raise ConfigError(
            f"model.attention_chunk={m.attention_chunk} must be a positive divisor of model.seq_len="
            f"{m.seq_len}; use e.g. {divisors[:4] or [m.seq_len]}, or null to attend in one block"
        )
    if m.mlp_activation not in MLP_ACTIVATIONS:
        raise ConfigError(
            f"model.mlp_activation={m.mlp_activation!r}{did_you_mean(m.mlp_activation, MLP_ACTIVATIONS)}; "
            f"use {one_of(MLP_ACTIVATIONS)}"
        )
    if m.mlp_activation != "silu" and m.n_experts:
        raise ConfigError(f"model.mlp_activation={m.mlp_activation!r} with model.n_experts={m.n_experts}: "
                          "the experts are SwiGLU; use silu, or a dense MLP (n_experts: 0)")  # fmt: skip
    if m.attention not in ATTENTION_CHOICES:
        raise ConfigError(
            f"model.attention={m.attention!r}{did_you_mean(m.attention, ATTENTION_CHOICES)}; "
            f"use {one_of(ATTENTION_CHOICES)}"
        )
    if isinstance(m.loss_chunk, str) and m.loss_chunk != "auto":
        raise ConfigError(
            f"model.loss_chunk={m.loss_chunk!r}: use auto, a number of vocabulary entries per chunk "
            "(e.g. 8192), or null to compute the loss in one piece"
        )
    if isinstance(m.loss_chunk, int) and m.loss_chunk < 0:
        raise ConfigError(
            f"model.loss_chunk={m.loss_chunk}: use auto, a positive number of vocabulary entries "
            "(e.g. 8192), or null/0 for no chunking"
        )
    if m.head_size % 2:
        raise ConfigError(f"model head size {m.head_size} must be even for rotary embeddings")
    _validate_experts(m)


def _validate_pipeline(config: Config) -> None:
    """Checks what the config alone decides; the layer split and micro-batch count are checked against
    the mesh when the program is built (:meth:`shardmem.parallel.pipeline.Pipeline.check`)."""
    from shardmem.parallel.pipeline import SCHEDULES, parse_stages

    _positive("pipeline.repeats", config.pipeline.repeats)
    stages = config.mesh.axes.get("stage", 1)
    ranges = config.pipeline.stages
    repeats, schedule = config.pipeline.repeats, config.pipeline.schedule
    if schedule is not None:
        if schedule not in SCHEDULES:
            raise ConfigError(
                f"pipeline.schedule={schedule!r} is not a schedule{did_you_mean(str(schedule), SCHEDULES)}; "
                f"use {one_of(SCHEDULES)}"
            )
        chunked = schedule in ("circular", "interleaved")  # The schedules that run layer chunks.
        if chunked != (repeats > 1):
            fix = {"gpipe": "circular", "1f1b": "interleaved", "circular": "gpipe", "interleaved": "1f1b"}
            need = "layer chunks: set pipeline.repeats to 2 or more" if chunked else "one chunk per stage"
            raise ConfigError(
                f"pipeline.schedule={schedule} with pipeline.repeats={repeats}: {schedule} runs {need}, "
                f"or use pipeline.schedule={fix[schedule]}"
            )
        if stages == 1:
            raise ConfigError(
                f"pipeline.schedule={schedule} needs pipeline stages: add a stage mesh axis, e.g. "
                "mesh.axes.stage=4, or remove pipeline.schedule"
            )
    if ranges is not None:
        if repeats > 1:
            raise ConfigError(
                f"pipeline.stages with pipeline.repeats={repeats}: the {schedule or 'circular'} schedule "
                "splits the layers into equal chunks itself; remove pipeline.stages or set pipeline.repeats=1"
            )
        if not config.user_model:
            parse_stages(ranges, config.model.n_layers)
        if stages != -1 and len(ranges) != stages:
            raise ConfigError(
                f"pipeline.stages has {len(ranges)} ranges but mesh.axes.stage={stages}; give one range of "
                "layers per stage"
            )
    if config.pipeline.repeats > 1 and stages == 1:
        raise ConfigError(
            f"pipeline.repeats={config.pipeline.repeats} needs pipeline stages: add a stage mesh axis, "
            "e.g. mesh.axes.stage=4, or set pipeline.repeats=1"
        )
    if stages != 1 and config.user_model:
        raise ConfigError(
            f"mesh.axes.stage={stages}: pipeline parallelism splits the reference decoder's layer stack "
            "(model.preset or model fields); a model of your own (model.factory) cannot be split into "
            "stages; shard it with data, fsdp or tensor axes, or set mesh.axes.stage=1"
        )
    if stages != 1 and config.model.n_experts:
        raise ConfigError(
            f"mesh.axes.stage={stages}: pipeline stages are not supported with a mixture of experts "
            f"(model.n_experts={config.model.n_experts}) yet; use an expert axis with fsdp/tensor, or "
            "set mesh.axes.stage=1"
        )


def _validate_rest(config: Config) -> None:
    axes = config.mesh.axes
    if not axes:
        raise ConfigError("mesh.axes is empty; give at least one axis, e.g. {data: -1}")
    for axis, size in axes.items():
        if size != -1 and size < 1:
            raise ConfigError(f"mesh.axes.{axis}={size}: use a positive size, or -1 for the rest")
        _at_most(f"mesh.axes.{axis}", size, MAX_DEVICES, "devices in one mesh")
    if list(axes.values()).count(-1) > 1:
        raise ConfigError("mesh.axes: at most one axis may be -1 (it takes the remaining devices)")
    nics = config.interconnect.nics_per_node
    if nics is not None and not 1 <= nics <= 64:
        raise ConfigError(f"interconnect.nics_per_node={nics}: a node has 1 to 64 NICs (DGX H100: 8); "
                          "use null for the target's")  # fmt: skip
    _positive("mesh.hosts", config.mesh.hosts)
    if config.mesh.devices_per_host is not None:
        _positive("mesh.devices_per_host", config.mesh.devices_per_host)
    devices = config.mesh.device_count()
    if devices > MAX_DEVICES:
        sizes = ", ".join(f"{axis}: {size}" for axis, size in axes.items())
        raise ConfigError(
            f"mesh.axes {{{sizes}}} (with mesh.hosts={config.mesh.hosts}) make a mesh of {devices:,} "
            f"devices, over {MAX_DEVICES:,}; is a value mistyped?"
        )

    for key, dtype in (("precision.params", config.precision.params),
                       ("precision.compute", config.precision.compute)):  # fmt: skip
        if dtype not in DTYPES:
            raise ConfigError(f"{key}={dtype!r}: use {one_of(DTYPES)}")
    master = config.precision.master
    if master is not None and (master != "float32" or config.precision.params == "float32"):
        raise ConfigError(
            f"precision.master={master!r} with precision.params={config.precision.params!r}: master "
            "weights are a float32 copy of narrower weights; use precision.master: float32 with "
            "precision.params: bfloat16 (or float16), or null"
        )
    if config.precision.loss_scale not in LOSS_SCALES:
        scale = config.precision.loss_scale
        raise ConfigError(f"precision.loss_scale={scale!r}{did_you_mean(scale, LOSS_SCALES)}: use "
                          f"{one_of(LOSS_SCALES)} (auto: dynamic with float16 compute)")  # fmt: skip
    if config.optimizer.name not in ("adamw", "adam", "sgd"):
        raise ConfigError(f"optimizer.name={config.optimizer.name!r}: use adamw, adam or sgd")
    opt = config.optimizer
    if opt.mu_dtype is not None and opt.mu_dtype not in DTYPES:
        raise ConfigError(
            f"optimizer.mu_dtype={opt.mu_dtype!r}: use {one_of(DTYPES)}, or null for the params dtype"
        )
    _positive("optimizer.learning_rate", opt.learning_rate)
    _positive("optimizer.eps", opt.eps)
    if opt.grad_clip is not None:
        _positive("optimizer.grad_clip", opt.grad_clip)
    for key, value in (("warmup_steps", opt.warmup_steps), ("weight_decay", opt.weight_decay)):
        if value < 0:
            raise ConfigError(f"optimizer.{key}={value}: must not be negative")
    for key, value in (("b1", opt.b1), ("b2", opt.b2)):
        if not 0 <= value < 1:
            raise ConfigError(f"optimizer.{key}={value}: use a value in [0, 1), e.g. 0.9 or 0.95")

    t = config.train
    for name in ("global_batch", "micro_batches", "steps", "log_every", "checkpoint_every",
                 "keep_checkpoints"):  # fmt: skip
        _positive(f"train.{name}", getattr(t, name))
    if t.seed < 0:
        raise ConfigError(f"train.seed={t.seed}: use a non-negative integer")
    if t.global_batch % t.micro_batches:
        raise ConfigError(
            f"train.micro_batches={t.micro_batches} does not divide train.global_batch="
            f"{t.global_batch}; use a divisor of {t.global_batch}"
        )
    _validate_pipeline(config)
    mem = config.memory
    if not is_target_name(mem.target):
        raise ConfigError(
            f"memory.target={mem.target!r}{did_you_mean(mem.target, (*TARGET_NAMES, *MIG_TARGETS))}; "
            f"use {one_of(TARGET_NAMES)}, a MIG slice such as h100-sxm-mig-3g.40gb or a TPU slice such as "
            "v5p-64"
        )
    if not 0 < mem.usable_fraction <= 1:
        raise ConfigError(f"memory.usable_fraction={mem.usable_fraction}: use a value in (0, 1]")
    if not 0 <= mem.deviceless_margin < 1:
        raise ConfigError(
            f"memory.deviceless_margin={mem.deviceless_margin}: use a value in [0, 1), e.g. 0.16"
        )
    if mem.reserve < 0:
        raise ConfigError(f"memory.reserve={mem.reserve}: must not be negative")
    for pattern in config.param_rules:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"param_rules.{pattern!r}: not a valid regular expression ({e})") from None
    for key, value in (("train.loss", config.train.loss), ("data.source", config.data.source)):
        if value is not None:
            _import_path(key, value)
    if config.data.batch is not None:
        _validate_batch(config.data.batch)
    if config.data.source is not None and config.data.path is not None:
        raise ConfigError(
            "data: give either data.path (token files) or data.source (your function), not both"
        )
    # Validates policies, layer ranges and custom tags; with remat.tags beside a preset, against the
    # tags of the model that will be passed in code (build_program refuses them for the reference one).
    user_model = config.user_model or bool(config.remat.tags)
    config.remat_plan(user_model)
    config.module_plan(user_model)
