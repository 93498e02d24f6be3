import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from shardmem.models.llama import PRESETS, Llama, ModelConfig

# On the newest JAX too (.ci/run): Flax NNX's modules and variables.
pytestmark = pytest.mark.newest


@pytest.mark.parametrize(
    "name, expected",
    [
        ("llama-7b", 6_738_415_616),  # Llama-2-7B
        ("llama-13b", 13_015_864_320),  # Llama-2-13B
        ("llama-70b", 68_976_648_192),  # Llama-2-70B, 8 KV heads
        ("llama-1b", 1_235_814_400),  # Llama-3.2-1B, tied embeddings
    ],
)
def test_presets_reproduce_published_parameter_counts(name, expected):
    assert PRESETS[name].param_count() == expected


@pytest.mark.parametrize("name", ["llama-7b", "llama-70b", "llama-1b", "gpt2-124m"])
def test_built_model_has_the_analytic_parameter_count(name):
    cfg = PRESETS[name]
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.param_count()


def test_every_parameter_has_logical_axes():
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: Llama(PRESETS["tiny"], rngs=nnx.Rngs(0)))
    specs = nnx.get_partition_spec(nnx.state(model))
    leaves = jax.tree.leaves(nnx.to_pure_dict(specs), is_leaf=lambda x: x is None or hasattr(x, "index"))
    shapes = jax.tree.leaves(nnx.to_pure_dict(nnx.state(model)))
    assert len(leaves) == len(shapes)
    for spec, shape in zip(leaves, shapes, strict=True):
        assert spec is not None and len(spec) == shape.ndim


def test_forward_is_causal():
    cfg = ModelConfig.preset("tiny")
    with nnx.use_eager_sharding(False):
        model = Llama(cfg, rngs=nnx.Rngs(0), compute_dtype=jnp.float32)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    changed = tokens.at[:, 10:].set((tokens[:, 10:] + 1) % cfg.vocab_size)
    a, b = model(tokens), model(changed)
    assert a.shape == (2, 16, cfg.vocab_size)
    assert jnp.allclose(a[:, :10], b[:, :10], atol=1e-5)
    assert not jnp.allclose(a[:, 10:], b[:, 10:], atol=1e-3)


def test_attention_chunk_must_divide_the_sequence():
    from shardmem.config import config_from_dict
    from shardmem.errors import ConfigError

    message = r"attention_chunk=48 must be a positive divisor of model.seq_len=64; use e.g. \[16, 32\]"
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"model": {"preset": "tiny", "attention_chunk": 48}})
