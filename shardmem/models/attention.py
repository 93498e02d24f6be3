"""Attention kernels as values: one parse (:func:`resolve_attention`), one lowering (:func:`attend`), one
table of what each does (:data:`KERNELS`).

    kernel = resolve_for_devices("auto", mesh.devices.flat, head_dim=128)   # for the mesh's GPUs, say
    ctx_BxLxHxK = attend(kernel, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)   # causal, G key/value heads

``model.attention: auto`` runs cuDNN flash attention on an attached NVIDIA GPU and query-chunked
attention on CPU. cuDNN kernels cannot be compiled without a GPU ("cuDNN not found"), so a deviceless GPU
plan compiles JAX's Pallas Triton flash kernel in its place: the same O(L) memory (no L x L scores, the
output and its log-sum-exp kept for the backward; grouped-query keys and values read and kept as they are,
not copied to every query head: :mod:`shardmem.models.grouped_flash`), and the report says what it stands
for. On TPUs (attached or deviceless) ``auto`` is query-chunked attention: the Pallas kernel here is the
GPU's Triton one. So it is on GPUs before Ampere (T4, V100: compute capability below 8.0), for which
neither flash kernel builds. cuDNN takes heads that are a multiple of 8, up to 128 before Hopper and 256
from it: others get Pallas's flash kernel itself from ``auto``, on the GPU and in its deviceless plan alike.

A sliding window (``model.sliding_window``, Mistral's: each position attends to the last ``window``
positions, itself included, as ``transformers`` masks them) is a mask in ``xla``, a slice of the keys in
``chunked`` (each query block scores ``chunk + window - 1`` keys, not all ``L``), and cuDNN's
``local_window_size``. JAX's Pallas kernel has no window: it is refused where it would run, and as the
deviceless stand-in for cuDNN it attends causally over the whole sequence (the same memory, no L x L
either way; more FLOPs than cuDNN's), which the report's attention line says.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardmem.errors import ConfigError, one_of
from shardmem.models import grouped_flash
from shardmem.parallel import rules as _rules

#: What each kernel does, and where it runs.
KERNELS = {
    "cudnn": "cuDNN flash attention (jax.nn.dot_product_attention, implementation='cudnn'): no L x L "
    "scores; attached NVIDIA GPUs only",
    "pallas": "JAX's Pallas Triton flash attention (jax.experimental.pallas.ops.gpu.attention's kernels, "
    "reading grouped-query keys and values as they are: shardmem.models.grouped_flash): no L x L scores; "
    "NVIDIA GPUs, deviceless too (interpret mode on CPU, for tests)",
    "chunked": "blocks of model.attention_chunk queries, each recomputed in the backward pass: "
    "L x chunk scores for one extra QK/PV product",
    "xla": "plain softmax attention: fp32 L x L scores per head",
}
#: Values ``model.attention`` accepts.
ATTENTION_CHOICES = ("auto", *KERNELS)
#: Query block of ``chunked`` when ``model.attention_chunk`` is unset.
DEFAULT_CHUNK = 512
#: Sequence block of the Pallas flash kernel (``BlockSizes.get_default().block_q``): a shorter sequence
#: is one block, a longer one must be a multiple of it.
PALLAS_BLOCK = 128
#: The Pallas forward kernel's pipeline depth (``mha``'s ``num_stages``): Triton buffers each block of
#: keys and of values it loads this many times over.
_FLASH_STAGES = 2
#: The widest head the flash kernels take: FlashAttention-2's and cuDNN's limit, and the widest whose
#: backward blocks (the Pallas kernel's 32 x 32) fit every flash target's shared memory.
MAX_FLASH_HEAD_DIM = 256
#: The widest head cuDNN's flash attention takes before Hopper (compute capability 9.0), and from it;
#: each a multiple of 8 (JAX's ``check_is_flash_attention``, which refuses others when it traces).
CUDNN_MAX_HEAD_DIM = {"before hopper": 128, "hopper": 256}
#: Where a model is built for: an attached NVIDIA GPU, one compiled deviceless, a GPU before Ampere
#: (attached or deviceless), CPU devices or TPUs.
DEVICE_CLASSES = ("gpu", "deviceless-gpu", "pre-ampere-gpu", "cpu", "tpu")
#: The first compute capability that cuDNN's and Triton's flash kernels build for (XLA refuses Triton
#: below it: "Triton support is only enabled for Ampere GPUs").
FLASH_COMPUTE_CAPABILITY = (8, 0)


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """A resolved attention kernel: ``name`` is one of :data:`KERNELS`; ``chunk`` the query block of
    ``chunked``; ``stands_for`` the kernel a deviceless plan models with this one; ``interpret`` runs
    Pallas in interpret mode (CPU)."""

    name: str = "xla"
    chunk: int | None = None
    stands_for: str | None = None
    interpret: bool = False
    context: int = 1  # Devices each sequence is split over (shardmem.parallel.context).
    # Bytes of shared memory one thread block of the GPU may take (its opt-in limit), which the flash
    # kernel's tiles must fit (:meth:`flash_blocks`); None: the kernel's default tiles (CPU, unknown GPUs).
    shared_memory: int | None = None
    # The GPU's SMs, which a decode step's attention splits the cache's positions to fill
    # (:mod:`shardmem.models.decode_attention`); None: unknown (CPU, TPUs, GPUs without a spec).
    sms: int | None = None

    @property
    def decodes_in_pallas(self) -> bool:
        """Whether a serving decode step attends over the KV cache with the Pallas decode kernel
        (:mod:`shardmem.models.decode_attention`): where this kernel is a flash kernel of a GPU (cuDNN,
        Pallas, or Pallas standing in for cuDNN), in interpret mode where Pallas's is (CPU)."""
        return self.name in ("cudnn", "pallas")

    def describe(self, window: int | None = None, softcap: float | None = None,
                 layers: tuple[int, int] | None = None, traced: bool = True) -> str:  # fmt: skip
        """Returns one line for the report, e.g. ``pallas (stand-in for cudnn: ...)``, saying how a
        sliding ``window`` (``model.sliding_window``) is attended (on ``layers`` = (k, n): on k of the n
        layers only; ``traced``: each layer picks its own by its traced index in the stack, as training's
        scan does, where serving's unrolled layers know theirs), and why a model whose scores are
        soft-capped (``softcap``) runs no flash kernel."""
        text = self.name + (f" (blocks of {self.chunk} queries)" if self.name == "chunked" else "")
        if softcap is not None:
            text += f"; scores soft-capped at {softcap:g}, which neither flash kernel does"
        if window is not None:
            text += f"; sliding window of {window}"
            if layers is not None:
                some, every = layers
                text += f" on {some} of the {every} layers"
                text += ", each layer's own (keys masked, not skipped)" if traced else ""
            if self.name == "pallas":  # Only a stand-in gets here (check_window).
                text += "," if layers is not None else ""
                text += " not in the stand-in, which attends causally over the whole sequence (more FLOPs)"
        if self.interpret:
            text += " (interpret mode)"
        if self.stands_for:
            text += (
                f", standing in for {self.stands_for} (which needs a GPU to compile; same memory: no L x L)"
            )
        if self.context > 1:
            text += (f"; context parallel over {self.context} devices (keys and values all-gathered, zigzag "
                     "causal load balance)")  # fmt: skip
        return text

    def check_window(self, window: int | None, seq_len: int) -> None:
        """Raises ConfigError where this kernel would run without ``model.sliding_window``'s window: JAX's
        Pallas kernel has none (as a deviceless stand-in it runs nowhere: allowed, and described)."""
        if window is None or window >= seq_len or self.name != "pallas" or self.stands_for:
            return
        where = f" on a sequence split over {self.context} devices" if self.context > 1 else ""
        raise ConfigError(
            f"model.sliding_window={window} with model.attention=pallas{where}: JAX's Pallas flash kernel "
            "has no sliding window; use model.attention=auto or cudnn (cuDNN's flash attention has one), "
            "or chunked"
        )

    def check_length(self, seq_len: int, key: str = "model.seq_len",
                     instead: str | None = "model.attention=chunked") -> None:  # fmt: skip
        """Raises ConfigError where the Pallas kernel cannot tile ``seq_len`` positions (with a context
        axis: each of the ``2 x context`` blocks :mod:`shardmem.parallel.context` gives it), naming the
        config ``key`` that set them and the setting to use ``instead`` (None: none)."""
        if self.name != "pallas":
            return
        pieces = 2 * self.context if self.context > 1 else 1
        block = seq_len // pieces
        if block <= PALLAS_BLOCK or block % PALLAS_BLOCK == 0:
            return
        step = PALLAS_BLOCK * pieces
        below, above = seq_len // step * step, (seq_len // step + 1) * step
        each = f"each of its 2 x {self.context} context blocks has {block}" if pieces > 1 else f"{seq_len}"
        kernel = "pallas" + (f" (standing in for {self.stands_for})" if self.stands_for else "")
        raise ConfigError(
            f"{key}={seq_len}: the {kernel} flash kernel tiles a sequence in blocks of "
            f"{PALLAS_BLOCK} positions, and {each} is neither at most one block nor a multiple of one; "
            f"use a {key.split('.')[-1]} that is a multiple of {step} "
            f"(e.g. {' or '.join(str(x) for x in (below, above) if x)})"
            + (f", or {instead}" if instead else "")
        )

    def check_head_dim(self, head_dim: int) -> None:
        """Raises ConfigError where the flash kernel cannot take heads of ``head_dim``: more than
        :data:`MAX_FLASH_HEAD_DIM`, whose tiles the GPUs' shared memory does not hold."""
        if self.name != "pallas" or head_dim <= MAX_FLASH_HEAD_DIM:
            return
        kernel = "pallas" + (f" (standing in for {self.stands_for})" if self.stands_for else "")
        raise ConfigError(
            f"model.head_dim={head_dim}: the {kernel} flash kernel takes heads of at most "
            f"{MAX_FLASH_HEAD_DIM} (as FlashAttention-2's and cuDNN's do); use a head_dim of at most "
            f"{MAX_FLASH_HEAD_DIM}, or model.attention=chunked"
        )

    def flash_blocks(self, head_dim: int, length: int, itemsize: int):
        """Returns the Pallas flash kernel's ``BlockSizes`` for heads of ``head_dim`` over ``length``
        positions in a dtype of ``itemsize`` bytes, tiled as the real kernels tile them: the widest
        blocks whose tiles fit the GPU's shared memory.

        The kernel pads a head to the next power of two (160 and 192 to 256) and holds, per thread block,
        a block of queries and ``_FLASH_STAGES`` blocks each of keys and values, ``block x padded head``
        elements each; its default 128 x 128 blocks of 256-wide heads ask 320 KiB (an H100 block has
        227 KiB). As FlashAttention-2 does for wide heads, the key block halves first, then the query
        block. The bound is what Triton allocated for the forward on Hopper (exactly, blocks of 64 and
        more) and above it on Ampere and Ada (BENCHMARKS.md, issue 38). The backward keeps the
        kernel's 32 x 32 blocks, which take at most 67,840 bytes up to 256-wide heads.
        """
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention  # Loads Triton support.

        default = pallas_attention.BlockSizes.get_default()
        if self.shared_memory is None:
            return default
        padded = 1 << (head_dim - 1).bit_length()
        block_q, block_k = default.block_q, default.block_k
        while itemsize * padded * (block_q + 2 * _FLASH_STAGES * block_k) > self.shared_memory:
            if block_k > 32:
                block_k //= 2
            elif block_q > 32:
                block_q //= 2
            else:
                break  # 32 x 32 of a 256-wide head fits the smallest flash GPU's 99 KiB.
        # A sequence of one block (at most 128 positions) stays one block, as the kernel takes it.
        one = lambda block: length if length <= block or length % block else block  # noqa: E731
        return dataclasses.replace(default, block_q=one(block_q), block_k=one(block_k))


