"""Fine-tuning: frozen parameters, LoRA adapters and a quantized base (shardmem.finetune)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from rich.console import Console

import shardmem
from shardmem import ConfigError, build_mesh, build_program, config_from_dict
from shardmem.finetune import Adapted, project, quantize, weight
from shardmem.models.llama import Llama, ModelConfig

TARGETS = ["layers/wq", "layers/wk", "layers/wv", "layers/wo"]


def _config(finetune, axes=None, **train):
    return config_from_dict({
        "model": {"preset": "tiny"}, "mesh": {"axes": axes or {"fsdp": 8}},
        "precision": {"compute": "float32"},
        "optimizer": {"name": "sgd", "learning_rate": 0.5, "warmup_steps": 0, "grad_clip": None},
        "train": {"global_batch": 8, "steps": 10, **train}, "finetune": finetune,
    })  # fmt: skip


def _tokens(program, seed=0):
    tokens = np.random.default_rng(seed).integers(0, 256, (8, 65), dtype=np.int32)
    return jax.device_put(tokens, program.batch_sharding)


@pytest.fixture(scope="module")
def lora_program():
    config = _config({"lora": {"rank": 4, "alpha": 8, "targets": ["layers/wq", "layers/wo"]},
                      "base_dtype": "float32"})  # fmt: skip
    return build_program(config, build_mesh(config.mesh.axes, jax.devices()))


@pytest.mark.newest
def test_a_lora_step_matches_a_hand_written_one(lora_program):
    program = lora_program
    state = program.init()
    # B starts at zero (the adapted model is the base one); make it non-zero so A gets gradients too.
    for name in ("wq", "wo"):
        b = state["params"]["layers"][name]["lora_b"]
        noise = 0.05 * jax.random.normal(jax.random.key(1), b.shape, b.dtype)
        state["params"]["layers"][name]["lora_b"] = jax.device_put(noise, b.sharding)
    assert set(state["params"]) == {"layers"} and set(state["params"]["layers"]) == {"wq", "wo"}
    frozen = jax.tree.map(np.asarray, state["frozen"])
    adapters = jax.tree.map(np.asarray, state["params"])
    tokens = _tokens(program)

    cfg = ModelConfig.preset("tiny")
    with nnx.use_eager_sharding(False):
        graphdef, _ = nnx.split(
            nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), compute_dtype=jnp.float32))
        )

    def hand_loss(adapters):  # W + alpha / rank x A B, by hand, in the plain reference model.
        params = jax.tree.map(jnp.asarray, frozen)
        layers = dict(params["layers"])
        a, b = adapters["layers"]["wq"]["lora_a"], adapters["layers"]["wq"]["lora_b"]
        layers["wq"] = layers["wq"] + 2.0 * jnp.einsum("ldr,lrhk->ldhk", a, b)
        a, b = adapters["layers"]["wo"]["lora_a"], adapters["layers"]["wo"]["lora_b"]
        layers["wo"] = layers["wo"] + 2.0 * jnp.einsum("lhkr,lrd->lhkd", a, b)
        model = nnx.merge(graphdef, {**params, "layers": layers})
        logits = model(jnp.asarray(tokens)[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(tokens)[:, 1:]).mean()

    loss, grads = jax.value_and_grad(hand_loss)(adapters)
    lr = optax.warmup_cosine_decay_schedule(0.0, 0.5, 0, 10, 0.05)(0)
    expected = jax.tree.map(lambda p, g: p - lr * g, adapters, grads)

    new, metrics = program.step(state, tokens)
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(new["params"]), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-6)
    for got, want in zip(jax.tree.leaves(new["frozen"]), jax.tree.leaves(frozen), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)  # The base never moves.


def test_the_plan_counts_adapters_exactly_and_gives_frozen_weights_no_optimizer_state():
    d, h, kv, k, layers, rank = 64, 4, 2, 16, 4, 4
    config = _config(
        {"lora": {"rank": rank, "targets": TARGETS}, "base_dtype": "bfloat16"}, axes={"data": 8}
    ).replace("optimizer.name=adamw")
    report = shardmem.plan(config, target="cpu", count_remat_overhead=False)
    per_target = [(d, h * k), (d, kv * k), (d, kv * k), (h * k, d)]
    trainable = layers * sum(rank * (d_in + d_out) for d_in, d_out in per_target) * 4
    assert report.per_device["params"] == trainable == 28672
    assert report.per_device["frozen"] == ModelConfig.preset("tiny").param_count() * 2  # bf16 base
    assert 0 <= report.per_device["optimizer"] - 2 * trainable <= 16  # Adam's moments + counters only.
    assert report.cross_check["matches"]
    console = Console(record=True, width=120)
    console.print(shardmem.render(report))
    assert "frozen parameters" in console.export_text()


@pytest.mark.newest
@pytest.mark.parametrize("fmt, group", [("int8", 64), ("int4", 16), ("nf4", 64)])
def test_a_quantized_base_is_planned_to_the_byte(fmt, group):
    config = _config({"freeze": ["layers/*", "embedding"], "quantize": {"format": fmt, "group": group,
                      "targets": ["layers/w*"]}, "base_dtype": "bfloat16"}, axes={"data": 8})  # fmt: skip
    report = shardmem.plan(config, target="cpu", count_remat_overhead=False)
    cfg = ModelConfig.preset("tiny")
    matrices = [(64, 4, 16), (64, 2, 16), (64, 2, 16), (4, 16, 64), (64, 192), (64, 192), (192, 64)]
    code_bytes = 1 if fmt == "int8" else 0.5
    quantized = sum(math.prod(s) * code_bytes + math.prod(s) // min(group, s[-1]) * 4 for s in matrices)
    frozen = 4 * quantized + 4 * 2 * 64 * 2 + cfg.vocab_size * 64 * 2  # + norms and embedding in bf16
    assert report.per_device["frozen"] == frozen
    assert report.per_device["params"] == (64 + 64 * 256) * 4  # The final norm and lm_head train.


@pytest.mark.parametrize("fmt, levels", [("int8", 127), ("int4", 7)])
def test_quantization_error_is_within_half_a_level(fmt, levels):
    w = jax.random.normal(jax.random.key(0), (3, 8, 128))
    q = quantize(w, fmt, 32)
    scale = np.abs(np.asarray(w).reshape(3, 8, 4, 32)).max(-1, keepdims=True) / levels
    error = np.abs(np.asarray(q.dequantize(jnp.float32)) - np.asarray(w)).reshape(3, 8, 4, 32)
    assert (error <= scale / 2 + 1e-6).all()
    assert q.codes.shape == ((3, 8, 128) if fmt == "int8" else (3, 8, 64)) and q.scales.shape == (3, 8, 4)


def test_nf4_dequantizes_its_own_levels_exactly():
    from shardmem.finetune.quant import NF4_LEVELS

    w = jnp.asarray(np.tile(NF4_LEVELS, (2, 4)) * 3.0)  # Every level, block maximum 3.
    np.testing.assert_allclose(np.asarray(quantize(w, "nf4", 16).dequantize(jnp.float32)), np.asarray(w),
                               rtol=1e-6)  # fmt: skip


def test_project_equals_the_materialized_adapted_weight():
    keys = jax.random.split(jax.random.key(0), 4)
    base = jax.random.normal(keys[0], (4, 16, 8))
    value = Adapted(quantize(base, "nf4", 8), jax.random.normal(keys[1], (4, 16, 3)),
                    jax.random.normal(keys[2], (3, 8)), scale=0.5, input_dims=2)  # fmt: skip
    x = jax.random.normal(keys[3], (2, 5, 4, 16))
    want = jnp.einsum("blhk,hkd->bld", x, weight(value, jnp.float32))
    np.testing.assert_allclose(np.asarray(project("blhk,hkd->bld", x, value, jnp.float32)), np.asarray(want),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("key, finetune, words", [
    ("finetune.freeze", {"freeze": ["layers/wqq"]}, ["'layers/wqq' matches no parameter", "layers/wq"]),
    ("finetune.lora.targets", {"lora": {"targets": ["layers/attn_norm/scale"]}}, ["not a matrix"]),
    ("finetune.quantize.targets", {"freeze": ["layers/*"], "quantize": {"targets": ["lm_head"]}},
     ["'lm_head' matches no parameter of those", "layers/w"]),
    ("finetune.quantize.group", {"freeze": ["layers/*"], "quantize": {"group": 40}}, ["does not divide"]),
    ("finetune.freeze", {"freeze": ["*"]}, ["nothing to train"]),
    ("finetune.lora.rank=1000", {"lora": {"rank": 1000, "targets": ["layers/wq"]}},
     ["larger than layers/wq's smaller side (64, of its [4, 64, 4, 16])", "use a rank of at most 64"]),
    ("mesh.axes.stage=2", {"lora": {"targets": ["layers/wq"]}}, ["set mesh.axes.stage=1"]),
])  # fmt: skip
def test_bad_patterns_are_one_line_config_errors(key, finetune, words):
    stage = "stage" in key  # A pipeline of 2 stages over 2 micro-batches.
    config = _config(
        finetune, axes={"stage": 2, "fsdp": 4} if stage else None, micro_batches=2 if stage else 1
    )
    with pytest.raises(ConfigError) as error:
        build_program(config, build_mesh(config.mesh.axes, jax.devices()))
    message = str(error.value)
    assert key in message and "\n" not in message
    for word in words:
        assert word in message


@pytest.mark.parametrize("section, message", [
    ({"lora": {"rank": 0, "targets": ["x"]}}, "finetune.lora.rank"),
    ({"lora": {"targets": []}}, "finetune.lora.targets is empty"),
    ({"freeze": ["*"], "quantize": {"format": "nf3"}}, "did you mean 'nf4'"),
    ({"quantize": {}}, "nothing is frozen"),
    ({"lora": {"targets": ["x"], "ranks": 2}}, "unknown key 'finetune.lora.ranks'"),
])  # fmt: skip
def test_finetune_values_are_checked_when_the_config_loads(section, message):
    with pytest.raises(ConfigError, match=message):
        _config(section)


@pytest.mark.newest
def test_lora_on_a_users_nnx_and_linen_models_trains_only_the_adapters():
    import flax.linen as nn

    from shardmem.models.linen import from_linen

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
            self.up = nnx.Linear(8, 32, kernel_init=kernel, rngs=rngs)
            self.down = nnx.Linear(32, 4, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.relu(self.up(x)))

    class LinenMlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(jax.nn.relu(nn.Dense(32)(x)))

    def loss_fn(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    batch_spec = {"x": {"shape": ["global_batch", 8], "dtype": "float32", "axes": ["batch", None]},
                  "y": {"shape": ["global_batch"], "dtype": "int32", "axes": ["batch"]}}  # fmt: skip
    x = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)

    def linen(rngs):
        return from_linen(LinenMlp(), jnp.zeros((1, 8)), rngs=rngs)

    for factory, target in [(Mlp, "up/kernel"), (linen, "Dense_0/kernel")]:
        config = config_from_dict({"mesh": {"axes": {"data": 8}}, "train": {"global_batch": 16},
                                   "optimizer": {"warmup_steps": 0},
                                   "finetune": {"lora": {"rank": 2, "targets": [target]}}})  # fmt: skip
        program = build_program(config, build_mesh(config.mesh.axes, jax.devices()), model_factory=factory,
                                loss_fn=loss_fn, batch=batch_spec)  # fmt: skip
        state = program.init()
        leaves = {"/".join(str(getattr(k, "key", k)) for k in p) for p, _ in
                  jax.tree_util.tree_leaves_with_path(state["params"])}  # fmt: skip
        assert leaves == {f"{target}/lora_a", f"{target}/lora_b"}
        # Linen names Dense(4), made first, Dense_0: its kernel is 32 x 4.
        assert state["params"]["up" if factory is Mlp else "Dense_0"]["kernel"]["lora_a"].shape == (
            (8, 2) if factory is Mlp else (32, 2)
        )
        batch = {
            "x": jax.device_put(x, program.batch_sharding["x"]),
            "y": jax.device_put((x[:, 0] > 0).astype(np.int32), program.batch_sharding["y"]),
        }
        first = jax.tree.map(np.asarray, state["params"])
        for _ in range(3):
            state, metrics = program.step(state, batch)
        assert math.isfinite(float(metrics["loss"]))
        b_before = jax.tree.leaves(first)[1]
        assert not np.allclose(np.asarray(jax.tree.leaves(state["params"])[1]), b_before)  # B moved.


@pytest.mark.newest
def test_adapters_and_codes_carry_their_matrix_logical_axes(lora_program):
    rows = {row.path: row for row in lora_program.sharding_table()}
    assert rows["layers/wq/lora_a"].logical == ("layers", "embed", None)
    assert rows["layers/wq/lora_b"].logical == ("layers", None, "heads", "head_dim")
    assert rows["layers/wo/lora_a"].logical == ("layers", "heads", "head_dim", None)
    assert rows["layers/wq"].logical == ("layers", "embed", "heads", "head_dim")  # The frozen base.
    assert rows["layers/wq/lora_a"].spec == P(None, "fsdp", None)  # Sharded like the matrix's inputs.


def test_micro_batches_accumulate_the_adapters_gradients_as_one_batch(lora_program):
    config = lora_program.config.replace("train.global_batch=16")
    whole = build_program(config, lora_program.mesh)
    accumulating = build_program(config.replace("train.micro_batches=2"), lora_program.mesh)
    state = whole.init()
    b = state["params"]["layers"]["wq"]["lora_b"]
    state["params"]["layers"]["wq"]["lora_b"] = jax.device_put(jnp.full(b.shape, 0.01, b.dtype), b.sharding)
    tokens = np.random.default_rng(3).integers(0, 256, (16, 65), dtype=np.int32)
    tokens = jax.device_put(tokens, whole.batch_sharding)
    one, metrics = whole.step(jax.tree.map(lambda x: x.copy(), state), tokens)
    two, metrics_two = accumulating.step(state, tokens)
    np.testing.assert_allclose(float(metrics_two["loss"]), float(metrics["loss"]), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(two["params"]), jax.tree.leaves(one["params"]), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
