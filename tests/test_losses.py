import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from shardmem.config import config_from_dict
from shardmem.errors import ConfigError
from shardmem.models.llama import Llama, ModelConfig
from shardmem.models.losses import chunked_cross_entropy, next_token_loss, resolve_loss_chunk


@pytest.mark.newest
def test_chunked_cross_entropy_matches_the_whole_loss_and_its_gradients():
    keys = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(keys[0], (2, 64, 16))
    head = jax.random.normal(keys[1], (16, 300))
    targets = jax.random.randint(keys[2], (2, 64), 0, 300)

    def whole(hidden, head):
        return optax.softmax_cross_entropy_with_integer_labels(hidden @ head, targets).mean()

    def chunked(hidden, head):
        return chunked_cross_entropy(hidden, head, targets, chunk=16)

    assert chunked(hidden, head) == pytest.approx(float(whole(hidden, head)), rel=1e-6)
    for a, b in zip(
        jax.grad(chunked, (0, 1))(hidden, head), jax.grad(whole, (0, 1))(hidden, head), strict=True
    ):
        assert jnp.allclose(a, b, atol=1e-6)


def test_reference_model_loss_is_the_same_chunked_or_not():
    cfg = ModelConfig.preset("tiny")
    batch = jax.random.randint(jax.random.key(1), (2, 65), 0, cfg.vocab_size)
    values = {}
    for loss_chunk in (None, 16):
        with nnx.use_eager_sharding(False):
            model = Llama(ModelConfig(**{**cfg.__dict__, "loss_chunk": loss_chunk}), rngs=nnx.Rngs(0),
                          compute_dtype=jnp.float32)  # fmt: skip
        assert model.loss_chunk == loss_chunk
        values[loss_chunk] = float(next_token_loss(model, batch))
    assert values[16] == pytest.approx(values[None], rel=1e-6)


def test_sharded_chunked_training_matches_one_device_unchunked():
    """Over data x fsdp x tensor (the tied head's vocabulary sharded over tensor, its width over fsdp),
    the chunked loss's own backward pass trains exactly as the whole loss does on one device: 258
    entries in 7 chunks of 37, one of them a padded, masked entry. (The untied head's math is the test
    above; its sharding is the same rules.)"""
    import numpy as np

    from shardmem.parallel.mesh import build_mesh
    from shardmem.program import build_program

    def run(axes, loss_chunk, devices):
        config = config_from_dict({
            "model": {"preset": "tiny", "n_layers": 1, "vocab_size": 258,
                      "tie_embeddings": True, "loss_chunk": loss_chunk},
            "mesh": {"axes": axes}, "precision": {"params": "float32", "compute": "float32"},
            "optimizer": {"name": "sgd", "warmup_steps": 0, "learning_rate": 0.5},
            "train": {"global_batch": 8},
        })  # fmt: skip
        program = build_program(config, build_mesh(config.mesh.axes, devices))
        state, losses = program.init(), []
        for step in range(2):
            tokens = jax.random.randint(jax.random.key(step), program.abstract_batch.shape, 0, 258)
            state, metrics = program.step(state, jax.device_put(tokens, program.batch_sharding))
            losses.append(float(metrics["loss"]))
        return losses, jax.device_get(state["params"])

    losses, params = run({"data": 2, "fsdp": 2, "tensor": 2}, 40, jax.devices())
    want_losses, want_params = run({"data": 1}, None, jax.devices()[:1])
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params, want_params)


def test_auto_chunks_large_vocabularies_only():
    assert resolve_loss_chunk("auto", vocab_size=128256, d_model=2048) == 8192
    assert resolve_loss_chunk("auto", vocab_size=256, d_model=64) is None
    assert resolve_loss_chunk(0, vocab_size=128256, d_model=2048) is None
    assert resolve_loss_chunk(None, vocab_size=128256, d_model=2048) is None
    assert resolve_loss_chunk(256, vocab_size=256, d_model=64) == 256


@pytest.mark.parametrize("value, message", [("big", "model.loss_chunk='big': use auto"),
                                            (-4, "model.loss_chunk=-4: use auto")])  # fmt: skip
def test_bad_loss_chunks_are_config_errors(value, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"model": {"preset": "tiny", "loss_chunk": value}})


@pytest.mark.newest
def test_chunked_loss_lowers_the_planned_temporaries():
    """On a CPU plan of a small model with a large vocabulary, the whole fp32 logits disappear from the
    temporaries (B x L x V x 4 bytes per device = 2 x 256 x 8192 x 4 = 16 MiB) ."""
    from shardmem.planning.memory import plan

    temps = {}
    for loss_chunk in (None, 1024):
        config = config_from_dict({
            "model": {"preset": "tiny", "n_layers": 1, "seq_len": 256, "vocab_size": 8192,
                      "loss_chunk": loss_chunk},
            "mesh": {"axes": {"data": 8}}, "train": {"global_batch": 16}, "memory": {"target": "cpu"},
        })  # fmt: skip
        temps[loss_chunk] = plan(config, count_remat_overhead=False).per_device["temp"]
    assert temps[None] - temps[1024] >= 2 * 256 * 8192 * 4


def test_soft_capped_logits_give_the_chunked_loss_and_gradients_of_the_whole_one():
    # Gemma 2's final cap (model.logit_softcap): the chunked loss's hand-written backward takes its slope.
    keys = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(keys[0], (2, 64, 16)) * 3
    head = jax.random.normal(keys[1], (16, 300))
    targets = jax.random.randint(keys[2], (2, 64), 0, 300)

    def whole(hidden, head):
        logits = jnp.tanh((hidden @ head) / 5.0) * 5.0
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def chunked(hidden, head):  # 300 entries in chunks of 16: padded with entries the cap must skip.
        return chunked_cross_entropy(hidden, head, targets, chunk=16, softcap=5.0)

    assert chunked(hidden, head) == pytest.approx(float(whole(hidden, head)), rel=1e-6)
    assert float(chunked_cross_entropy(hidden, head, targets, chunk=16)) > float(whole(hidden, head)) + 1
    for a, b in zip(
        jax.grad(chunked, (0, 1))(hidden, head), jax.grad(whole, (0, 1))(hidden, head), strict=True
    ):
        assert jnp.allclose(a, b, atol=1e-6)