def shared_memory_per_block(devices) -> int | None:
    """Returns the shared memory one thread block may take on ``devices``' GPU (its opt-in limit, from
    :data:`~shardmem.planning.targets.GPU_ROWS`: whole GPUs and MIG slices), or None for CPUs, TPUs and
    GPUs shardmem has no spec for."""
    row = _gpu_row(devices)
    return row.shared_memory_per_block_optin if row else None


def sm_count(devices) -> int | None:
    """Returns the SMs of ``devices``' GPU (:data:`~shardmem.planning.targets.GPU_ROWS`), or None for
    CPUs, TPUs and GPUs shardmem has no spec for."""
    row = _gpu_row(devices)
    return row.sm_count if row else None


def _gpu_row(devices):
    """The :data:`~shardmem.planning.targets.GPU_ROWS` row of ``devices``' GPU, or None."""
    from shardmem.planning.targets import GPU_ROWS, target_for_device_kind

    device = next(iter(devices))
    if device.platform in ("cpu", "tpu"):
        return None
    name = target_for_device_kind(device.device_kind)
    return GPU_ROWS[name] if name else None


def cudnn_max_head_dim(devices) -> int | None:
    """Returns the widest head cuDNN's flash attention takes on ``devices``' GPU (attached or compiled
    deviceless: :data:`CUDNN_MAX_HEAD_DIM` by its compute capability), or None for CPUs and TPUs."""
    device = next(iter(devices))
    capability = getattr(device, "compute_capability", None)
    if device.platform in ("cpu", "tpu") or not capability:
        return None
    hopper = tuple(int(p) for p in str(capability).split(".")[:2]) >= (9, 0)
    return CUDNN_MAX_HEAD_DIM["hopper" if hopper else "before hopper"]


