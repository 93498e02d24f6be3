"""A Llama-style decoder in Flax NNX that declares logical axes and tags what remat may save.

    model = Llama(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0))
    logits_BxLxV = model(tokens_BxL)
    h_BxLxD, head_DxV = model.hidden_states(tokens_BxL), model.unembedding()   # for a chunked loss
    # (whose logits attention.soft_cap caps at model.logit_softcap, as the model's own loss does)
    h_BxLxD, cache = model.cached_hidden_states(prompts_BxL, cache, positions_L, prefill=True)  # serving

Every parameter carries logical axis names (``embed``, ``heads``, ``mlp``, ...) that the config's rules map
to mesh axes. Every intermediate that a remat policy may want to keep is tagged with
:func:`jax.ad_checkpoint.checkpoint_name` (see :data:`CHECKPOINT_TAGS`). The layers are stored stacked on a
leading ``layers`` axis and run by :func:`shardmem.remat.remat_scan`, one scanned segment per remat policy.
Attention runs the kernel :mod:`shardmem.models.attention` resolves for the devices the model is built for.
With a ``context`` mesh axis the layers see each sequence split over its devices, in the zigzag order of
:mod:`shardmem.parallel.context`, and the hidden states come back in sequence order. Serving runs the
same layers with a KV cache (:mod:`shardmem.models.kv_cache`): each :class:`Block` is one forward,
with or without a cache, so training's and serving's cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from shardmem.errors import ConfigError, did_you_mean, one_of
from shardmem.finetune.lora import project, value_of, weight
from shardmem.models.attention import AttentionKernel, resolve_for_devices, soft_cap
from shardmem.models.fused import Fused
from shardmem.models.kv_cache import CacheSlot, KVCache
from shardmem.models.losses import cross_entropy, resolve_loss_chunk
from shardmem.models.moe import MoEFeedForward
from shardmem.models.rope import RopeScaling, rope
from shardmem.parallel import collective_matmul, context
from shardmem.parallel.pipeline import Pipeline
from shardmem.parallel.rules import activation_spec, constrain, manual_axes, sequence_parallel, spec_axes
from shardmem.remat import LayerPlan, layer_index, layer_saves, remat_scan

#: The intermediates a layer tags for remat policies, in the order they are computed.
CHECKPOINT_TAGS = (
    "layer_input",
    "query_proj",
    "key_proj",
    "value_proj",
    "attn_context",
    "out_proj",
    "mlp_gate",
    "mlp_up",
    "mlp_out",
)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of the reference decoder. ``head_dim`` defaults to ``d_model // n_heads``."""

    vocab_size: int  # Tokens in the vocabulary.
    d_model: int  # Width of the residual stream.
    n_layers: int  # Decoder layers.
    n_heads: int  # Query heads per layer.
    n_kv_heads: int  # Key/value heads (grouped-query attention when fewer than n_heads).
    d_ff: int  # Hidden width of the SwiGLU MLP (of each expert, with n_experts).
    seq_len: int  # Tokens per sequence.
    head_dim: int | None = None  # Width of one head (None: d_model // n_heads).
    rope_theta: float = 10000.0  # Base of the rotary position embedding's frequencies.
    # A checkpoint's RoPE scaling, its config.json's rope_scaling: {rope_type: llama3 (Llama 3.1/3.2), linear,
    # dynamic or yarn, factor, ...} (models/rope.py; None: none).
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None  # Each position attends to this many, itself included (Mistral's).
    # The layers the window applies to (None: every layer; empty: none). Where it is some layers only
    # (Gemma 2's every other one), each layer picks its own by its index in the stack (Block._window).
    sliding_layers: tuple[int, ...] | None = None
    # The RoPE base of the sliding layers, which rotate without rope_scaling (Gemma 3's "local" layers:
    # rope_local_base_freq, 10,000; None: every layer rotates with rope_theta and rope_scaling).
    local_rope_theta: float | None = None
    norm_eps: float = 1e-5  # Epsilon of RMSNorm.
    norm_offset: float = 0.0  # RMSNorm multiplies by norm_offset + scale (Gemma: 1, scales stored near 0).
    scale_embeddings: bool = False  # Multiply the input embeddings by sqrt(d_model) (Gemma).
    mlp_activation: str = "silu"  # The gated MLP's: silu (SwiGLU) or gelu_tanh (Gemma's GeGLU).
    qkv_bias: bool = False  # Biases on the query, key and value projections (Qwen2).
    qk_norm: bool = False  # RMSNorm of each query and key head, before RoPE (Qwen3).
    post_norms: bool = False  # RMSNorm of attention's and the MLP's outputs before they are added (Gemma 2).
    # Scores scaled by this rather than 1 / sqrt(head_size) (Gemma 2: query_pre_attn_scalar ** -0.5).
    attention_scale: float | None = None
    attention_softcap: float | None = None  # Scores capped as cap * tanh(score / cap) (Gemma 2: 50).
    logit_softcap: float | None = None  # The output logits capped the same way (Gemma 2: 30).
    tie_embeddings: bool = False  # The output head reuses the input embedding.
    attention: str = "auto"  # A kernel of shardmem.models.attention.ATTENTION_CHOICES.
    attention_chunk: int | None = None  # Query block of the `chunked` kernel (None: 512).
    loss_chunk: int | str | None = "auto"  # Vocabulary entries per loss chunk: models/losses.py.
    # Mixture of experts (shardmem.models.moe): n_experts > 0 replaces each layer's MLP by that many
    # SwiGLU experts of width d_ff, experts_per_token of them per token, each taking at most
    # capacity_factor x its balanced share of a sequence's tokens.
    n_experts: int = 0  # Experts per layer (0: a dense MLP).
    experts_per_token: int = 2  # Experts each token is routed to (top-k).
    capacity_factor: float = 1.25  # An expert takes at most this x its balanced share of the tokens.
    load_balance_weight: float = 0.01  # Weight of the Switch load-balancing loss in the gradients.

    @property
    def head_size(self) -> int:
        """Width of one attention head: ``head_dim``, or ``d_model // n_heads`` when unset."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def windows_vary(self) -> bool:
        """Whether the window slides on some layers and not on others (``sliding_layers``)."""
        layers = self.sliding_layers
        return self.sliding_window is not None and layers is not None and 0 < len(set(layers)) < self.n_layers

    @property
    def rope_varies(self) -> bool:
        """Whether some layers rotate with :attr:`local_rope_theta` and others with ``rope_theta``."""
        return self.local_rope_theta is not None and self.windows_vary

    def slides(self, index) -> bool | jax.Array:
        """Whether layer ``index`` of the stack slides (``sliding_layers``): a bool where every layer is
        alike or ``index`` is a Python int, a traced one where they differ and ``index`` is the layer's
        traced index in the stack."""
        if not self.windows_vary:
            return self.layer_window is not None
        if index is None:  # A pipeline stage's layers (config.check_layer_index refuses it).
            raise ValueError("a model whose layers differ by index needs each layer's index in the stack")
        sliding = set(self.sliding_layers)
        if isinstance(index, int):
            return index in sliding
        return jnp.asarray([i in sliding for i in range(self.n_layers)])[index]

    @property
    def layer_window(self) -> int | None:
        """The sliding window every layer attends with: ``sliding_window`` where it slides on every layer;
        None where it slides on none, or on some layers only (:attr:`windows_vary`: each layer then picks
        its own, :meth:`Block._window`)."""
        every = self.sliding_layers is None or len(set(self.sliding_layers)) == self.n_layers
        return self.sliding_window if every else None

    def param_count(self) -> int:
        """Returns the exact number of parameters, from the architecture alone."""
        d, h, kv, k = self.d_model, self.n_heads, self.n_kv_heads, self.head_size
        attention = d * h * k * 2 + d * kv * k * 2
        mlp = 3 * d * self.d_ff
        if self.n_experts:
            mlp = self.n_experts * mlp + d * self.n_experts  # Experts and the router.
        biases = (h + 2 * kv) * k if self.qkv_bias else 0
        head_norms = 2 * k if self.qk_norm else 0
        layer = attention + biases + head_norms + mlp + (4 if self.post_norms else 2) * d
        embeddings = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * layer + embeddings + d

    @staticmethod
    def preset(name: str) -> ModelConfig:
        """Returns a named architecture; see :data:`PRESETS`."""
        if name not in PRESETS:
            raise ConfigError(
                f"model.preset={name!r} is not a known model{did_you_mean(name, PRESETS)}; "
                f"use {one_of(PRESETS)}, or give the fields explicitly"
            )
        return PRESETS[name]


PRESETS: dict[str, ModelConfig] = {
    # A few-hundred-thousand-parameter model for tests and demos on CPU.
    "tiny": ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=192,
                        seq_len=64),
    # GPT-2 small's sizes (124M parameters, tied embeddings) in the Llama architecture.
    "gpt2-124m": ModelConfig(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12,
                             d_ff=2048, seq_len=1024, tie_embeddings=True),
    # Llama-3.2-1B: 1,235,814,400 parameters.
    "llama-1b": ModelConfig(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                            d_ff=8192, seq_len=4096, head_dim=64, rope_theta=500000.0,
                            rope_scaling=RopeScaling("llama3", factor=32.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0,
                                                     original_max_position_embeddings=8192),
                            tie_embeddings=True),
    # Llama-2-7B: 6,738,415,616 parameters.
    "llama-7b": ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                            d_ff=11008, seq_len=4096),
    # Llama-2-13B: 13,015,864,320 parameters.
    "llama-13b": ModelConfig(vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, n_kv_heads=40,
                             d_ff=13824, seq_len=4096),
    # Llama-2-70B (grouped-query attention with 8 KV heads): 68,976,648,192 parameters.
    "llama-70b": ModelConfig(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                             d_ff=28672, seq_len=4096),
    # Mixtral-8x7B (8 SwiGLU experts per layer, top-2): 46,702,792,704 parameters.
    "mixtral-8x7b": ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                d_ff=14336, seq_len=4096, rope_theta=1e6, n_experts=8, experts_per_token=2),
    # The tiny model with 8 top-2 experts per layer, for expert-parallel tests.
    "tiny-moe": ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64,
                            seq_len=64, n_experts=8, experts_per_token=2),
}  # fmt: skip


def lora_input_dims(path: str) -> int:
    """Returns how many axes of a reference weight matrix (after its layer axis) are its inputs, for
    LoRA's ``A``: two for ``wo`` (heads x head_dim), one for the rest."""
    if "/moe/" in f"/{path}":
        raise ConfigError(f"finetune.lora.targets matches {path}, an expert's weights; LoRA adapts the dense "
                          "matrices of the reference model (attention, embeddings, a dense MLP)")  # fmt: skip
    return 2 if path.split("/")[-1] == "wo" else 1


