"""Models, losses and batches of your own: the examples (NNX ViT, Linen decoder, NNX MoE) plan and
train from their YAML; NNX variables beyond parameters are carried, not trained; remat reaches user
layers or says why not; config lint for user code."""

from __future__ import annotations

import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import third_party
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from rich.console import Console
from strategies import trained

import shardmem
from shardmem.config import config_from_dict, load_config
from shardmem.errors import ConfigError, PlanError
from shardmem.parallel.mesh import build_mesh
from shardmem.planning import codegen, hlo, memory, overlap
from shardmem.program import build_program
from shardmem.run.training import train

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
QUIET = Console(quiet=True)


def _analytic_param_count(name: str, options: dict) -> int:
    """Parameter counts worked from each example's architecture, not from the traced model."""
    o = options
    if name == "vit":
        w, m, p = o["width"], o["mlp"], o["patch"]
        tokens = (o["image"] // p) ** 2 + 1
        block = 2 * 2 * w + (4 * w * w + 4 * w) + (w * m + m + m * w + w)
        return (
            p * p * 3 * w + w + w + tokens * w + o["depth"] * block + 2 * w + w * o["classes"] + o["classes"]
        )
    if name == "linen_decoder":
        d, f = o["d_model"], o["d_ff"]
        block = 2 * d + 3 * d * d + d * d + 2 * d * f
        return o["vocab"] * d + o["n_layers"] * block + d
    if name == "moe":
        w, e, f = o["width"], o["experts"], o["hidden"]
        block = 2 * w + 3 * w * w + w * w + w * e + 2 * e * w * f
        return o["vocab"] * w + o["depth"] * block + w
    raise AssertionError(name)


def _per_device_bytes(program) -> int:
    """Parameter bytes per device from shapes and the mesh axes each spec names."""
    total = 0
    for leaf in jax.tree.leaves(program.abstract_state["params"]):
        spec, mesh = leaf.sharding.spec, program.mesh
        shards = math.prod(mesh.shape[a] for e in spec if e for a in ((e,) if isinstance(e, str) else e))
        total += math.prod(leaf.shape) * leaf.dtype.itemsize // shards
    return total


@pytest.mark.slow
@pytest.mark.parametrize("example", ["vit", "linen_decoder", "moe"])
def test_example_plans_for_h100_and_trains_on_cpu(example, tmp_path):
    config = load_config(EXAMPLES / f"{example}.yaml", ["train.steps=3", "train.log_every=1"])
    result = train(config, tmp_path / "run", console=QUIET)
    assert result.status == "finished" and result.final_step == 3
    assert all(math.isfinite(r["loss"]) for r in result.history)
    report = result.report
    params = report.sharding
    assert sum(math.prod(r.shape) for r in params) == _analytic_param_count(example, config.model.options)
    program = build_program(config, build_mesh(config.mesh.axes, jax.devices()))
    assert report.per_device["params"] == _per_device_bytes(program)
    # AdamW's mu and nu, its step count and the schedule's (int32), and the train step counter.
    assert report.per_device["optimizer"] == 2 * report.per_device["params"] + 3 * 4
    assert report.cross_check["matches"]
    assert report.remat == config.remat_plan().describe() and report.recompute_overhead > 0
    assert not any("keeps the tags" in w or "not applied" in w for w in report.warnings), report.warnings

    if example == "vit":  # Its dropout streams are model state: checkpointed, and restored on resume.
        resumed = train(config.replace("train.steps=4"), tmp_path / "run", console=QUIET)
        assert resumed.start_step == 3 and resumed.final_step == 4
        assert int(jax.tree.leaves(resumed.state["model_state"])[0].max()) > 0

    gpu = shardmem.plan(config, target="h100-sxm", count_remat_overhead=False)
    assert gpu.fits and gpu.per_device["params"] == report.per_device["params"]


class WithState(nnx.Module):
    """Batch statistics and a dropout RNG stream beside the parameters."""

    def __init__(self, rngs):
        kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        self.lin = nnx.Linear(8, 16, kernel_init=kernel, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jax.nn.relu(self.bn(self.lin(x)))))


def _classify(model, batch):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}