def device_class(devices) -> str:
    """Returns ``"gpu"`` (attached NVIDIA GPUs), ``"deviceless-gpu"`` (compile-only),
    ``"pre-ampere-gpu"`` (either, below compute capability 8.0: T4, V100), ``"cpu"`` or ``"tpu"``
    (attached or compile-only)."""
    device = next(iter(devices))
    if device.platform in ("cpu", "tpu"):
        return device.platform
    capability = getattr(device, "compute_capability", None)  # "7.5"; absent on ROCm devices.
    if capability and tuple(int(p) for p in str(capability).split(".")[:2]) < FLASH_COMPUTE_CAPABILITY:
        return "pre-ampere-gpu"
    try:
        attached = device in jax.devices(device.platform)
    except RuntimeError:  # The platform's backend is not running: compile-only devices.
        attached = False
    return "gpu" if attached else "deviceless-gpu"


def resolve_attention(
    requested: str,
    *,
    chunk: int | None,
    where: str,
    dtype="bfloat16",
    context: int = 1,
    window: bool = False,
    shared_memory: int | None = None,
    sms: int | None = None,
    head_dim: int | None = None,
    cudnn_heads: int | None = None,
    softcap: bool = False,
    layer_windows: bool = False,
) -> AttentionKernel:
    """Parses ``model.attention`` (and ``model.attention_chunk``) for a model built for ``where``
    (one of :data:`DEVICE_CLASSES`) computing in ``dtype``, its sequences split over ``context`` devices,
    into the kernel the step runs; a flash kernel's tiles fit ``shared_memory`` bytes per thread block
    (:func:`shared_memory_per_block` of the devices), and a decode step's attention splits the KV cache
    to fill ``sms`` SMs (:func:`sm_count`). cuDNN's flash attention takes 16-bit inputs only, so
    ``auto`` in float32 is ``chunked`` everywhere; with ``context > 1`` the flash kernel is Pallas's, whose
    blocks :mod:`shardmem.parallel.context` merges by log-sum-exp (cuDNN's has no such form here), and with a
    sliding ``window`` as well ``auto`` is ``chunked`` (Pallas's kernel has no window). Heads of
    ``head_dim`` that cuDNN's flash attention does not take (a multiple of 8 up to ``cudnn_heads``,
    :func:`cudnn_max_head_dim`) get Pallas's flash kernel itself from ``auto`` on a GPU, attached or
    deviceless (``chunked`` with a ``window``, or past :data:`MAX_FLASH_HEAD_DIM`); ``cudnn`` is an error.
    Soft-capped scores (``softcap``, Gemma 2's) are in neither flash kernel, nor is a window each layer
    picks for itself (``layer_windows``: one on some layers only, shorter than the sequences): ``auto`` is
    ``chunked`` for them, wherever the model runs, and ``cudnn`` or ``pallas`` an error."""
    if requested not in ATTENTION_CHOICES:
        raise ConfigError(f"model.attention={requested!r}: use {one_of(ATTENTION_CHOICES)}")
    if layer_windows and requested in ("cudnn", "pallas"):
        raise ConfigError(
            f"model.attention={requested} with model.sliding_layers (a window on some layers only, shorter "
            "than the sequences): the flash kernels take one window for every layer; use "
            "model.attention=auto or chunked (query blocks, no L x L scores) or xla"
        )
    if softcap or layer_windows:
        if requested in ("cudnn", "pallas"):
            raise ConfigError(
                f"model.attention={requested} with model.attention_softcap set: neither flash kernel "
                "(cuDNN's, Pallas's) caps the scores, and without the cap the model's logits are wrong; "
                "use model.attention=auto or chunked (query blocks, no L x L scores) or xla"
            )
        if requested == "auto":
            requested = "chunked"
    if context > 1:
        if requested == "cudnn":
            raise ConfigError(
                f"model.attention=cudnn has no context-parallel form (mesh.axes.context={context}); use "
                "model.attention=auto or pallas (flash attention in blocks merged by log-sum-exp), or chunked"
            )
        flash = where not in ("cpu", "tpu", "pre-ampere-gpu")
        if requested == "auto" and flash and jnp.dtype(dtype).itemsize <= 2:
            requested = "chunked" if window else "pallas"
        kernel = resolve_attention(requested, chunk=chunk, where=where, dtype=dtype,
                                   shared_memory=shared_memory, sms=sms)  # fmt: skip
        return dataclasses.replace(kernel, context=context)
    wide = jnp.dtype(dtype).itemsize > 2
    if requested == "cudnn" and wide:
        raise ConfigError(
            f"model.attention=cudnn needs 16-bit inputs but precision.compute={jnp.dtype(dtype).name}; "
            "set precision.compute=bfloat16, or use model.attention=auto or chunked"
        )
    if requested == "auto" and wide:
        return AttentionKernel("chunked", chunk=chunk or DEFAULT_CHUNK)
    if where == "pre-ampere-gpu" and requested in ("cudnn", "pallas"):
        raise ConfigError(
            f"model.attention={requested}: its flash kernel needs an NVIDIA GPU of compute capability 8.0 "
            "(Ampere) or newer, and this one is older (T4, V100); use model.attention=auto or chunked "
            "(query blocks, no L x L scores)"
        )
    if requested in ("auto", "cudnn") and where in ("gpu", "deviceless-gpu") and head_dim is not None:
        limit = cudnn_heads or MAX_FLASH_HEAD_DIM
        if head_dim % 8 or head_dim > limit:  # cuDNN refuses these heads when it traces.
            if requested == "cudnn":
                raise ConfigError(
                    f"model.attention=cudnn with heads of {head_dim}: cuDNN's flash attention takes head "
                    f"dims that are multiples of 8, up to {limit} on this GPU; use model.attention=auto "
                    "(Pallas's flash kernel for these heads) or chunked"
                )
            if window or head_dim > MAX_FLASH_HEAD_DIM:
                return AttentionKernel("chunked", chunk=chunk or DEFAULT_CHUNK)
            return AttentionKernel("pallas", shared_memory=shared_memory, sms=sms)
    if requested in ("auto", "cudnn"):
        if where == "gpu":
            return AttentionKernel("cudnn", sms=sms)
        if where == "deviceless-gpu":
            return AttentionKernel("pallas", stands_for="cudnn", shared_memory=shared_memory, sms=sms)
        if requested == "cudnn":
            raise ConfigError(
                "model.attention=cudnn needs an NVIDIA GPU (attached, or a deviceless GPU target); on "
                f"{where} use model.attention=auto or chunked"
            )
        return AttentionKernel("chunked", chunk=chunk or DEFAULT_CHUNK)
    if requested == "pallas" and where == "tpu":
        raise ConfigError(
            "model.attention=pallas is JAX's Pallas Triton (GPU) kernel and does not compile for TPUs; use "
            "model.attention=auto or chunked (query blocks, no L x L scores) or xla"
        )
    if requested == "pallas":
        return AttentionKernel("pallas", interpret=where == "cpu", shared_memory=shared_memory, sms=sms)
    if requested == "chunked":
        return AttentionKernel("chunked", chunk=chunk or DEFAULT_CHUNK)
    return AttentionKernel("xla")