def _param(rngs: nnx.Rngs, shape: Sequence[int], axes: tuple[str, ...], dtype, fan_in: int | None):
    std = 1.0 / math.sqrt(fan_in) if fan_in else 0.02
    init = nnx.with_partitioning(nnx.initializers.truncated_normal(std), axes)
    return nnx.Param(init(rngs.params(), tuple(shape), dtype))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype, compute_dtype, offset: float = 0.0):
        # The product starts at one: a scale of ones, or of zeros with Gemma's offset of one.
        init = nnx.with_partitioning(
            nnx.initializers.ones if offset == 0 else nnx.initializers.zeros, ("norm",)
        )
        self.scale = nnx.Param(init(jax.random.key(0), (dim,), param_dtype))
        self.eps = eps
        self.offset = offset
        self.compute_dtype = compute_dtype

    def __call__(self, x):
        return _rms_norm(x, self.scale[...], self.eps, self.compute_dtype, self.offset)


# Recomputed in the backward pass from its compute-dtype input: otherwise the backward keeps fp32 copies
# of the model-width residual (4 GiB per norm on llama-7b at 2 x 4096 tokens per device).
@functools.partial(jax.checkpoint, static_argnums=(2, 3, 4))
def _rms_norm(x, scale, eps, compute_dtype, offset=0.0):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * (offset + scale.astype(jnp.float32))).astype(compute_dtype)