BATCH = {"x": {"shape": ["global_batch", 8], "dtype": "float32", "axes": ["batch", None]},
         "y": {"shape": ["global_batch"], "dtype": "int32", "axes": ["batch"]}}  # fmt: skip


def _batch(program, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    return {"x": jax.device_put(x, program.batch_sharding["x"]),
            "y": jax.device_put((x[:, 0] > 0).astype(np.int32), program.batch_sharding["y"])}  # fmt: skip


@pytest.mark.newest
def test_nnx_variables_beyond_params_are_carried_not_trained():
    # No model section: the model, loss and batch all come from Python.
    train_section = {"global_batch": 16, "micro_batches": 2}
    config = config_from_dict({"mesh": {"axes": {"data": 8}}, "train": train_section})
    program = build_program(config, build_mesh(config.mesh.axes, jax.devices()), model_factory=WithState,
                            loss_fn=_classify, batch=BATCH)  # fmt: skip
    state = program.init()
    assert set(state["model_state"]) == {"bn", "drop"}
    assert set(state["params"]["bn"]) == {"scale", "bias"}  # Statistics are no parameters ...
    assert "mean" not in str(jax.tree.structure(state["opt_state"]))  # ... and have no moments.
    mean_before = np.asarray(state["model_state"]["bn"]["mean"])
    count_before = int(state["model_state"]["drop"]["rngs"]["count"])
    new, metrics = program.step(state, _batch(program))
    assert set(metrics) == {"loss", "grad_norm", "accuracy"} and math.isfinite(float(metrics["loss"]))
    assert not np.allclose(np.asarray(new["model_state"]["bn"]["mean"]), mean_before)
    assert int(new["model_state"]["drop"]["rngs"]["count"]) == count_before + 2  # one per micro-batch
    assert new["model_state"]["drop"]["rngs"]["key"].dtype == jnp.uint32  # stored as raw key data
    report, _ = memory.plan_program(program, memory.make_target(config, "cpu"))
    assert report.per_device["model_state"] == 2 * 16 * 4 + 4 + 8
    assert report.cross_check["matches"]


class Stack(nnx.Module):
    """Three stacked layers run by shardmem.remat_scan with the plan it is given; each tags ``my_proj``."""

    def __init__(self, rngs, remat):
        self.remat = remat

        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def layers(rngs):
            return Layer(rngs)

        self.layers = layers(rngs)

    def __call__(self, x):
        return shardmem.remat_scan(self.layers, x, self.remat).sum()


class Layer(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (16, 16)))

    def __call__(self, x):
        return jnp.tanh(checkpoint_name(x @ self.w[...], "my_proj"))


def _stack_loss(model, x):
    return model(x)


STACK_BATCH = {"shape": ["global_batch", 16], "dtype": "float32"}


@pytest.mark.newest
def test_user_remat_plan_reaches_layers_and_unmatched_tags_warn():
    batch, loss = STACK_BATCH, _stack_loss

    def planned(**remat):
        config = config_from_dict({"mesh": {"axes": {"data": 8}}, "train": {"global_batch": 8},
                                   "remat": remat})  # fmt: skip
        return shardmem.plan(config, model_factory=Stack, loss_fn=loss, batch=batch)

    silent = planned(policy="minimal")  # minimal's default tags are the reference model's.
    assert any("keeps the tags query_proj" in w and "my_proj" in w for w in silent.warnings)
    tagged = planned(policy="minimal", tags=["my_proj"])
    assert not any("keeps the tags" in w for w in tagged.warnings)
    full = planned(policy="full")
    # Saving the tagged projection leaves no matmul to recompute; saving nothing recomputes it.
    assert tagged.remat == "every layer: minimal" and tagged.recompute_overhead == 0
    assert full.remat == "every layer: full" and full.recompute_overhead > 0

    def fixed(rngs):  # Remats nothing itself, and takes no plan.
        return Stack(rngs, shardmem.LayerPlan.uniform(3))

    config = config_from_dict({"mesh": {"axes": {"data": 8}}, "train": {"global_batch": 8},
                               "remat": {"policy": "full"}})  # fmt: skip
    report = shardmem.plan(config, model_factory=fixed, loss_fn=loss, batch=batch)
    assert report.remat == "the model's own"
    assert any("remat.policy='full' is not applied" in w for w in report.warnings)