def resolve_for_devices(requested: str, devices, *, chunk: int | None = None, dtype="bfloat16",
                        context: int = 1, window: bool = False, head_dim: int | None = None,
                        softcap: bool = False, layer_windows: bool = False) -> AttentionKernel:  # fmt: skip
    """:func:`resolve_attention` for a model built for ``devices``: their class, the shared memory one of
    their thread blocks may take, their SMs and the widest head cuDNN takes on them."""
    devices = list(devices)
    return resolve_attention(requested, chunk=chunk, where=device_class(devices), dtype=dtype,
                             context=context, window=window, shared_memory=shared_memory_per_block(devices),
                             sms=sm_count(devices), head_dim=head_dim,
                             cudnn_heads=cudnn_max_head_dim(devices), softcap=softcap,
                             layer_windows=layer_windows)  # fmt: skip


def masking(window, length: int):
    """The ``window`` if it may hide one of ``length`` keys from a query: a static one shorter than them,
    or a traced one (a layer's own, where the window slides on some layers only: ``xla`` and ``chunked``
    take it); None for none, or one as long as the keys."""
    if window is None or not isinstance(window, int):
        return window
    return window if window < length else None


def check_takes(kernel: AttentionKernel, window, softcap: float | None) -> None:
    """Raises ValueError where ``kernel`` cannot attend as asked: soft-capped scores, or a traced window
    (a layer's own), which only ``xla`` and ``chunked`` take (:func:`resolve_attention` gives no other)."""
    if softcap is not None and kernel.name not in ("xla", "chunked"):
        raise ValueError(f"attention kernel {kernel.name!r} has no soft-capped scores; use chunked or xla")
    if not isinstance(window, int | None) and kernel.name not in ("xla", "chunked"):
        raise ValueError(f"attention kernel {kernel.name!r} takes a static window only; use chunked or xla")