#: The gated MLP's activations (model.mlp_activation).
MLP_ACTIVATIONS = ("silu", "gelu_tanh")


# The backward pass needs only the gate and up projections; the gated product is recomputed, not kept.
@functools.partial(jax.checkpoint, static_argnums=(2,))
def _swiglu(gate, up, activation="silu"):
    act = jax.nn.silu(gate) if activation == "silu" else jax.nn.gelu(gate, approximate=True)
    return act * up


_XLA = AttentionKernel("xla")

#: The residual stream's logical axes: its sequence split by ``rules.residual_seq`` (sequence parallelism).
RESIDUAL = ("batch", "residual_seq", None)
_HEADS, _KV_HEADS = ("batch", "seq", "heads", None), ("batch", "seq", "kv_heads", None)
_MLP = ("batch", "seq", "mlp")
# The weights' logical axes, inputs first.
_WQ, _WKV = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
_WO = ("heads", "head_dim", "embed")
_W_IN, _W_OUT = ("embed", "mlp"), ("mlp", "embed")


# Sequence parallelism (Korthikanti et al. 2022): the tensor-parallel regions see whole sequences (an
# all-gather in, whose transpose is a reduce-scatter of the gradient) and hand their sums back split over
# the sequence (a reduce-scatter, not an all-reduce). Pinned only then: XLA would otherwise split the
# attention over the sequence too, with all-to-alls; without it XLA's own choice is kept.
def _whole_seq(x, logical_axes):
    return constrain(x, logical_axes) if sequence_parallel() else x


def _split_seq(x_BxLxD):
    return constrain(x_BxLxD, RESIDUAL) if sequence_parallel() else x_BxLxD


def _scatter_seq(x_BxLxD):
    """``x`` (a tensor-parallel matmul's output, summed over the tensor axis) onto the residual stream's
    share of the sequence: a reduce-scatter with sequence parallelism. Its gradient is gathered once,
    for both of the matmul's backward products; as a plain constraint each product gathered its own."""
    return _scatter_to_share(x_BxLxD) if sequence_parallel() else x_BxLxD


@jax.custom_vjp
def _scatter_to_share(x_BxLxD):
    return constrain(x_BxLxD, RESIDUAL)


def _scatter_to_share_fwd(x_BxLxD):
    return constrain(x_BxLxD, RESIDUAL), None


def _scatter_to_share_bwd(_, g_BxLxD):
    return (constrain(g_BxLxD, ("batch", "seq", None)),)


_scatter_to_share.defvjp(_scatter_to_share_fwd, _scatter_to_share_bwd)


def _gathered_projections(project, h_BxLxD, names):
    """Returns ``project(h)`` (a tuple of tensor-parallel projections of ``h``, tagged ``names``) of the
    whole sequence. With sequence parallelism ``h`` is the device's share: gathered for the matmuls, and
    for their weight gradients gathered again in the backward pass, so that the layer keeps its share
    rather than the whole sequence (Korthikanti et al. 2022, as Megatron's sequence-parallel linear
    layers): a checkpoint that saves the projections' outputs, so only the all-gather is recomputed.
    Only in a layer that keeps those outputs (:func:`~shardmem.remat.layer_saves`): one whose remat
    recomputes them (``full``, a policy saving other names) runs the gather again in the backward pass
    anyway, and the checkpoint would gather once more."""

    def gathered(h_BxLxD):
        return project(_whole_seq(h_BxLxD, ("batch", "seq", None)))

    if not sequence_parallel() or not layer_saves(names):
        return gathered(h_BxLxD)
    return jax.checkpoint(gathered, policy=jax.checkpoint_policies.save_only_these_names(*names))(h_BxLxD)


