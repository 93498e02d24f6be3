"""Tests for shardmem.models.moe and expert parallelism: routing and capacity by hand, causality, the
load-balancing gradient, remat, expert-sharded training against one device, the all-to-all in the plan,
checkpoints across expert meshes, and a user's own MoE module."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from strategies import assert_same_training, planned_and_trained, train_steps, trained

from shardmem.config import config_from_dict, load_config
from shardmem.errors import ConfigError
from shardmem.models.llama import PRESETS, Llama, ModelConfig
from shardmem.models.moe import MoEFeedForward, _top_k, expert_capacity, route
from shardmem.parallel.mesh import build_mesh
from shardmem.planning.memory import plan
from shardmem.program import build_program
from shardmem.remat import LayerPlan

TINY_MOE = ModelConfig.preset("tiny-moe")
ROOT = Path(__file__).resolve().parents[1]


def test_mixtral_preset_has_mixtrals_parameter_count():
    assert PRESETS["mixtral-8x7b"].param_count() == 46_702_792_704  # Mixtral-8x7B


@pytest.mark.parametrize("name", ["mixtral-8x7b", "tiny-moe"])
def test_built_moe_model_has_the_analytic_parameter_count(name):
    cfg = PRESETS[name]
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.param_count()
    specs = nnx.to_pure_dict(nnx.get_partition_spec(params))
    assert specs["layers"]["moe"]["w_up"] == P("layers", "expert", "embed", "mlp")
    assert "w_up" not in specs["layers"], "an MoE layer has no dense MLP"


def test_capacity_is_the_balanced_share_times_the_factor_within_the_group():
    assert expert_capacity(4096, 8, 2, 1.25) == 1280  # Mixtral at seq 4096
    assert expert_capacity(64, 8, 2, 1.0) == 16
    assert expert_capacity(10, 8, 1, 0.01) == 1 and expert_capacity(10, 2, 2, 4.0) == 10


@pytest.mark.newest
def test_top_k_matches_lax_top_k():
    x = jax.random.normal(jax.random.key(0), (3, 5, 8))
    for k in (1, 2, 3):
        values, indices = _top_k(x, k)
        want_values, want_indices = jax.lax.top_k(x, k)
        np.testing.assert_array_equal(indices, want_indices)
        np.testing.assert_array_equal(values, want_values)


def test_route_fills_slots_in_token_order_and_drops_past_capacity():
    # 4 tokens, 3 experts, top-1, capacity 2: tokens 0, 1 and 3 pick expert 0, token 2 picks expert 2.
    logits = jnp.array([[[5.0, 0, 0], [4.0, 0, 1], [0, 1, 3.0], [2.0, 1, 0]]])
    combine, dispatch, balance = route(logits, experts_per_token=1, capacity=2)
    assert combine.shape == dispatch.shape == (1, 4, 3, 2)
    slots = {(s, e, c) for _, s, e, c in zip(*np.nonzero(np.asarray(dispatch)), strict=True)}
    assert slots == {(0, 0, 0), (1, 0, 1), (2, 2, 0)}, "token 3 is the third for expert 0: dropped"
    np.testing.assert_allclose(combine, dispatch)  # top-1: the renormalised gate is 1
    # Switch balance loss: E * sum_e f_e p_e, with f = (3/4 dispatched to e0, 0, 1/4 to e2).
    probs = jax.nn.softmax(logits[0], axis=-1).mean(0)
    np.testing.assert_allclose(balance, 3 * (0.75 * probs[0] + 0.25 * probs[2]), rtol=1e-6)


def test_route_top2_gates_are_the_softmax_of_the_chosen_logits():
    logits = jax.random.normal(jax.random.key(1), (2, 16, 8))
    combine, dispatch, _ = route(logits, experts_per_token=2, capacity=16)  # Capacity for all: no drops.
    np.testing.assert_allclose(dispatch.sum((2, 3)), 2.0)
    np.testing.assert_allclose(combine.sum((2, 3)), 1.0, rtol=1e-6)
    top, _ = jax.lax.top_k(logits, 2)
    np.testing.assert_allclose(combine.max((2, 3)), jax.nn.softmax(top, axis=-1)[..., 0], rtol=1e-6)
    assert dispatch.sum(1).max() == 1.0, "a slot of a group holds one token"


def test_moe_layer_is_causal_even_when_tokens_are_dropped():
    with nnx.use_eager_sharding(False):
        moe = MoEFeedForward(16, 32, 4, rngs=nnx.Rngs(0), capacity_factor=0.5, compute_dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(1), (2, 32, 16))
    changed = x.at[:, 10:].set(jax.random.normal(jax.random.key(2), (2, 22, 16)))
    a, b = jax.jit(lambda x: moe.forward(x)[0])(jnp.concatenate([x, changed])).reshape(2, 2, 32, 16)
    np.testing.assert_allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not jnp.allclose(a[:, 10:], b[:, 10:], atol=1e-3)
    # 4 experts x 8 slots hold 32 of the 64 assignments: the earliest tokens', the last ones get none.
    assert not jnp.any(a[:, -8:]) and jnp.all(jnp.any(a[:, :8], axis=-1))


def test_load_balancing_loss_enters_the_gradients_with_its_weight():
    x = jax.random.normal(jax.random.key(2), (2, 16, 32))
    weight = 0.5
    with nnx.use_eager_sharding(False):
        moe = MoEFeedForward(32, 48, 4, rngs=nnx.Rngs(0), load_balance_weight=weight,
                             compute_dtype=jnp.float32)  # fmt: skip

    def attached(m):
        return (m(x) ** 2).sum()

    def explicit(m):
        out, balance = m.forward(x)
        return (out**2).sum() + weight * balance

    grads = nnx.jit(
        lambda m: [nnx.grad(f)(m) for f in (attached, explicit, lambda m: (m.forward(x)[0] ** 2).sum())]
    )
    got, want, plain = (g.router[...] for g in grads(moe))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert not np.allclose(got, plain, atol=1e-6), "the balancing loss moves the router"
    assert float(attached(moe)) == float((moe.forward(x)[0] ** 2).sum()), "the forward value is unchanged"


def _grads(policy: str):
    cfg = dataclasses.replace(TINY_MOE, n_layers=2, seq_len=32)
    with nnx.use_eager_sharding(False):
        model = Llama(cfg, rngs=nnx.Rngs(0), remat=LayerPlan.uniform(2, policy), compute_dtype=jnp.float32)
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (2, cfg.seq_len), 0, cfg.vocab_size)
    loss = lambda p: -jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, p)(tokens))[..., 0])  # noqa: E731
    return jax.jit(jax.grad(loss))(params)


@pytest.mark.slow
def test_remat_policies_give_the_moe_gradients_of_no_remat():
    reference = _grads("none")
    for policy in ("full", "minimal", "offload"):  # The experts' projections carry the MLP's tags.
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                     _grads(policy), reference)  # fmt: skip


def test_expert_settings_are_validated():
    with pytest.raises(ConfigError, match=r"model.experts_per_token=9: .*between 1 and model.n_experts=8"):
        config_from_dict({"model": {"preset": "tiny-moe", "experts_per_token": 9}})
    with pytest.raises(ConfigError, match=r"model.capacity_factor=0.0: must be positive.*4 \(n_experts"):
        config_from_dict({"model": {"preset": "tiny-moe", "capacity_factor": 0}})
    with pytest.raises(ConfigError, match=r"model.n_experts=-1: use 0 for a dense MLP"):
        config_from_dict({"model": {"preset": "tiny", "n_experts": -1}})
    with pytest.raises(ConfigError, match=r"model.load_balance_weight=-0.1: must not be negative"):
        config_from_dict({"model": {"preset": "tiny-moe", "load_balance_weight": -0.1}})
    config = config_from_dict({"model": {"preset": "tiny-moe", "n_experts": 6},
                               "mesh": {"axes": {"data": 2, "expert": 4}}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"layers/moe/w_\w+: expert has size 6, which mesh.axes.expert=4 "
                       r"does not divide.*among \[1, 2, 3, 6\]"):  # fmt: skip
        build_program(config, build_mesh(config.mesh.axes, jax.devices()))


# --- Expert parallelism on 8 simulated devices ---------------------------------------------------


def _config(axes, **model):
    return config_from_dict({
        "model": {"preset": "tiny-moe", "n_layers": 2, **model},
        "mesh": {"axes": axes},
        "remat": {"policy": "minimal"},
        "precision": {"params": "float32", "compute": "float32"},
        "optimizer": {"name": "sgd", "warmup_steps": 0, "learning_rate": 0.1},
        "train": {"global_batch": 8, "steps": 10},
    })  # fmt: skip


def _program(axes, devices):
    config = _config(axes)
    return build_program(config, build_mesh(config.mesh.axes, devices))


@pytest.fixture(scope="module")
def one_device():
    """expert=1 on one device: three steps from init."""
    program = _program({"data": 1, "expert": 1}, jax.devices()[:1])
    return trained(program)


@pytest.fixture(scope="module")
def expert_2():
    """{data: 4, expert: 2} on 8 devices, planned once; the plan's compiled step trains, as in
    ``shardmem train``. Returns the program, its report and step, and three steps from init."""
    program = _program({"data": 4, "expert": 2}, jax.devices())
    return planned_and_trained(program)


def test_expert_parallel_training_matches_one_device(expert_2, one_device):
    program, _, _, losses, state = expert_2
    w_up = program.abstract_state["params"]["layers"]["moe"]["w_up"]
    assert w_up.sharding.spec[1] == "expert" and w_up.sharding.shard_shape(w_up.shape)[1] == 4
    assert_same_training(losses, state["params"], one_device)


@pytest.mark.slow
def test_expert_fsdp_and_tensor_parallel_training_matches_one_device(one_device):
    program = _program({"fsdp": 2, "expert": 2, "tensor": 2}, jax.devices())
    losses, state = train_steps(program.step, program, program.init(), 3)
    assert_same_training(losses, state["params"], one_device)


@pytest.mark.slow
def test_the_plan_reports_the_all_to_all_of_the_dispatched_tokens(expert_2):
    program, report, _, _, _ = expert_2
    cfg = program.config.model
    capacity = expert_capacity(cfg.seq_len, cfg.n_experts, cfg.experts_per_token, cfg.capacity_factor)
    # Per layer and device, the local f32 tokens [experts, groups / 8, capacity, d_model] move five
    # times: dispatch and return in the forward pass, both transposed in the backward pass, and the
    # dispatch again where `minimal` remat recomputes it. No token or weight is gathered.
    dispatched = cfg.n_experts * (8 // 8) * capacity * cfg.d_model * 4
    assert report.collectives["all-to-all"] == cfg.n_layers * 5 * dispatched
    assert report.collectives["all-gather"] == 0


@pytest.mark.slow
def test_a_checkpoint_saved_with_expert_2_resumes_with_expert_1(
    resumes_with_one_device, expert_2, one_device
):
    resumes_with_one_device(expert_2, one_device[0], train_steps, path=("layers", "moe", "w_up"))


class UserMoE(nnx.Module):
    """A user's own top-1 mixture of experts: logical axes only, no shardmem code inside."""

    def __init__(self, rngs: nnx.Rngs, vocab=256, d=32, f=64, experts=8):
        init = nnx.initializers.lecun_normal()
        param = lambda shape, axes: nnx.Param(nnx.with_partitioning(init, axes)(rngs.params(), shape))  # noqa: E731
        self.embed = param((vocab, d), ("vocab", "embed"))
        self.router = param((d, experts), ("embed", None))
        self.w_in = param((experts, d, f), ("expert", "embed", "mlp"))
        self.w_out = param((experts, f, d), ("expert", "mlp", "embed"))
        self.head = param((d, vocab), ("embed", "vocab"))

    def __call__(self, tokens_BxL):
        x_BxLxD = self.embed[...][tokens_BxL]
        choice_BxLxE = jax.nn.one_hot(jnp.argmax(x_BxLxD @ self.router[...], -1), self.router.shape[1])
        h_BxLxExF = jax.nn.relu(jnp.einsum("bld,edf->blef", x_BxLxD, self.w_in[...]))
        y_BxLxD = jnp.einsum("blef,efd,ble->bld", h_BxLxExF, self.w_out[...], choice_BxLxE)
        return (x_BxLxD + y_BxLxD) @ self.head[...]