def test_model_passed_in_code_gets_its_tags_whatever_the_yaml_model_section():
    # The YAML still names a preset (e.g. for seq_len), the model comes from Python: remat.tags are its.
    sections = {"model": {"preset": "tiny"}, "mesh": {"axes": {"data": 8}}, "train": {"global_batch": 8}}
    tagged = config_from_dict({**sections, "remat": {"policy": "minimal", "tags": ["my_proj"]}})
    report = shardmem.plan(tagged, model_factory=Stack, loss_fn=_stack_loss, batch=STACK_BATCH)
    assert not any("keeps the tags" in w for w in report.warnings)
    assert report.remat == "every layer: minimal" and report.recompute_overhead == 0  # my_proj is saved.
    no_section = config_from_dict({k: v for k, v in tagged.to_dict().items() if k != "model"})
    alone = shardmem.plan(no_section, model_factory=Stack, loss_fn=_stack_loss, batch=STACK_BATCH)
    assert report.per_device["temp"] == alone.per_device["temp"]
    custom = tagged.replace("remat.policy=custom", "remat.custom={my_proj: save}")  # Loads: tags are mine.
    assert shardmem.plan(custom, model_factory=Stack, loss_fn=_stack_loss, batch=STACK_BATCH).fits
    # A preset's depth does not bind a code model of another depth unless remat.layers needs one.
    assert config_from_dict(sections).remat_plan(user_model=True).any_depth
    # The reference model has its own tags: remat.tags beside it would be dropped, so they are an error.
    with pytest.raises(ConfigError, match=r"remat.tags=\['my_proj'\] lists the checkpoint_name tags of"):
        build_program(tagged, build_mesh(tagged.mesh.axes, jax.devices()))


@pytest.mark.newest
def test_deviceless_compile_failure_retries_without_triton_gemm(monkeypatch):
    calls = []
    real = memory._compile

    def flaky(traced, options, dump):
        calls.append(dict(options))
        if memory.TRITON_GEMM not in options:
            raise RuntimeError("INTERNAL: Couldn't find output tile sizes that satisfy hlo: %dot")
        return real(traced, options, dump)

    monkeypatch.setattr(memory, "_compile", flaky)
    config = config_from_dict({"model": {"preset": "tiny", "n_layers": 1}, "mesh": {"axes": {"fsdp": 8}}})
    report = shardmem.plan(config, target="h100-sxm", count_remat_overhead=False)
    cheap = {*codegen.UNOPTIMIZED, codegen.CUDA_DIR}  # Both compiles generate their kernels cheaply.
    assert all(cheap <= set(options) for options in calls)
    overlapped = overlap.gpu_options()  # Both compile with train's overlap options.
    assert [{k: v for k, v in c.items() if k not in cheap} for c in calls] == [
        overlapped,
        {**overlapped, memory.TRITON_GEMM: False},
    ]
    assert report.compiler_options == {**overlapped, memory.TRITON_GEMM: False}
    assert any("planned with xla_gpu_enable_triton_gemm=false" in w for w in report.warnings)

    monkeypatch.setattr(memory, "_compile", lambda *a: (_ for _ in ()).throw(RuntimeError("INTERNAL: no")))
    with pytest.raises(PlanError, match="INTERNAL: no. This is a compiler failure, not a memory verdict"):
        shardmem.plan(config, target="h100-sxm")


def test_a_machine_without_ptxas_is_told_how_to_get_it_after_one_compile(monkeypatch):
    calls = []

    def no_ptxas(*args):  # What XLA 0.10 says where neither ptxas nor nvJitLink is found.
        calls.append(args)
        raise RuntimeError(
            "UNAVAILABLE: No PTX compilation provider is available. Neither ptxas/nvlink nor nvjtlink is "
            "available. As a fallback you can enable JIT compilation in the CUDA driver via the flag "
            "`--xla_gpu_unsafe_fallback_to_driver_on_ptxas_not_found`."
        )

    monkeypatch.setattr(memory, "_compile", no_ptxas)
    config = config_from_dict({"model": {"preset": "tiny", "n_layers": 1}, "mesh": {"axes": {"fsdp": 8}}})
    with pytest.raises(PlanError, match=r"found no ptxas .* `pip install nvidia-cuda-nvcc-cu12`"):
        shardmem.plan(config, target="h100-sxm", count_remat_overhead=False)
    assert len(calls) == 1, "neither the kernel cache nor Triton GEMMs are to blame: no second compile"
    mine = {"xla_gpu_cuda_data_dir": "/opt/cuda-without-ptxas"}  # The user's folder, not the stand-in.
    with pytest.raises(PlanError, match=r"in memory.compiler_options.xla_gpu_cuda_data_dir='/opt/cuda-wi.*"
                                        r"or remove the option"):  # fmt: skip
        shardmem.plan(config, target="h100-sxm", count_remat_overhead=False, compiler_options=mine)