class Block(nnx.Module):
    """One decoder layer: pre-norm grouped-query attention (with ``qk_norm``, each query and key head
    RMS-normed before RoPE), then a pre-norm SwiGLU MLP (or, with ``n_experts``, a mixture of SwiGLU
    experts). ``collective_matmuls``: under sequence parallelism,
    the tensor-parallel projections run as collective matmuls
    (:mod:`shardmem.parallel.collective_matmul`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype, compute_dtype,
                 attention: AttentionKernel = _XLA, collective_matmuls: bool = False):  # fmt: skip
        d, h, kv, k, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_size, cfg.d_ff
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.attention = attention
        self.collective_matmuls = collective_matmuls
        norm = dict(param_dtype=param_dtype, compute_dtype=compute_dtype, offset=cfg.norm_offset)
        self.attn_norm = RMSNorm(d, cfg.norm_eps, **norm)
        self.wq = _param(rngs, (d, h, k), _WQ, param_dtype, d)
        self.wk = _param(rngs, (d, kv, k), _WKV, param_dtype, d)
        self.wv = _param(rngs, (d, kv, k), _WKV, param_dtype, d)
        self.wo = _param(rngs, (h, k, d), _WO, param_dtype, h * k)
        if cfg.qkv_bias:

            def bias(axes, shape):
                init = nnx.with_partitioning(nnx.initializers.zeros, axes)
                return nnx.Param(init(rngs.params(), shape, param_dtype))

            self.bq = bias(("heads", "head_dim"), (h, k))
            self.bk = bias(("kv_heads", "head_dim"), (kv, k))
            self.bv = bias(("kv_heads", "head_dim"), (kv, k))
        if cfg.qk_norm:  # One scale over a head's width, shared by the heads.
            self.q_norm = RMSNorm(k, cfg.norm_eps, **norm)
            self.k_norm = RMSNorm(k, cfg.norm_eps, **norm)
        self.mlp_norm = RMSNorm(d, cfg.norm_eps, **norm)
        if cfg.post_norms:  # Of what attention and the MLP add to the residual stream (Gemma 2's).
            self.post_attn_norm = RMSNorm(d, cfg.norm_eps, **norm)
            self.post_mlp_norm = RMSNorm(d, cfg.norm_eps, **norm)
        if cfg.n_experts:
            self.moe = MoEFeedForward(d, f, cfg.n_experts, rngs=rngs, experts_per_token=cfg.experts_per_token,
                                      capacity_factor=cfg.capacity_factor,
                                      load_balance_weight=cfg.load_balance_weight,
                                      param_dtype=param_dtype, compute_dtype=compute_dtype)  # fmt: skip
        else:
            self.w_gate = _param(rngs, (d, f), _W_IN, param_dtype, d)
            self.w_up = _param(rngs, (d, f), _W_IN, param_dtype, d)
            self.w_down = _param(rngs, (f, d), _W_OUT, param_dtype, f)

    def _project(self, spec: str, x, param):
        # The weight may be frozen, quantized or adapted (shardmem.finetune): read through project.
        return project(spec, x, value_of(param), self.compute_dtype)

    def _overlapped(self) -> bool:
        # Never inside a pipeline stage's shard_map (see collective_matmul.resolve).
        return self.collective_matmuls and sequence_parallel() and not manual_axes()

    def _projections(self, normed_BxLxD, *specs, fused: Fused | None = None):
        """The tensor-parallel projections ``(einsum spec, weight, weight axes, output axes, checkpoint
        name)`` of a norm's output over the whole sequence (:func:`_gathered_projections`, or gathered
        in chunks under the matmuls: :func:`~shardmem.parallel.collective_matmul.gather_matmul`); from
        one matmul with the weights ``fused`` (serving's, whose parts the specs' weights stand in for)."""
        h_BxLxD = _split_seq(normed_BxLxD)
        if fused is not None:

            def project_fused(h_BxLxD):
                parts = fused.project(h_BxLxD, self.compute_dtype)
                return tuple(checkpoint_name(_whole_seq(y, axes), name)
                             for y, (*_, axes, name) in zip(parts, specs, strict=True))  # fmt: skip

            return _gathered_projections(project_fused, h_BxLxD, tuple(s[4] for s in specs))
        if self._overlapped():
            outputs = collective_matmul.gather_matmul(
                self._chunk_projections(specs), h_BxLxD, tuple(value_of(s[1]) for s in specs),
                tuple(s[2] for s in specs), tuple(s[3] for s in specs),
            )  # fmt: skip
            return tuple(checkpoint_name(_whole_seq(y, axes), name)
                         for y, (*_, axes, name) in zip(outputs, specs, strict=True))  # fmt: skip

        def project_all(h_BxLxD):
            return tuple(checkpoint_name(_whole_seq(self._project(spec, h_BxLxD, param), axes), name)
                         for spec, param, _, axes, name in specs)  # fmt: skip

        return _gathered_projections(project_all, h_BxLxD, tuple(s[4] for s in specs))

    def _chunk_projections(self, specs):
        """``(chunk of tokens, weight values) -> projections`` for the collective matmuls."""
        dtype = self.compute_dtype

        def project_chunk(h_BxLxD, values):
            return tuple(project(s[0], h_BxLxD, v, dtype) for s, v in zip(specs, values, strict=True))

        return project_chunk

    def _scattered_projection(self, spec: str, x, param, weight_axes, input_axes):
        """A row-parallel projection summed over the tensor axis onto the residual stream's share of the
        tokens (:func:`_scatter_seq`, or in chunks under the matmuls:
        :func:`~shardmem.parallel.collective_matmul.matmul_scatter`)."""
        if not self._overlapped():
            return _scatter_seq(self._project(spec, x, param))
        dtype = self.compute_dtype
        out = collective_matmul.matmul_scatter(lambda chunk, v: project(spec, chunk, v, dtype), x,
                                               value_of(param), weight_axes, input_axes)  # fmt: skip
        return _split_seq(out)

    def _mlp(self, normed_BxLxD, fused: Fused | None = None):
        """The gated MLP of a norm's output, summed onto the residual stream's share of the tokens; in
        chunks under the collective matmuls
        (:func:`~shardmem.parallel.collective_matmul.gather_matmul_scatter`)."""
        specs = (("bld,df->blf", self.w_gate, _W_IN, _MLP, "mlp_gate"),
                 ("bld,df->blf", self.w_up, _W_IN, _MLP, "mlp_up"))  # fmt: skip
        activation = self.cfg.mlp_activation
        if not self._overlapped():
            gate_BxLxF, up_BxLxF = self._projections(normed_BxLxD, *specs, fused=fused)
            act_BxLxF = _swiglu(gate_BxLxF, up_BxLxF, activation)
            return self._scattered_projection("blf,fd->bld", act_BxLxF, self.w_down, _W_OUT, _MLP)

        def activate(gate_BxLxF, up_BxLxF):  # Of each chunk of tokens.
            return _swiglu(checkpoint_name(gate_BxLxF, "mlp_gate"), checkpoint_name(up_BxLxF, "mlp_up"),
                           activation)  # fmt: skip

        dtype = self.compute_dtype

        def project_down(chunk_BxLxF, value):
            return project("blf,fd->bld", chunk_BxLxF, value, dtype)

        out = collective_matmul.gather_matmul_scatter(
            self._chunk_projections(specs), activate, project_down,
            _split_seq(normed_BxLxD), (value_of(self.w_gate), value_of(self.w_up)), (_W_IN, _W_IN),
            value_of(self.w_down), _W_OUT,
        )  # fmt: skip
        return _split_seq(out)

    def __call__(self, x_BxLxD, cache: CacheSlot | None = None, fused: dict[str, Fused] | None = None):
        """Returns the layer's output; with a ``cache`` (serving's prefill or decode step), ``(output,
        cache)``: the same layer, its keys and values written to the cache and attention over it.
        ``fused``: serving's fused groups of this layer's weights (:mod:`shardmem.models.fused`), which
        its projections read in their parts' place."""
        fused = fused or {}
        cfg = self.cfg
        x_BxLxD = checkpoint_name(constrain(x_BxLxD, RESIDUAL), "layer_input")
        # Dynamic RoPE's frequencies depend on the forward's longest position (models/rope.py): the whole
        # sequence's in training, also where each device holds its own chunks of it; a serving step's
        # longest real token over the batch (not the padded prompt's, nor the cache's room).
        if cache is None:
            positions = context.layer_positions(x_BxLxD.shape[1])  # Zigzag order when split.
            length = x_BxLxD.shape[1] * (context.shards() if context.split_by_hand() else 1)
        else:
            positions = cache.positions  # Each sequence's own in a decode step.
            length = cache.rope_length

        with jax.named_scope("attention"):
            # With sequence parallelism (rules.residual_seq over tensor) the norm runs on its share of
            # the sequence and its output is all-gathered for the tensor-parallel matmuls: pinned to the
            # share first, or XLA gathers the fp32 residual the norm reads (twice the bytes).
            # The layer keeps that share for the backward pass, not the gathered sequence.
            specs = (("bld,dhk->blhk", self.wq, _WQ, _HEADS, "query_proj"),
                     ("bld,dgk->blgk", self.wk, _WKV, _KV_HEADS, "key_proj"),
                     ("bld,dgk->blgk", self.wv, _WKV, _KV_HEADS, "value_proj"))  # fmt: skip
            q_BxLxHxK, k_BxLxGxK, v_BxLxGxK = self._projections(self.attn_norm(x_BxLxD), *specs,
                                                                 fused=fused.get("wqkv"))  # fmt: skip
            if cfg.qkv_bias:
                q_BxLxHxK = q_BxLxHxK + weight(value_of(self.bq), self.compute_dtype)
                k_BxLxGxK = k_BxLxGxK + weight(value_of(self.bk), self.compute_dtype)
                v_BxLxGxK = v_BxLxGxK + weight(value_of(self.bv), self.compute_dtype)
            if cfg.qk_norm:
                q_BxLxHxK, k_BxLxGxK = self.q_norm(q_BxLxHxK), self.k_norm(k_BxLxGxK)
            # A decode step's unrolled layers share the rotary tables (a prefill's kept them in its
            # rotations: apart, XLA kept more of the prompt's temporaries live, 1.5 GiB at 29,000 tokens).
            shared = cache is not None and not cache.prefill
            index = cache.layer if cache is not None else layer_index()
            # Gemma 3's sliding layers rotate with their own base, unscaled (which ones may be traced).
            local = None if cfg.local_rope_theta is None else (cfg.local_rope_theta, cfg.slides(index))
            q_BxLxHxK, k_BxLxGxK = (rope(x, positions, cfg.rope_theta, cfg.rope_scaling, length,
                                         shared=shared, local=local)
                                    for x in (q_BxLxHxK, k_BxLxGxK))  # fmt: skip
            if cfg.attention_scale is not None:  # The kernels scale by 1 / sqrt(head_size): the rest here,
                scale = cfg.attention_scale * math.sqrt(cfg.head_size)  # in float32 (in bf16, 144 / 128's
                q_BxLxHxK = (q_BxLxHxK.astype(jnp.float32) * scale).astype(q_BxLxHxK.dtype)  # is 0.15% low).
            if cache is not None and cache.ring is not None:  # Whether it slides is the layer's place.
                window = cfg.sliding_window if cache.ring else None
            else:
                window = self._window(cache.cache.max_len if cache is not None else length, index)
            how = dict(window=window, softcap=cfg.attention_softcap)
            if cache is None:
                ctx_BxLxHxK = context.attend(self.attention, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, **how)
            else:
                ctx_BxLxHxK, written = cache.attend(self.attention, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, **how)
            ctx_BxLxHxK = _whole_seq(ctx_BxLxHxK, _HEADS)
            ctx_BxLxHxK = checkpoint_name(ctx_BxLxHxK, "attn_context")
            # Summed over the tensor-parallel heads: an all-reduce, or a reduce-scatter onto the residual
            # stream's share of the sequence with sequence parallelism.
            out_BxLxD = self._scattered_projection("blhk,hkd->bld", ctx_BxLxHxK, self.wo, _WO, _HEADS)
            out_BxLxD = checkpoint_name(out_BxLxD, "out_proj")
            if cfg.post_norms:
                out_BxLxD = self.post_attn_norm(out_BxLxD)
            x_BxLxD = x_BxLxD + out_BxLxD

        with jax.named_scope("mlp"):
            mlp_BxLxD = self._feed_forward(x_BxLxD, fused.get("w_gate_up"))
            x_BxLxD = x_BxLxD + (self.post_mlp_norm(mlp_BxLxD) if cfg.post_norms else mlp_BxLxD)
        return x_BxLxD if cache is None else (x_BxLxD, written)

    def _window(self, keys: int, index):
        """The window this layer attends over ``keys`` keys with: the model's every layer's, or, where it
        slides on some layers only (``model.sliding_layers``) and is shorter than the keys, this one's,
        picked from the layer's ``index`` in the stack (traced: the layers are one scan) with a window as
        long as any sequence for the others."""
        cfg = self.cfg
        if not cfg.windows_vary or keys <= cfg.sliding_window:
            return cfg.layer_window  # None where it varies: no layer's window masks a key.
        return jnp.where(cfg.slides(index), cfg.sliding_window, keys).astype(jnp.int32)

    def _feed_forward(self, x_BxLxD, fused: Fused | None = None):
        """The MLP's (or the experts') output for the residual stream ``x``, before it is added;
        ``fused``: the gate and up weights as one (serving's)."""
        if self.cfg.n_experts:
            h_BxLxD = _whole_seq(_split_seq(self.mlp_norm(x_BxLxD)), ("batch", "seq", None))
            return self.moe(h_BxLxD)
        return checkpoint_name(self._mlp(self.mlp_norm(x_BxLxD), fused), "mlp_out")