def attend(kernel: AttentionKernel, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, *, window: int | None = None,
           softcap: float | None = None):  # fmt: skip
    """Causal attention of ``kernel``; each of the G key/value heads serves H // G query heads; with a
    ``window``, each position attends to the last ``window`` positions, itself included; with a
    ``softcap``, each score is ``softcap * tanh(score / softcap)`` (``xla`` and ``chunked`` only:
    :func:`resolve_attention` gives no other for it)."""
    length = q_BxLxHxK.shape[1]
    window = masking(window, length)
    check_takes(kernel, window, softcap)
    if kernel.name == "chunked" and kernel.chunk and kernel.chunk < length and length % kernel.chunk == 0:
        return chunked_causal_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, chunk=kernel.chunk, window=window,
                                        softcap=softcap)  # fmt: skip
    if kernel.name == "cudnn":
        # Its window counts the positions before the query: the query's own is the last of ours.
        local = None if window is None else (window - 1, 0)
        fn = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn",
                               local_window_size=local)  # fmt: skip
        return _per_shard(fn, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
    if kernel.name == "pallas":
        kernel.check_window(window, length)  # Runs causally over the whole sequence only as a stand-in.
        return _pallas_attention(kernel, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
    return causal_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, window=window, softcap=softcap)


def _per_shard(fn, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK):
    """Runs a fused kernel on each device's batch and heads: XLA cannot partition a custom call, and
    without this it would gather the whole batch onto every device."""
    active = _rules.active()
    if active is None:
        return fn(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
    mesh, rules = active
    q_spec = rules.spec(("batch", None, "heads", None))
    kv_spec = rules.spec(("batch", None, "kv_heads", None))
    if q_spec[2:3] != kv_spec[2:3]:  # Heads and KV heads split differently: split the batch only.
        q_spec = kv_spec = P(*rules.spec(("batch",)), None, None, None)
    sharded = _rules.shard_map(fn, mesh, (q_spec, kv_spec, kv_spec), q_spec)
    return sharded(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)


def _pallas_attention(attention: AttentionKernel, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK):
    """JAX's Pallas flash kernels on each device's heads, reading grouped key/value heads as they are
    (:mod:`shardmem.models.grouped_flash`), as cuDNN does: no copy of the keys and values per query head."""
    length, k = q_BxLxHxK.shape[1], q_BxLxHxK.shape[3]
    fn = functools.partial(grouped_flash.causal_attention, interpret=attention.interpret,
                           blocks=attention.flash_blocks(k, length, q_BxLxHxK.dtype.itemsize))  # fmt: skip
    return _per_shard(fn, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)


def causal_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, q_offset=0, *, q_positions=None, k_positions=None,
                     window: int | None = None, softcap: float | None = None):  # fmt: skip
    """Causal softmax attention with fp32 scores (kernel ``xla``). Query i sits at position
    ``q_offset + i`` of the keys, or at ``q_positions[i]`` against keys at ``k_positions`` when given
    (a permuted sequence: :mod:`shardmem.parallel.context`; ``q_positions`` ``[B, L]``: each sequence's
    own, as a KV cache's decode has them); with a ``window`` (static, or traced: a layer's own), it
    attends to keys fewer than ``window`` positions before it; with a ``softcap``, its scores are
    ``softcap * tanh(score / softcap)``."""
    b, length, h, k = q_BxLxHxK.shape
    g, keys = k_BxLxGxK.shape[2], k_BxLxGxK.shape[1]
    q_BxLxGxRxK = q_BxLxHxK.reshape(b, length, g, h // g, k) * (k**-0.5)
    scores_BxGxRxLxM = jnp.einsum("blgrk,bmgk->bgrlm", q_BxLxGxRxK, k_BxLxGxK).astype(jnp.float32)
    scores_BxGxRxLxM = soft_cap(scores_BxGxRxLxM, softcap)
    if q_positions is None:
        rows_LxM = q_offset + jax.lax.broadcasted_iota(jnp.int32, (length, keys), 0)
        cols_LxM = jax.lax.broadcasted_iota(jnp.int32, (length, keys), 1)
    else:
        rows_LxM, cols_LxM = jnp.asarray(q_positions)[..., :, None], jnp.asarray(k_positions)[None, :]
    causal_LxM = rows_LxM >= cols_LxM
    if window is not None:
        causal_LxM = causal_LxM & (rows_LxM - cols_LxM < window)
    if causal_LxM.ndim == 3:  # Per sequence: [B, L, M] under the G and R axes of the scores.
        causal_LxM = causal_LxM[:, None, None]
    scores_BxGxRxLxM = jnp.where(causal_LxM, scores_BxGxRxLxM, -1e30)
    probs_BxGxRxLxM = jax.nn.softmax(scores_BxGxRxLxM, axis=-1).astype(v_BxLxGxK.dtype)
    ctx_BxLxGxRxK = jnp.einsum("bgrlm,bmgk->blgrk", probs_BxGxRxLxM, v_BxLxGxK)
    return ctx_BxLxGxRxK.reshape(b, length, h, k)


def soft_cap(x, cap: float | None):
    """``cap * tanh(x / cap)`` in ``x``'s dtype: Gemma 2's caps of its attention scores and its logits
    (``model.attention_softcap``, ``model.logit_softcap``); ``x`` as it is when ``cap`` is None."""
    if cap is None:
        return x
    return (jnp.tanh(x / cap) * cap).astype(x.dtype)


def chunked_causal_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, *, chunk: int, window: int | None = None,
                             softcap: float | None = None):  # fmt: skip
    """The same attention, one block of ``chunk`` queries at a time, each block rematerialized in the
    backward pass: score memory falls from L x L to chunk x L per head, for one extra QK/PV product
    (memory-efficient attention, Rabe & Staats 2021); with a ``window``, to chunk x (chunk + window - 1):
    each block scores only the keys its window reaches."""
    b, length, h, k = q_BxLxHxK.shape
    blocks = length // chunk
    q_NxBxCxHxK = q_BxLxHxK.reshape(b, blocks, chunk, h, k).swapaxes(0, 1)
    # Keys one block can see; a traced window's (one of a layer's own) are all of them.
    reach = min(length, chunk + window - 1) if isinstance(window, int) else length

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def block(args):
        q_BxCxHxK, index = args
        if reach == length:
            return causal_attention(q_BxCxHxK, k_BxLxGxK, v_BxLxGxK, q_offset=index * chunk, window=window,
                                    softcap=softcap)  # fmt: skip
        first = jnp.maximum(index * chunk + chunk - reach, 0)  # The block's keys end with its last query.
        k_BxMxGxK, v_BxMxGxK = (
            jax.lax.dynamic_slice_in_dim(x, first, reach, axis=1) for x in (k_BxLxGxK, v_BxLxGxK)
        )
        q_positions_C = index * chunk + jnp.arange(chunk)
        return causal_attention(q_BxCxHxK, k_BxMxGxK, v_BxMxGxK, q_positions=q_positions_C,
                                k_positions=first + jnp.arange(reach), window=window,
                                softcap=softcap)  # fmt: skip

    ctx_NxBxCxHxK = jax.lax.map(block, (q_NxBxCxHxK, jnp.arange(blocks)))
    return ctx_NxBxCxHxK.swapaxes(0, 1).reshape(b, length, h, k)