def test_user_code_and_batch_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"param_rules.'\(\[': not a valid regular expression"):
        config_from_dict({"model": {"preset": "tiny"}, "param_rules": {"([": [None]}})
    with pytest.raises(ConfigError, match="model.factory='vit.build': give an import path"):
        config_from_dict({"model": {"factory": "vit.build"}})
    with pytest.raises(ConfigError, match=r"data.batch.x.axes=\['batch'\]: give one logical name"):
        config_from_dict({"data": {"batch": {"x": {"shape": ["global_batch", 3], "axes": ["batch"]}}}})
    with pytest.raises(ConfigError, match="data.batch.x.shape: 'gb' is neither"):
        config_from_dict({"data": {"batch": {"x": {"shape": ["gb", 3]}}}})
    with pytest.raises(ConfigError, match="remat.layers=.* set model.n_layers"):
        config_from_dict({"model": {"factory": "a:b"}, "remat": {"layers": {"0": "full"}}})

    (tmp_path / "mine.py").write_text("def build(rngs):\n    return None\n")
    (tmp_path / "run.yaml").write_text(
        "model: {factory: mine:biuld}\ndata: {batch: {shape: [global_batch, 2]}}\n"
    )
    config = load_config(tmp_path / "run.yaml")  # mine.py is found beside the YAML file
    mesh = build_mesh({"data": 8}, jax.devices())
    with pytest.raises(ConfigError, match="mine has no 'biuld' \\(did you mean 'build'\\?\\)"):
        build_program(config, mesh)
    with pytest.raises(ConfigError, match="no module 'nowhere'"):
        build_program(config.replace("model.factory=nowhere:build"), mesh)
    with pytest.raises(ConfigError, match="train.loss is not set"):
        build_program(config.replace("model.factory=mine:build"), mesh, model_factory=WithState)
    with pytest.raises(ConfigError, match="returned a NoneType, not a Flax NNX module"):
        build_program(config.replace("model.factory=mine:build"), mesh, loss_fn=_classify)


