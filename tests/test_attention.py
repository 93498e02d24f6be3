import jax
import jax.numpy as jnp
import pytest

from shardmem.config import config_from_dict
from shardmem.errors import ConfigError
from shardmem.models.attention import (
    AttentionKernel,
    attend,
    causal_attention,
    chunked_causal_attention,
    resolve_attention,
)

# On the newest JAX too (.ci/run): the attention kernels (Pallas, cuDNN's, chunked) and their gradients.
pytestmark = pytest.mark.newest


def _qkv(dtype=jnp.float32, length=64, heads=4, kv_heads=2):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, length, heads, 16), dtype)
    k, v = (jax.random.normal(key, (2, length, kv_heads, 16), dtype) for key in keys[1:])
    return q, k, v


def _grads(fn, q, k, v):
    return jax.grad(lambda q, k, v: (fn(q, k, v).astype(jnp.float32) ** 2).sum(), argnums=(0, 1, 2))(q, k, v)


def test_chunked_attention_matches_full_attention_and_its_gradients():
    q, k, v = _qkv()
    full = causal_attention(q, k, v)
    assert jnp.allclose(chunked_causal_attention(q, k, v, chunk=16), full, atol=1e-5)
    chunked = _grads(lambda q, k, v: chunked_causal_attention(q, k, v, chunk=16), q, k, v)
    for a, b in zip(chunked, _grads(causal_attention, q, k, v), strict=True):
        assert jnp.allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("kernel", [
    AttentionKernel("chunked", chunk=16),
    AttentionKernel("pallas", interpret=True),
    # Tiles for 5 KiB of shared memory: blocks of 32 queries and 32 keys, two of each over 64 positions.
    pytest.param(AttentionKernel("pallas", interpret=True, shared_memory=5120), marks=pytest.mark.slow),
])  # fmt: skip
def test_kernels_match_xla_in_bf16_with_grouped_query_heads(kernel):
    """Pallas runs in interpret mode on CPU: the same kernel code a GPU compiles, forward and backward."""
    q, k, v = _qkv(jnp.bfloat16)
    if kernel.shared_memory:
        blocks = kernel.flash_blocks(16, 64, 2)
        assert (blocks.block_q, blocks.block_k) == (32, 32)
    reference = attend(AttentionKernel("xla"), q, k, v).astype(jnp.float32)
    out = attend(kernel, q, k, v).astype(jnp.float32)
    assert jnp.abs(out - reference).max() < 0.05  # bf16 has 8 bits of mantissa: ~1% of values near 1.
    ours, theirs = _grads(lambda *a: attend(kernel, *a), q, k, v), _grads(causal_attention, q, k, v)
    for a, b in zip(ours, theirs, strict=True):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        assert jnp.abs(a - b).max() <= 0.05 * jnp.abs(b).max()


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4)], ids=["grouped", "mha"])
def test_pallas_matches_xla_in_float32_forward_and_gradients(heads, kv_heads):
    q, k, v = _qkv(heads=heads, kv_heads=kv_heads)
    kernel = AttentionKernel("pallas", interpret=True)
    assert jnp.allclose(attend(kernel, q, k, v), causal_attention(q, k, v), atol=1e-5)
    ours, theirs = _grads(lambda *a: attend(kernel, *a), q, k, v), _grads(causal_attention, q, k, v)
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape and jnp.allclose(a, b, atol=1e-4)


