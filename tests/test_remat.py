import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardmem.errors import ConfigError
from shardmem.models.llama import CHECKPOINT_TAGS, Llama, ModelConfig
from shardmem.remat import PRESETS, LayerPlan, ModulePlan, RematPolicy, remat_modules

CFG = ModelConfig.preset("tiny")


def _grads(plan: LayerPlan):
    with nnx.use_eager_sharding(False):
        model = Llama(CFG, rngs=nnx.Rngs(0), remat=plan, compute_dtype=jnp.float32)
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (2, CFG.seq_len + 1), 0, CFG.vocab_size)

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    return jax.jit(jax.grad(loss))(params)


@pytest.fixture(scope="module")
def reference_grads():
    return _grads(LayerPlan.uniform(CFG.n_layers, "none"))


# On the newest JAX too: the policy that offloads (memory kinds); below, every policy's lowering.
@pytest.mark.parametrize("name", [pytest.param(p, marks=[pytest.mark.newest] if p == "offload" else [])
                                  for p in PRESETS if p != "none"])  # fmt: skip
def test_every_policy_gives_the_gradients_of_no_remat(name, reference_grads):
    grads = _grads(LayerPlan.uniform(CFG.n_layers, name))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, reference_grads)


@pytest.mark.newest
def test_mixed_per_layer_plan_and_custom_policy_give_the_same_gradients(reference_grads):
    plan = LayerPlan.parse(
        {"policy": "full", "layers": {"1": "custom", "2-3": "dots"},
         "custom": {"query_proj": "save", "mlp_out": "offload"}},
        CFG.n_layers, tags=CHECKPOINT_TAGS,
    )  # fmt: skip
    segments = [(a, b, p.name) for a, b, p in plan.segments()]
    assert segments == [(0, 1, "full"), (1, 2, "custom"), (2, 4, "dots")]
    grads = _grads(plan)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, reference_grads)


@pytest.mark.newest
def test_policies_lower_to_jax_checkpoint_policies():
    assert PRESETS["none"].lower() is None
    assert PRESETS["full"].lower() is jax.checkpoint_policies.nothing_saveable
    assert PRESETS["dots"].lower() is jax.checkpoint_policies.dots_saveable
    assert callable(PRESETS["minimal"].lower()) and callable(PRESETS["offload"].lower())


def test_segments_group_consecutive_layers():
    plan = LayerPlan.parse({"policy": "minimal", "layers": {"0-7": "full", "30-31": "none"}}, 32)
    assert [(a, b, p.name) for a, b, p in plan.segments()] == [
        (0, 8, "full"), (8, 30, "minimal"), (30, 32, "none"),
    ]  # fmt: skip
    assert plan.describe() == "0-7: full, 8-29: minimal, 30-31: none"


@pytest.mark.newest
def test_remat_saves_less_and_recomputes_more():
    """Saved residuals shrink from none to full while recomputed matmuls grow."""
    from shardmem.planning.hlo import matmul_flops

    tokens = jnp.zeros((2, CFG.seq_len), jnp.int32)

    def jaxpr(name, differentiate=True):
        with nnx.use_eager_sharding(False):
            model = nnx.eval_shape(
                lambda: Llama(CFG, rngs=nnx.Rngs(0), remat=LayerPlan.uniform(CFG.n_layers, name))
            )
        graphdef, params = nnx.split(model)
        loss = lambda p: nnx.merge(graphdef, p)(tokens).sum()
        return jax.make_jaxpr(jax.grad(loss) if differentiate else loss)(params)

    flops = {name: matmul_flops(jaxpr(name)) for name in ("none", "minimal", "full")}
    assert flops["none"] < flops["minimal"] < flops["full"]
    # full recomputes the layers' forward matmuls except the MLP's down projection, whose output the
    # backward pass never reads (it only feeds the residual sum); the output head is outside the layers.
    head = 2 * tokens.size * CFG.d_model * CFG.vocab_size
    down = 2 * tokens.size * CFG.d_ff * CFG.d_model * CFG.n_layers
    forward = matmul_flops(jaxpr("none", differentiate=False))
    assert flops["full"] - flops["none"] == forward - head - down


def test_custom_policy_needs_tags_and_valid_actions():
    with pytest.raises(ConfigError, match="needs remat.custom"):
        RematPolicy.parse("custom", {})
    with pytest.raises(ConfigError, match="use save, offload or recompute"):
        RematPolicy.parse("custom", {"query_proj": "keep"}, tags=CHECKPOINT_TAGS)


def test_module_plan_matches_path_name_or_class_outermost_first():
    plan = ModulePlan.parse({"blocks_*": "full", "decoder/head": "dots", "Attention": "none"})
    assert plan.describe() == "modules blocks_*: full, decoder/head: dots, Attention: none"
    assert plan.match(("decoder", "blocks_3"), "Block") == ("blocks_*", PRESETS["full"])  # its name
    assert plan.match(("decoder", "head"), "Dense") == ("decoder/head", PRESETS["dots"])  # its path
    assert plan.match(("mlp",), "Attention")[0] == "Attention"  # its class
    assert plan.match((), "blocks_root") is None  # the root is the model, not one of its layers
    assert plan.match(("decoder", "head_2"), "Dense") is None
    with pytest.raises(ConfigError, match=r"blocks_0 \(Attention\) matches 'blocks_\*' and 'Attention'"):
        plan.match(("decoder", "blocks_0"), "Attention")
    with pytest.raises(ConfigError, match=r"remat.modules.x='fulll' is not a remat policy \(did you mean"):
        ModulePlan.parse({"x": "fulll"})
    assert not ModulePlan() and not ModulePlan.parse({})


@pytest.mark.newest
def test_remat_modules_wraps_matched_nnx_calls_and_keeps_the_gradients():
    class Inner(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, x, scale: float = 1.0):  # A Python argument stays static under nnx.remat.
            return jnp.tanh(self.linear(x)) * scale

    class Outer(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Inner(rngs) for _ in range(3)])

        def __call__(self, x):
            for block in self.blocks:
                x = block(x, scale=0.5)
            return (x**2).sum()

    def grads(model):
        graphdef, params = nnx.split(model)
        x = jnp.arange(16.0).reshape(2, 8) / 16
        loss = lambda params: nnx.merge(graphdef, params)(x)
        params = nnx.to_pure_dict(params)
        return jax.grad(loss)(params), jax.make_jaxpr(jax.grad(loss))(params)

    want, plain = grads(Outer(nnx.Rngs(0)))
    matched = set()
    plan = ModulePlan.parse({"blocks/*": "full", "linear": "dots"})
    model = remat_modules(Outer(nnx.Rngs(0)), plan, matched)
    assert matched == {"blocks/*"}  # blocks/0/linear is inside a wrapped block: not wrapped again.
    assert [type(b).__name__ for b in model.blocks] == ["Inner"] * 3 and isinstance(model.blocks[0], Inner)
    got, rematted = grads(model)
    assert "prevent_cse" not in str(plain) and str(rematted).count("prevent_cse=True") == 3  # one per block
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)