def test_unused_param_rules_and_conv_flops():
    rules = {"lin/kernel$": [None, None], "nothing_here": [None]}
    sections = {"mesh": {"axes": {"data": 8}}, "train": {"global_batch": 16}, "param_rules": rules}
    config = config_from_dict(sections)
    report = shardmem.plan(config, model_factory=WithState, loss_fn=_classify, batch=BATCH)
    assert any("param_rules that match no parameter: 'nothing_here'" in w for w in report.warnings)

    def conv(x, k):
        return jax.lax.conv_general_dilated(x, k, (2, 2), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    jaxpr = jax.make_jaxpr(conv)(jnp.ones((2, 8, 8, 3)), jnp.ones((2, 2, 3, 5)))
    assert hlo.matmul_flops(jaxpr) == 2 * (2 * 4 * 4 * 5) * (2 * 2 * 3)


@pytest.mark.newest
def test_linen_batch_statistics_update_and_are_not_trained():
    import flax.linen as nn

    from shardmem.models.linen import from_linen

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            x = nn.BatchNorm(use_running_average=False)(nn.Dense(16, kernel_init=init)(x))
            return nn.Dense(4)(nn.Dropout(0.5, deterministic=False)(x))

    config = config_from_dict({"mesh": {"axes": {"data": 8}}, "train": {"global_batch": 16}})
    program = build_program(config, build_mesh(config.mesh.axes, jax.devices()),
                            model_factory=lambda rngs: from_linen(Net(), jnp.zeros((1, 8)), rngs=rngs),
                            loss_fn=_classify, batch=BATCH)  # fmt: skip
    state = program.init()
    assert set(state["model_state"]["BatchNorm_0"]) == {"mean", "var"}
    assert set(state["params"]["BatchNorm_0"]) == {"scale", "bias"}
    rows = {row.path: row for row in program.sharding_table()}
    assert rows["Dense_0/kernel"].logical == ("embed", "mlp")
    new, _ = program.step(jax.tree.map(lambda x: x.copy(), state), _batch(program))
    before, after = state["model_state"]["BatchNorm_0"]["mean"], new["model_state"]["BatchNorm_0"]["mean"]
    assert not np.allclose(np.asarray(after), np.asarray(before))


@pytest.mark.newest
def test_a_linen_module_returned_directly_is_a_config_error_naming_from_linen(tmp_path):
    import flax.linen as nn

    class Decoder(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(x)

    (tmp_path / "linen_mine.py").write_text(  # Not mine.py: another test imports one (sys.modules).
        "import flax.linen as nn\n\nclass Decoder(nn.Module):\n    @nn.compact\n    def __call__(self, x):\n"
        "        return nn.Dense(4)(x)\n\ndef build(rngs):\n    return Decoder()\n"
    )
    (tmp_path / "run.yaml").write_text("model: {factory: linen_mine:build}\ntrain: {global_batch: 16}\n")
    config = load_config(tmp_path / "run.yaml")
    mesh = build_mesh({"data": 8}, jax.devices())
    linen = (
        "returned the Flax Linen module Decoder, not a Flax NNX module; wrap it with "
        "shardmem.models.linen.from_linen: return from_linen(Decoder(...), example_input, rngs=rngs)"
    )
    with pytest.raises(ConfigError, match=re.escape(linen)) as raised:  # From the YAML's model.factory ...
        build_program(config, mesh, loss_fn=_classify, batch=BATCH)
    assert "\n" not in str(raised.value)  # One line for the CLI, no JAX traceback note in it.
    with pytest.raises(ConfigError, match=re.escape(linen)):  # ... and from Python.
        build_program(config, mesh, model_factory=lambda rngs: Decoder(), loss_fn=_classify, batch=BATCH)


TOKENS = {"shape": ["global_batch", third_party.SEQ_LEN + 1], "dtype": "int32", "axes": ["batch", None]}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("build", "pattern"), [(third_party.build_linen, "blocks_*"), (third_party.build_nnx, "DecoderBlock")]
)
def test_remat_modules_reach_the_layers_of_a_third_party_model(build, pattern):
    """Blocks that take no remat argument get jax.checkpoint from the config alone: by name (Linen,
    through nn.intercept_methods) or by class (NNX, through nnx.remat)."""

    def config(policy, devices):
        return config_from_dict({
            "mesh": {"axes": {"data": devices}, "devices_per_host": devices}, "train": {"global_batch": 8},
            "precision": {"compute": "float32"}, "remat": {"modules": {pattern: policy}},
        })  # fmt: skip

    # One H100, deviceless: XLA:CPU expands remat's barriers and merges the recomputation back into the
    # forward pass, so a cpu plan of unscanned blocks shows no saving (a scanned stack's does).
    def planned(policy):
        return shardmem.plan(config(policy, 1), target="h100-sxm", model_factory=build,
                             loss_fn=shardmem.next_token_loss, batch=TOKENS)  # fmt: skip

    none, full = planned("none"), planned("full")
    assert full.per_device["temp"] <= 0.5 * none.per_device["temp"], (none.per_device, full.per_device)
    assert full.remat == f"modules {pattern}: full" and full.recompute_overhead > 0
    assert none.remat == f"modules {pattern}: none" and none.recompute_overhead == 0
    assert not any("remat.modules" in w for w in full.warnings), full.warnings

    mesh = build_mesh({"data": 8}, jax.devices())
    runs = {
        policy: trained(build_program(config(policy, 8), mesh, model_factory=build,
                                      loss_fn=shardmem.next_token_loss, batch=TOKENS))
        for policy in ("none", "full")
    }  # fmt: skip
    (_, losses, params), (_, want_losses, want_params) = runs["full"], runs["none"]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params, want_params)