def test_pallas_reads_grouped_keys_and_values_without_a_copy_per_query_head():
    """As cuDNN does: the kernels take the 2 key/value heads, and the backward pass keeps them, not 4
    copies (the saved residuals: queries, keys, values, output, log-sum-exp)."""
    from shardmem.planning.hlo import _sub_jaxprs

    q_BxLxHxK, k_BxLxGxK, v_BxLxGxK = _qkv(jnp.bfloat16, heads=4, kv_heads=2)
    kernel = AttentionKernel("pallas", interpret=True)
    _, backward = jax.vjp(lambda *a: attend(kernel, *a), q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
    saved = sorted(x.shape for x in jax.tree.leaves(backward))
    assert saved == [(2, 4, 64), (2, 64, 2, 16), (2, 64, 2, 16), (2, 64, 4, 16), (2, 64, 4, 16)]

    def kernels(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield eqn.params["name"], [x.aval.shape for x in eqn.invars]
            for sub in _sub_jaxprs(eqn.params):
                yield from kernels(getattr(sub, "jaxpr", sub))

    differentiated = jax.make_jaxpr(lambda *a: _grads(lambda *b: attend(kernel, *b), *a))
    called = dict(kernels(differentiated(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK).jaxpr))
    assert called["mha_forward"][1:3] == [(2, 64, 2, 16)] * 2
    assert called["mha_backward"][1:3] == [(2, 64, 2, 16)] * 2


@pytest.mark.parametrize(
    "requested, where, expected",
    [
        ("auto", "gpu", AttentionKernel("cudnn")),
        ("auto", "deviceless-gpu", AttentionKernel("pallas", stands_for="cudnn")),
        ("auto", "cpu", AttentionKernel("chunked", chunk=512)),
        ("cudnn", "deviceless-gpu", AttentionKernel("pallas", stands_for="cudnn")),
        ("pallas", "cpu", AttentionKernel("pallas", interpret=True)),
        ("chunked", "gpu", AttentionKernel("chunked", chunk=512)),
        ("xla", "deviceless-gpu", AttentionKernel("xla")),
    ],
)
def test_resolution_table(requested, where, expected):
    assert resolve_attention(requested, chunk=None, where=where) == expected


def test_auto_in_float32_is_chunked_and_cudnn_needs_16_bits():
    assert resolve_attention("auto", chunk=64, where="gpu", dtype="float32") == AttentionKernel("chunked", 64)
    with pytest.raises(
        ConfigError, match="model.attention=cudnn needs 16-bit inputs but precision.compute=float32"
    ):
        resolve_attention("cudnn", chunk=None, where="deviceless-gpu", dtype="float32")


def test_cudnn_on_cpu_and_unknown_kernels_are_config_errors():
    with pytest.raises(ConfigError, match="model.attention=cudnn needs an NVIDIA GPU"):
        resolve_attention("cudnn", chunk=None, where="cpu")
    with pytest.raises(ConfigError, match=r"model.attention='flash'.*use auto, cudnn, pallas, chunked"):
        config_from_dict({"model": {"preset": "tiny", "attention": "flash"}})


def test_stand_in_says_what_it_stands_for():
    text = AttentionKernel("pallas", stands_for="cudnn").describe()
    assert text.startswith("pallas, standing in for cudnn") and "same memory: no L x L" in text


def test_a_sequence_the_pallas_kernel_cannot_tile_is_a_config_error():
    # It was a ValueError traceback from inside the kernel (llama-7b-long with seq_len 32000).
    from shardmem.parallel.mesh import build_mesh
    from shardmem.program import build_program

    AttentionKernel("pallas", context=8).check_length(32768)  # 2 x 8 blocks of 2048.
    AttentionKernel("pallas").check_length(100)  # One block.
    message = r"seq_len=32000: the pallas .* 2 x 8 context blocks has 2000 .* 2048 \(e.g. 30720 or 32768\)"
    with pytest.raises(ConfigError, match=message):
        AttentionKernel("pallas", context=8).check_length(32000)
    config = config_from_dict({"model": {"preset": "tiny", "seq_len": 200, "attention": "pallas"}})
    with pytest.raises(ConfigError, match=r"model.seq_len=200: .* multiple of 128 \(e.g. 128 or 256\), or "
                       r"model.attention=chunked$"):  # fmt: skip
        build_program(config, build_mesh(config.mesh.axes, jax.devices()))


@pytest.mark.slow
def test_fused_kernel_runs_per_shard_in_the_sharded_step():
    """Pallas (interpret mode) inside shard_map over batch and heads gives the xla kernel's loss."""
    from shardmem.parallel.mesh import build_mesh
    from shardmem.program import build_program

    losses = {}
    for kernel in ("xla", "pallas"):
        config = config_from_dict({
            "model": {"preset": "tiny", "n_layers": 1, "seq_len": 32, "attention": kernel},
            "mesh": {"axes": {"fsdp": 4, "tensor": 2}},
            "train": {"global_batch": 8},
        })  # fmt: skip
        program = build_program(config, build_mesh(config.mesh.axes, jax.devices()[:8]))
        assert program.attention.name == kernel
        batch = jax.random.randint(jax.random.key(1), program.abstract_batch.shape, 0, 256, jnp.int32)
        _, metrics = program.step(program.init(), jax.device_put(batch, program.batch_sharding))
        losses[kernel] = float(metrics["loss"])
    assert losses["pallas"] == pytest.approx(losses["xla"], rel=2e-3)


# --- Every head size on every GPU target -----------------------------------------------------------

#: Head dims of published models (Llama and Mistral 128; GPT-2 and Falcon 64; Phi-2 80; Qwen 112;
#: GPT-J 256; Nemotron-4 340B 192; a 530B model 160).
HEAD_DIMS = (64, 80, 96, 112, 128, 160, 192, 256)


def _gpu_classes():
    """One GPU target per (compute capability, shared memory per block): what the flash kernel's
    compile depends on (Triton's shared-memory request on the architecture, XLA's limit on the opt-in
    figure); the targets alike in both compile alike. Every target of GPU_TARGETS is in one."""
    from shardmem.planning.targets import GPU_TARGETS

    classes = {}
    for name, spec in GPU_TARGETS.items():
        classes.setdefault((spec.compute_capability, spec.shared_memory_per_block_optin), name)
    fast = {"h100-sxm"}  # The case (Nemotron-4 340B); the others are slow.
    return [name if name in fast else pytest.param(name, marks=pytest.mark.slow) for name in classes.values()]


@pytest.mark.newest
@pytest.mark.parametrize("target_name", _gpu_classes())
def test_every_head_size_compiles_its_attention_deviceless_on_every_gpu_target(target_name):
    """The gradient of causal attention for every head dim, compiled deviceless as a plan compiles it:
    256-wide heads (160 and 192 padded to it) asked 320 KiB of shared memory per block on an H100 (227
    KiB) and 224 KiB on an A100 (163 KiB) with the kernel's default blocks."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardmem.models.attention import device_class, shared_memory_per_block
    from shardmem.planning import codegen
    from shardmem.planning.targets import resolve_target

    target = resolve_target(target_name, n_devices=1)
    kernel = resolve_attention("auto", chunk=None, where=device_class(target.devices),
                               shared_memory=shared_memory_per_block(target.devices))  # fmt: skip
    flash = target.spec.compute_capability >= (8, 0)
    assert kernel.name == ("pallas" if flash else "chunked")
    assert kernel.shared_memory == (target.spec.shared_memory_per_block_optin if flash else None)
    replicated = NamedSharding(Mesh(np.array(target.devices), ("x",)), P())
    shapes = [jax.ShapeDtypeStruct((1, 256, 1, d), jnp.bfloat16, sharding=replicated) for d in HEAD_DIMS]

    def loss(*qs):
        return sum(attend(kernel, q, q, q).astype(jnp.float32).sum() for q in qs)

    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(HEAD_DIMS)))))
    with jax.default_device(target.devices[0]):  # JAX 0.12's Triton lowering reads the default device.
        grads.lower(*shapes).compile(compiler_options=codegen.deviceless_options(target, {}))


@pytest.mark.parametrize("where, head_dim, window, expected", [
    ("gpu", 128, False, AttentionKernel("cudnn")),
    ("gpu", 256, False, AttentionKernel("pallas")),  # cuDNN takes up to 128 before Hopper.
    ("gpu", 12, False, AttentionKernel("pallas")),  # Not a multiple of 8.
    ("deviceless-gpu", 256, False, AttentionKernel("pallas")),  # What the GPU runs, not a stand-in.
    ("deviceless-gpu", 256, True, AttentionKernel("chunked", 512)),  # Pallas's has no window.
    ("deviceless-gpu", 320, False, AttentionKernel("chunked", 512)),
    ("deviceless-gpu", 128, True, AttentionKernel("pallas", stands_for="cudnn")),
])  # fmt: skip
def test_heads_cudnn_does_not_take_get_the_kernel_that_runs_them(where, head_dim, window, expected):
    options = dict(chunk=None, where=where, head_dim=head_dim, cudnn_heads=128, window=window)
    assert resolve_attention("auto", **options) == expected
    with pytest.raises(
        ConfigError,
        match=r"^model.attention=cudnn with heads of 12: cuDNN's flash attention "
        r"takes head dims that are multiples of 8, up to 128 on this GPU",
    ):
        resolve_attention("cudnn", chunk=None, where=where, head_dim=12, cudnn_heads=128)


def test_cudnns_widest_head_follows_the_gpus_compute_capability():
    from shardmem.models.attention import cudnn_max_head_dim
    from shardmem.planning.targets import resolve_target

    widest = {name: cudnn_max_head_dim(resolve_target(name, n_devices=1).devices)
              for name in ("a100-80g", "rtx-4090", "h100-sxm", "b200")}  # fmt: skip
    assert widest == {"a100-80g": 128, "rtx-4090": 128, "h100-sxm": 256, "b200": 256}
    assert cudnn_max_head_dim(jax.devices("cpu")) is None


@pytest.mark.parametrize(
    "shared_memory, head_dim, blocks",
    [
        (None, 256, (128, 128)),  # CPU, unknown GPUs: the kernel's defaults.
        (232448, 128, (128, 128)),  # H100, B200: 160 KiB.
        (232448, 192, (128, 64)),  # Padded to 256: 192 KiB.
        (166912, 256, (128, 32)),  # A100: 128 KiB.
        (101376, 128, (128, 64)),  # Ada and GA10x (L40S, RTX 4090, A10G): 96 KiB.
        (101376, 160, (64, 32)),  # 96 KiB.
    ],
)
def test_flash_blocks_are_the_widest_whose_tiles_fit_the_shared_memory(shared_memory, head_dim, blocks):
    sizes = AttentionKernel("pallas", shared_memory=shared_memory).flash_blocks(head_dim, 4096, 2)
    assert (sizes.block_q, sizes.block_k) == blocks
    assert (sizes.block_q_dkv, sizes.block_kv_dkv, sizes.block_q_dq, sizes.block_kv_dq) == (32, 32, 32, 32)


def test_a_head_wider_than_the_flash_kernels_take_is_a_config_error():
    from shardmem.parallel.mesh import build_mesh
    from shardmem.program import build_program

    AttentionKernel("chunked", chunk=64).check_head_dim(320)  # Any width.
    config = config_from_dict({"model": {"preset": "tiny", "head_dim": 320, "attention": "pallas"}})
    message = (r"^model.head_dim=320: the pallas flash kernel takes heads of at most 256 \(.*\); use a "
               r"head_dim of at most 256, or model.attention=chunked$")  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        build_program(config, build_mesh(config.mesh.axes, jax.devices()))


def test_a_plan_tiles_the_flash_kernel_for_its_target():
    """build_program resolves the kernel with the target's shared memory and SMs (the plan's wiring; the
    SMs are what a serving decode step's attention splits the cache to fill)."""
    from shardmem.parallel.mesh import build_mesh
    from shardmem.planning.targets import resolve_target
    from shardmem.program import build_program

    config = config_from_dict({"model": {"preset": "tiny", "n_layers": 1, "head_dim": 192},
                               "mesh": {"axes": {"data": 1, "fsdp": 1, "tensor": 1}},
                               "precision": {"compute": "bfloat16"}})  # fmt: skip
    devices = resolve_target("a100-80g", n_devices=1).devices
    program = build_program(config, build_mesh(config.mesh.axes, devices))
    # Heads of 192: wider than cuDNN takes before Hopper (128), so Pallas's kernel itself, not a stand-in.
    assert program.attention == AttentionKernel("pallas", shared_memory=166912, sms=108)
    devices = resolve_target("h100-sxm", n_devices=1).devices
    program = build_program(config, build_mesh(config.mesh.axes, devices))
    assert program.attention == AttentionKernel("pallas", stands_for="cudnn", shared_memory=232448, sms=132)


# --- A sliding window (model.sliding_window, Mistral's) ----------------------------------------------------


@pytest.mark.newest
@pytest.mark.parametrize("kernel", [AttentionKernel("xla"), AttentionKernel("chunked", chunk=16)])
def test_a_window_attends_as_jax_local_window_and_its_gradients(kernel):
    """The reference is jax.nn.dot_product_attention's own window (the argument cuDNN's kernel gets):
    (window - 1) positions before the query and the query itself, transformers' mask."""
    q, k, v = _qkv()
    window = 10

    def reference(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla",
                                            local_window_size=(window - 1, 0))  # fmt: skip

    out = attend(kernel, q, k, v, window=window)
    assert jnp.abs(out - reference(q, k, v)).max() < 1e-5
    assert jnp.abs(attend(kernel, q, k, v) - out).max() > 0.1  # The window changes the output.
    ours = _grads(lambda *a: attend(kernel, *a, window=window), q, k, v)
    for a, b in zip(ours, _grads(reference, q, k, v), strict=True):
        assert jnp.abs(a - b).max() < 1e-4


@pytest.mark.parametrize("kernel", [AttentionKernel("xla"), AttentionKernel("chunked", chunk=16)])
def test_soft_capped_scores_attend_as_gemma_2_caps_them_and_their_gradients(kernel):
    """Gemma 2's cap (model.attention_softcap) on the scaled scores, before the mask: cap * tanh(s / cap)."""
    q, k, v = _qkv()
    q = q * 4  # Scores well past the cap.

    def reference(q, k, v):
        scores = jnp.einsum("blhk,bmhk->bhlm", q, jnp.repeat(k, 2, axis=2)) / 4.0
        scores = jnp.tanh(scores / 2.0) * 2.0
        causal = jnp.tril(jnp.ones((64, 64), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        return jnp.einsum("bhlm,bmhk->blhk", probs, jnp.repeat(v, 2, axis=2))

    out = attend(kernel, q, k, v, softcap=2.0)
    assert jnp.abs(out - reference(q, k, v)).max() < 1e-5
    assert jnp.abs(attend(kernel, q, k, v) - out).max() > 0.1  # The cap changes the output.
    ours = _grads(lambda *a: attend(kernel, *a, softcap=2.0), q, k, v)
    for a, b in zip(ours, _grads(reference, q, k, v), strict=True):
        assert jnp.abs(a - b).max() < 1e-4


@pytest.mark.parametrize("where", ["gpu", "deviceless-gpu", "cpu", "tpu"])
def test_soft_capped_scores_resolve_auto_to_chunked_and_refuse_the_flash_kernels(where):
    assert resolve_attention("auto", chunk=None, where=where, softcap=True).name == "chunked"
    for requested in ("cudnn", "pallas"):
        with pytest.raises(ConfigError, match=f"model.attention={requested} with model.attention_softcap"):
            resolve_attention(requested, chunk=None, where=where, softcap=True)
    with pytest.raises(ValueError, match="no soft-capped scores"):
        attend(AttentionKernel("pallas", interpret=True), *_qkv(), softcap=2.0)


@pytest.mark.newest
def test_pallas_has_no_window_but_stands_in_for_cudnn_with_one():
    q, k, v = _qkv()
    with pytest.raises(ConfigError, match="JAX's Pallas flash kernel has no sliding window"):
        attend(AttentionKernel("pallas", interpret=True), q, k, v, window=10)
    attend(AttentionKernel("pallas", interpret=True), q, k, v, window=64)  # A window as long masks nothing.
    stand_in = resolve_attention("auto", chunk=None, where="deviceless-gpu")
    stand_in.check_window(10, 64)  # A deviceless plan's: it never runs.
    assert "sliding window of 10 not in the stand-in" in stand_in.describe(window=10)
    # With a context axis the flash kernel would be Pallas's: auto is chunked instead.
    assert resolve_attention("auto", chunk=None, where="gpu", context=2, window=True).name == "chunked"


def test_a_window_shrinks_the_planned_scores_of_chunked_attention():
    import shardmem

    def peak(window):
        config = config_from_dict({"model": {"preset": "tiny", "n_layers": 1, "seq_len": 1024,
                                             "attention": "chunked", "attention_chunk": 128,
                                             "sliding_window": window},
                                   "mesh": {"axes": {"data": 8}}, "train": {"global_batch": 8}})  # fmt: skip
        report = shardmem.plan(config, "cpu", count_remat_overhead=False)
        return report.per_device["peak"], report.attention

    (full, _), (windowed, said) = peak(None), peak(128)
    # Each 128-query block scores 128 + 127 keys rather than 1,024: fp32 scores of 4 heads, a quarter.
    assert windowed < full - 3 * 4 * 128 * (1024 - 255) * 4 // 2
    assert said == "chunked (blocks of 128 queries); sliding window of 128"


def test_a_plan_says_a_window_on_some_layers_is_each_layers_own_and_charges_the_whole_sequence():
    import shardmem

    model = {"preset": "tiny", "n_layers": 2, "seq_len": 1024, "attention_chunk": 128, "sliding_window": 128,
             "sliding_layers": [0]}  # fmt: skip
    config = config_from_dict({"model": model, "mesh": {"axes": {"data": 8}}, "train": {"global_batch": 8}})
    report = shardmem.plan(config, "cpu", count_remat_overhead=False)
    said = "sliding window of 128 on 1 of the 2 layers, each layer's own (keys masked, not skipped)"
    assert report.attention == f"chunked (blocks of 128 queries); {said}"
