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


@pytest.mark.parametrize("kernel", [AttentionKernel("chunked", chunk=16),
                                    AttentionKernel("pallas", interpret=True)])  # fmt: skip
def test_kernels_match_xla_in_bf16_with_grouped_query_heads(kernel):
    """Pallas runs in interpret mode on CPU: the same kernel code a GPU compiles, forward and backward."""
    q, k, v = _qkv(jnp.bfloat16)
    reference = attend(AttentionKernel("xla"), q, k, v).astype(jnp.float32)
    out = attend(kernel, q, k, v).astype(jnp.float32)
    assert jnp.abs(out - reference).max() < 0.05  # bf16 has 8 bits of mantissa: ~1% of values near 1.
    ours, theirs = _grads(lambda *a: attend(kernel, *a), q, k, v), _grads(causal_attention, q, k, v)
    for a, b in zip(ours, theirs, strict=True):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        assert jnp.abs(a - b).max() <= 0.05 * jnp.abs(b).max()


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
    from shardmem.step import build_program

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
    from shardmem.step import build_program

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