def test_remat_modules_patterns_are_checked_and_unmatched_ones_warn():
    with pytest.raises(ConfigError, match=r"remat.modules.blocks_\*='ful' is not a remat policy \(did you"):
        config_from_dict({"remat": {"modules": {"blocks_*": "ful"}}})
    with pytest.raises(ConfigError, match="remat.modules=.* wraps layers of a model of your own"):
        config = config_from_dict({"model": {"preset": "tiny"}, "remat": {"modules": {"layers": "full"}}})
        build_program(config, build_mesh({"data": 8}, jax.devices()))
    sections = {"mesh": {"axes": {"data": 8}}, "train": {"global_batch": 8}}
    config = config_from_dict({**sections, "remat": {"modules": {"blocks_*": "full", "Blok": "dots"}}})
    report = shardmem.plan(config, model_factory=third_party.build_linen, batch=TOKENS,
                           loss_fn=shardmem.next_token_loss, count_remat_overhead=False)  # fmt: skip
    assert report.remat == "modules blocks_*: full, Blok: dots"
    assert [w for w in report.warnings if "remat.modules" in w] == [
        "remat.modules.Blok: no module of the model matches 'Blok', so nothing is rematerialized for it; "
        "match a submodule's path (decoder/blocks_0), name (blocks_0) or class name (DecoderBlock)"
    ]


def _third_party_plan(build, modules=None):
    """One H100, deviceless (XLA:CPU merges unscanned blocks' recomputation back into the forward)."""
    config = config_from_dict({
        "mesh": {"axes": {"data": 1}, "devices_per_host": 1}, "train": {"global_batch": 8},
        "precision": {"compute": "float32"}, "remat": {"modules": modules} if modules else {},
    })  # fmt: skip
    loss = shardmem.next_token_loss
    return shardmem.plan(config, target="h100-sxm", model_factory=build, loss_fn=loss, batch=TOKENS, top=1)


@pytest.mark.newest
def test_an_unedited_third_party_model_gets_a_model_flops_baseline_and_mfu():
    """No remat argument, no remat.modules: the traced step has no jax.checkpoint, so it is its own
    no-remat baseline, and the plan reports MFU."""
    report = _third_party_plan(third_party.build_linen)
    assert report.remat == "the model's own"
    assert report.flops_no_remat == report.flops_per_step > 0 and report.recompute_overhead == 0
    assert report.step_time.mfu is not None and 0 < report.step_time.mfu < 1


@pytest.mark.slow
def test_remat_modules_reach_a_model_under_nn_jit_in_any_order_of_plans():
    """nn.jit reuses its first trace in a process: a plan after one under another remat plan (or none)
    still gets its own remat, and the no-remat baseline is not the remat trace."""
    build = third_party.build_linen_jit
    full = _third_party_plan(build, {"blocks_*": "full"})
    none = _third_party_plan(build, {"blocks_*": "none"})
    plain = _third_party_plan(build)
    again = _third_party_plan(build, {"blocks_*": "full"})
    for report in (full, again):  # after nothing (or a plain trace of another test) and after "none"
        assert report.recompute_overhead > 0, report.remat
        assert report.per_device["temp"] <= 0.5 * none.per_device["temp"], report.per_device
        assert not any("remat" in w for w in report.warnings), report.warnings
    assert none.recompute_overhead == 0 and plain.recompute_overhead == 0
    assert plain.per_device["temp"] == none.per_device["temp"] and plain.step_time.mfu is not None
    assert full.step_time.mfu == pytest.approx(plain.step_time.mfu, rel=0.3)  # Model FLOPs, not the remat's.


@pytest.mark.newest
def test_a_remat_that_did_not_happen_is_reported_as_not_applied(monkeypatch):
    """With JAX's trace caches left as they are, nn.jit reuses the trace made without remat: the plan
    says so instead of reporting the remat it asked for."""
    from shardmem.models import linen

    build = third_party.build_linen_jit
    _third_party_plan(build, {"blocks_*": "none"})  # Traced without remat ...
    monkeypatch.setattr(linen, "_fresh_traces", lambda plan: None)
    report = _third_party_plan(build, {"blocks_*": "full"})  # ... and reused.
    assert report.remat == "modules blocks_*: full (not applied)" and report.recompute_overhead == 0
    assert any("the traced step has no jax.checkpoint" in w for w in report.warnings), report.warnings