@pytest.mark.newest
def test_a_users_own_moe_module_plans_with_an_expert_axis():
    config = _config({"data": 2, "expert": 4})
    report = plan(config, "cpu", model_factory=UserMoE, count_remat_overhead=False)
    rows = {row.path: row for row in report.sharding}
    assert rows["w_in"].spec == P("expert") and rows["w_out"].spec == P("expert")
    experts = 2 * 8 * 32 * 64 * 4
    assert report.per_device["params"] == experts // 4 + (2 * 256 * 32 + 32 * 8) * 4
    assert not any("without logical axes" in w or "no rule" in w for w in report.warnings)


def test_the_sweep_table_shows_all_to_all_when_a_candidate_moves_tokens():
    import io

    from rich.console import Console

    from shardmem.explore.sweep import SweepRow, render_sweep

    def row(expert, moved):
        return SweepRow((f"mesh.axes.expert={expert}",), peak_bytes=2**30, budget_bytes=2**32, fits=True,
                        margin_bytes=3 * 2**30, flops_per_step=1e12, recompute_overhead=0.0, host_bytes=0,
                        collectives=moved)  # fmt: skip

    def table(rows):
        out = Console(file=io.StringIO(), width=160)
        out.print(render_sweep(rows))
        return out.file.getvalue()

    fsdp = row(1, {"all-gather": 173 * 2**30, "all-to-all": 0})
    expert = row(8, {"all-gather": 26 * 2**30, "all-to-all": 30 * 2**30})
    assert "all-to-all" not in table([fsdp])
    text = table([fsdp, expert])
    assert "all-to-all" in text and "30.00 GiB" in text and "173.00 GiB" in text