class Llama(nnx.Module):
    """The reference decoder. ``remat`` gives each layer its checkpoint policy (default: none);
    ``attention`` is the resolved kernel (default: ``cfg.attention`` resolved for ``jax.devices()``);
    ``pipeline`` runs the layer stack in stages (default: all layers in one scan);
    ``collective_matmuls`` overlaps sequence parallelism's collectives with the tensor-parallel
    matmuls (:mod:`shardmem.parallel.collective_matmul`; default: not)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        remat: LayerPlan | None = None,
        param_dtype=jnp.float32,
        compute_dtype=jnp.bfloat16,
        attention: AttentionKernel | None = None,
        pipeline: Pipeline | None = None,
        collective_matmuls: bool = False,
    ):
        if attention is None:
            varying = cfg.windows_vary and cfg.seq_len > cfg.sliding_window  # Each layer's own window.
            attention = resolve_for_devices(cfg.attention, jax.devices(), chunk=cfg.attention_chunk,
                                            dtype=compute_dtype, head_dim=cfg.head_size,
                                            softcap=cfg.attention_softcap is not None,
                                            layer_windows=varying)  # fmt: skip
        self.cfg = cfg
        self.attention = attention
        self.loss_chunk = resolve_loss_chunk(cfg.loss_chunk, cfg.vocab_size, cfg.d_model)
        self.logit_softcap = cfg.logit_softcap  # The loss caps the logits it computes in chunks as well.
        self.remat = remat or LayerPlan.uniform(cfg.n_layers)
        self.pipeline = pipeline  # Runs the layer stack in pipeline stages (shardmem.parallel.pipeline).
        self.compute_dtype = compute_dtype
        init_embed = nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", "embed"))
        self.embedding = nnx.Param(init_embed(rngs.params(), (cfg.vocab_size, cfg.d_model), param_dtype))

        @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(key):
            return Block(cfg, rngs=nnx.Rngs(params=key), param_dtype=param_dtype, compute_dtype=compute_dtype,
                         attention=attention, collective_matmuls=collective_matmuls)  # fmt: skip

        self.layers = make_layers(jax.random.split(rngs.params(), cfg.n_layers))
        norm = dict(param_dtype=param_dtype, compute_dtype=compute_dtype, offset=cfg.norm_offset)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, **norm)
        if not cfg.tie_embeddings:
            self.lm_head = _param(
                rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), param_dtype, cfg.d_model
            )

    def __call__(self, tokens_BxL):
        """Returns the logits: :meth:`hidden_states` times :meth:`unembedding` (soft-capped as
        ``model.logit_softcap`` says)."""
        logits_BxLxV = soft_cap(self.hidden_states(tokens_BxL) @ self.unembedding(), self.cfg.logit_softcap)
        return constrain(logits_BxLxV, ("batch", "seq", "vocab"))

    def hidden_states(self, tokens_BxL):
        """Returns the final normed hidden states, which :meth:`unembedding` turns into logits."""
        # Gather from an all-gathered (compute-dtype) table: a sharded gather would need the
        # partitioner's slow fallback to reach the batch-sharded activations.
        # Context parallelism: the layers see the sequence in zigzag order; split by hand, a device's own
        # chunks of it, which it returns (the loss takes its targets' chunks too: losses.next_token_loss).
        shards, by_hand = context.shards(), context.split_by_hand()
        tokens_BxL = context.own_chunks(tokens_BxL) if by_hand else context.to_zigzag(tokens_BxL, shards)
        x_BxLxD = self._embed(tokens_BxL, table_axes=(None, None))
        if self.pipeline:
            x_BxLxD = self.pipeline.run(self.layers, x_BxLxD, self.remat)
        else:  # Each layer may read its index in the stack (a window on some layers: Block._window).
            x_BxLxD = remat_scan(self.layers, x_BxLxD, self.remat, indexed=True)
        h_BxLxD = _whole_seq(_split_seq(self.final_norm(x_BxLxD)), ("batch", "seq", None))  # See Block.
        return (
            h_BxLxD
            if shards == 1 or by_hand
            else constrain(context.from_zigzag(h_BxLxD, shards), ("batch", "seq", None))
        )

    def cached_hidden_states(self, tokens_BxL, cache: KVCache, positions, layer_params, *, prefill: bool,
                             rope_length=None, lengths=None):  # fmt: skip
        """Returns ``(h_BxLxD, cache)``: :meth:`hidden_states` of a step of serving, the same layers run
        with a KV cache (:mod:`shardmem.models.kv_cache`). A prefill's ``tokens`` are right-padded prompts
        at ``positions`` ``[L]`` (0 .. L-1), written to the cache's first L places; a decode step's are
        one token per sequence (``L`` = 1) at ``positions`` ``[B, 1]``, each sequence's own.
        ``rope_length``: the step's largest position of a real token over the batch, plus one (the
        longest prompt's length in a prefill), which dynamic RoPE requires (:mod:`shardmem.models.rope`).
        ``lengths``: a prefill's prompts' (``[B]``), which a cache whose ring is shorter than the prompts
        needs (:attr:`~shardmem.models.kv_cache.KVCache.ring`: the sliding layers' keys, each layer's in
        its place in the ring or in the stack, in the stack's order).
        ``layer_params`` holds each layer's parameters (a pure dict each, in layer order): the serving
        program's weights are stored by layer (:func:`shardmem.program.serving.by_layer`), and the layers
        read them from there, not from the model's stacked layers."""
        # Vocab-parallel lookup (Megatron's, as the pipeline's embed): a decode step looks up a few rows,
        # where all-gathering the table would move all of it every step.
        x_BxLxD = self._embed(tokens_BxL, table_axes=("vocab", None))
        graphdef, _, rest = nnx.split(self.layers, nnx.Param, ...)
        # Unrolled, each layer's matmuls reading its own weights: in a loop, XLA's GPU compiler copies each
        # layer's weights out of the stack before its matmuls (a dynamic slice it cannot fuse into them),
        # tripling a decode step's weight traffic; unrolled over the stack, each layer's kernels slice
        # their layer out of it, so no two layers share a kernel and the plan generates 80 layers' worth.
        # Separate arrays make the layers' kernels identical: XLA generates one layer's and reuses them.
        # The cache index reaches the kernels as an argument too (the barrier keeps XLA from folding it):
        # a constant index made each layer's cache kernels its own, and XLA turned a prefill's writes at
        # constant indices into a copy of the whole cache per layer.
        # A layer's fused groups (models/fused.py) reach it beside its parameters, whose parts of them
        # are stand-ins: one matmul computes the parts.
        # Each layer is one jitted function of its weights, traced and lowered once for all the layers
        # (XLA inlines the calls: the compiled program is the same); tracing and lowering each of a 70B
        # model's 80 layers anew cost its plan 6 of 48 s of CPU.
        # A prefill writes each layer's keys and values into the cache before the next layer runs (the
        # barrier): left to itself, XLA's GPU scheduler wrote every layer's rotated keys after the last
        # layer and held all of them meanwhile (Llama 2 7B, 384 prompts of 128 tokens on an A100: 15.8 GiB
        # of temporaries, 5.7 GiB with the barrier; Llama 3.1 8B, one prompt of 20,000 tokens: 3.25, 2.33).
        layer_indices = jax.lax.optimization_barrier([jnp.int32(i) for i in range(len(layer_params))])
        if self.cfg.rope_scaling is not None and self.cfg.rope_scaling.per_forward and rope_length is None:
            raise ValueError("dynamic RoPE needs the step's rope_length (its longest position + 1)")
        # Where each layer's keys are (CacheSlot): with a ring, a sliding layer's in it and the others' in
        # the stack, each at its index among the layers of its kind; without, in the stack by the layer's.
        places = [(None, None)] * len(layer_params)
        if cache.ring is not None:
            ringed = [self.cfg.slides(i) for i in range(len(layer_params))]
            entries = [jnp.int32(ringed[:i].count(ring)) for i, ring in enumerate(ringed)]
            places = list(zip(ringed, jax.lax.optimization_barrier(entries), strict=True))

        @functools.partial(jax.jit, static_argnames="ring")
        def run_layer(params, rest, fused, x_BxLxD, cache, layer, entry, positions, rope_length, lengths,
                      ring):  # fmt: skip
            parts = {part: shape for w in fused.values() for part, shape in w.part_shapes().items()}
            block = nnx.merge(graphdef, {**params, **parts}, rest)
            slot = CacheSlot(cache, layer, positions, prefill, rope_length, ring, entry, lengths)
            return block(x_BxLxD, slot, fused)

        for index, params in enumerate(layer_params):
            fused = {name: w for name, w in params.items() if isinstance(w, Fused)}
            params = {name: w for name, w in params.items() if name not in fused}
            ring, entry = places[index]
            x_BxLxD, cache = run_layer(params, jax.tree.map(operator.itemgetter(index), rest), fused,
                                       x_BxLxD, cache, layer_indices[index], entry, positions, rope_length,
                                       lengths, ring=ring)  # fmt: skip
            if prefill:  # The layer's keys and values are in the cache before the next layer runs.
                x_BxLxD, cache = jax.lax.optimization_barrier((x_BxLxD, cache))
        return self.final_norm(x_BxLxD), cache

    def _embed(self, tokens_BxL, table_axes):
        """The input embeddings of ``tokens``, looked up in the table constrained to ``table_axes``."""
        table_VxD = constrain(weight(value_of(self.embedding), self.compute_dtype), table_axes)
        x_BxLxD = constrain(table_VxD[tokens_BxL], RESIDUAL)
        if self.cfg.scale_embeddings:  # Gemma: by sqrt(d_model), rounded to the compute dtype as it does.
            x_BxLxD = x_BxLxD * jnp.asarray(math.sqrt(self.cfg.d_model), self.compute_dtype)
        return x_BxLxD

    def pipelined_loss(self, tokens_BxL, targets_BxL):
        """Returns the mean next-token cross-entropy of ``targets`` with the embedding, the layers, the
        final norm and the loss run by the pipeline's 1F1B schedule
        (:meth:`shardmem.parallel.pipeline.Pipeline.loss`), which computes their gradients as it goes."""
        cfg, dtype, chunk = self.cfg, self.compute_dtype, self.loss_chunk
        shards = context.shards()  # Context parallelism: the loss sums over positions in zigzag order.
        tokens_BxL, targets_BxL = (context.to_zigzag(a, shards) for a in (tokens_BxL, targets_BxL))

        def embed(table_VxD, tokens_bxL):
            # From the table split over vocab alone (Megatron's vocab-parallel embedding): a micro-batch is a
            # few rows, where all-gathering the table would move all of it every micro-batch. (Split over
            # the model dimension too, fsdp's or context's, XLA's partitioner aborts on the lookup.)
            x_bxLxD = constrain(_vocab_parallel_lookup(table_VxD.astype(dtype), tokens_bxL), RESIDUAL)
            if cfg.scale_embeddings:  # Gemma, as in the unpipelined forward.
                x_bxLxD = x_bxLxD * jnp.asarray(math.sqrt(cfg.d_model), dtype)
            return x_bxLxD

        def head_loss(params, x_bxLxD, targets_bxL):
            h_bxLxD = _rms_norm(x_bxLxD, params["norm"], cfg.norm_eps, dtype, cfg.norm_offset)
            h_bxLxD = _whole_seq(_split_seq(h_bxLxD), ("batch", "seq", None))
            head_DxV = params["head"].astype(dtype)
            head_DxV = head_DxV.T if cfg.tie_embeddings else head_DxV
            return cross_entropy(h_bxLxD, head_DxV, targets_bxL, chunk, softcap=cfg.logit_softcap)

        head_params = {"norm": self.final_norm.scale[...],
                       "head": self.embedding[...] if cfg.tie_embeddings else self.lm_head[...]}  # fmt: skip
        # Gathered over the model dimension once a step, not every micro-batch (see embed).
        table_VxD = constrain(self.embedding[...], ("vocab", None))
        return self.pipeline.loss(self.layers, self.remat, tokens_BxL, targets_BxL, embed=embed,
                                  embed_params=table_VxD, head_loss=head_loss,
                                  head_params=head_params)  # fmt: skip

    def unembedding(self):
        """Returns the output projection ``head_DxV`` in the compute dtype (the embedding when tied)."""
        if self.cfg.tie_embeddings:
            return weight(value_of(self.embedding), self.compute_dtype).T
        return weight(value_of(self.lm_head), self.compute_dtype)


def _vocab_parallel_lookup(table_VxD, tokens_BxL):
    """``table[tokens]`` from the table split over vocab (``rules.vocab``) in T blocks of R rows, as
    Megatron's vocab-parallel embedding does it: each device looks its tokens up in its own block, a zero
    row where a token is another block's, and the blocks' rows are summed. Written out, not left to XLA's
    partitioner: inside the 1F1B pipeline's shard_map, on a mesh with more axes than vocab's, it aborted
    partitioning that gather (JAX 0.12: a failed check expanding the all-reduce's device groups)."""
    vocab, d = table_VxD.shape
    spec = activation_spec(("vocab", None), table_VxD.shape)
    mesh = jax.sharding.get_abstract_mesh()
    blocks = math.prod(mesh.shape[a] for a in spec_axes(spec[0])) if len(spec) else 1
    if blocks == 1 or vocab % blocks:
        return constrain(table_VxD, ("vocab", None))[tokens_BxL]
    rows = vocab // blocks
    table_TxRxD = constrain(table_VxD.reshape(blocks, rows, d), ("vocab", None, None))
    local_TxBxL = tokens_BxL[None] - (jnp.arange(blocks) * rows)[:, None, None]
    hit_TxBxL = (local_TxBxL >= 0) & (local_TxBxL < rows)
    x_TxBxLxD = jax.vmap(lambda block, at: block[at])(table_TxRxD, jnp.where(hit_TxBxL, local_TxBxL, 0))
    return jnp.where(hit_TxBxL[..., None], x_TxBxLxD, 0).sum(axis=0)
