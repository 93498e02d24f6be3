import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardmem.config import config_from_dict
from shardmem.errors import ConfigError
from shardmem.parallel.mesh import build_mesh
from shardmem.program import build_program


def _config(optimizer=None, memory=None, axes=None):
    return config_from_dict({
        "model": {"preset": "tiny", "n_layers": 1, "seq_len": 32},
        "mesh": {"axes": axes or {"data": 2, "fsdp": 4}},
        "precision": {"params": "float32", "compute": "float32"},
        "optimizer": {"name": "adamw", "warmup_steps": 0, "learning_rate": 1e-2, **(optimizer or {})},
        "train": {"global_batch": 8, "steps": 10},
        "memory": {"target": "cpu", **(memory or {})},
    })  # fmt: skip


def _train(config, steps=2):
    program = build_program(config, build_mesh(config.mesh.axes, jax.devices()))
    state, losses = program.init(), []
    for step in range(steps):
        tokens = jax.random.randint(jax.random.key(step), program.abstract_batch.shape, 0, 256, jnp.int32)
        state, metrics = program.step(state, jax.device_put(tokens, program.batch_sharding))
        losses.append(float(metrics["loss"]))
    return losses, state, program


@pytest.fixture(scope="module")
def plain():
    return _train(_config())


def test_zero1_shards_moments_over_data_and_trains_the_same(plain):
    losses, state, program = _train(_config({"shard_over_data": True}))
    np.testing.assert_allclose(losses, plain[0], rtol=1e-5)
    wq = program.abstract_state["params"]["layers"]["wq"]
    mu = program.abstract_state["opt_state"][1][0].mu["layers"]["wq"]
    assert "data" not in str(wq.sharding.spec) and "data" in str(mu.sharding.spec)
    assert np.prod(mu.sharding.shard_shape(mu.shape)) * 2 == np.prod(wq.sharding.shard_shape(wq.shape))
    assert state["opt_state"][1][0].mu["layers"]["wq"].sharding == mu.sharding


def test_offloaded_optimizer_state_lives_on_the_host_and_trains_the_same(plain):
    losses, state, _ = _train(_config(memory={"offload_optimizer": True}))
    np.testing.assert_allclose(losses, plain[0], rtol=1e-5)
    assert state["opt_state"][1][0].nu["layers"]["w_up"].sharding.memory_kind == "pinned_host"
    assert state["params"]["layers"]["w_up"].sharding.memory_kind != "pinned_host"


def test_bf16_first_moment(plain):
    losses, state, _ = _train(_config({"mu_dtype": "bfloat16"}))
    assert state["opt_state"][1][0].mu["layers"]["wq"].dtype == jnp.bfloat16
    assert state["opt_state"][1][0].nu["layers"]["wq"].dtype == jnp.float32
    np.testing.assert_allclose(losses, plain[0], rtol=1e-2)


@pytest.mark.slow
def test_report_rows_show_each_saving():
    from shardmem.planning.memory import plan

    def rows(**kw):
        report = plan(_config(**kw), count_remat_overhead=False)
        return report.per_device["optimizer"], report.per_device["host"], report.cross_check["matches"]

    optimizer, host, matches = rows()
    assert host == 0 and matches
    zero1 = rows(optimizer={"shard_over_data": True})
    assert zero1[0] < 0.6 * optimizer and zero1[2]
    offloaded = rows(memory={"offload_optimizer": True})
    assert offloaded[0] < 100 and offloaded[1] >= optimizer - 100 and offloaded[2]  # Only the step counter.
    narrow = rows(optimizer={"mu_dtype": "bfloat16"})
    assert narrow[0] < 0.8 * optimizer


def test_deviceless_offload_and_bad_dtypes_are_config_errors():
    from shardmem.planning.memory import plan

    with pytest.raises(
        ConfigError, match=r"memory.offload_optimizer=true: .* no pinned_host memory.*--target local"
    ):
        plan(_config(memory={"offload_optimizer": True, "target": "h100-sxm"}))
    with pytest.raises(ConfigError, match=r"optimizer.mu_dtype='bf16': use float32, bfloat16 or float16"):
        _config({"mu_dtype": "bf16"})


def test_dynamic_loss_scaling_skips_overflow_halves_and_grows():
    import optax

    from shardmem.program.optimizer import LossScaleState, dynamic_loss_scaling, loss_scale

    tx = dynamic_loss_scaling(optax.sgd(1.0), initial=8.0, growth_interval=2)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    assert loss_scale(state) == 8.0 and loss_scale(optax.sgd(1.0).init(params)) is None
    updates, state = tx.update({"w": jnp.array([1.0, 2.0])}, state, params)
    np.testing.assert_array_equal(updates["w"], [-1.0, -2.0])
    assert (float(state.scale), int(state.good_steps), int(state.skipped_steps)) == (8.0, 1, 0)
    inner = state.inner
    updates, state = tx.update({"w": jnp.array([1.0, jnp.inf])}, state, params)  # Overflow: skipped.
    np.testing.assert_array_equal(updates["w"], [0.0, 0.0])
    assert (float(state.scale), int(state.good_steps), int(state.skipped_steps)) == (4.0, 0, 1)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), state.inner, inner))
    for _ in range(2):  # Two finite steps in a row double it.
        _, state = tx.update({"w": jnp.ones(2)}, state, params)
    assert isinstance(state, LossScaleState) and (float(state.scale), int(state.good_steps)) == (8.0, 0)
    for _ in range(5):  # Never below 1.
        _, state = tx.update({"w": jnp.full(2, jnp.nan)}, state, params)
    assert (float(state.scale), int(state.skipped_steps)) == (1.0, 6)


def test_float16_scales_the_loss_by_default_and_bad_settings_are_config_errors():
    assert _config().precision.loss_scaling is False
    fp16 = config_from_dict({"model": {"preset": "tiny"}, "precision": {"compute": "float16"}})
    assert fp16.precision.loss_scaling
    assert not fp16.replace("precision.loss_scale=none").precision.loss_scaling
    assert _config().replace("precision.loss_scale=dynamic").precision.loss_scaling
    message = r"precision.loss_scale='dynamc' \(did you mean 'dynamic'\?\): use auto"
    with pytest.raises(ConfigError, match=message):
        _config().replace("precision.loss_scale=dynamc")


def test_float16_without_a_loss_scale_is_a_plan_warning():
    from shardmem.planning.memory import _optimizer_warnings

    fp16 = _config().replace("precision.compute=float16")
    assert _optimizer_warnings(fp16) == []
    (warning,) = _optimizer_warnings(fp16.replace("precision.loss_scale=none"))
    assert warning.startswith("precision.compute=float16 with precision.loss_scale=none: ")
    assert "flushes small gradients to zero" in warning
    assert warning.endswith("set precision.loss_scale=auto (a dynamic loss scale)")