def test_an_expert_axis_left_out_of_the_batch_rule_is_a_warning():
    config = _config({"data": 2, "expert": 4}).replace("rules={batch: data}")
    report = plan(config, "cpu", model_factory=UserMoE, count_remat_overhead=False)
    assert (
        "rules.batch=['data'] leaves out mesh axis expert: its 4 devices repeat the same tokens"
        in " ".join(report.warnings)
    )


@pytest.mark.slow
def test_the_shipped_mixtral_config_plans_for_64_h100s_with_the_all_to_all_by_hand():
    config = load_config(ROOT / "configs" / "mixtral-8x7b.yaml", ["model.n_layers=2"])  # Depth is a scan.
    report = plan(config, count_remat_overhead=False)
    assert (report.target, report.devices, report.mesh) == (
        "h100-sxm",
        64,
        {"data": 1, "fsdp": 8, "expert": 8},
    )
    assert report.fits and not report.approximate
    cfg = config.model
    capacity = expert_capacity(cfg.seq_len, cfg.n_experts, cfg.experts_per_token, cfg.capacity_factor)
    groups_per_device = config.train.global_batch // 64
    dispatched = cfg.n_experts * groups_per_device * capacity * cfg.d_model * 2  # bf16 on the GPU
    # Full remat: dispatch and return forward, both again in the recomputation, both transposed.
    assert report.collectives["all-to-all"] == cfg.n_layers * 6 * dispatched
