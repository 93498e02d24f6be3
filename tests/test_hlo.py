# ruff: noqa: E501  (HLO text is copied as XLA writes it)
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardmem.planning import hlo
from shardmem.planning.targets import resolve_target

# On the newest JAX too (.ci/run): XLA's HLO text, parsed as each JAX version writes it.
pytestmark = pytest.mark.newest

HLO = """\
HloModule m

%body (p: (s32[], f32[8,256])) -> (s32[], f32[8,256]) {
  %p = (s32[], f32[8,256]{1,0}) parameter(0)
  %ag = (f32[32,256]{1,0}, f32[256,256]{1,0}) all-gather-start(%x), metadata={op_name="jit(f)/while/body/dot_general"}
  %agd = f32[256,256]{1,0} all-gather-done(%ag)
  %ar = bf16[1024]{0} all-reduce(%y), to_apply=%add
}

ENTRY %main (a: f32[8,256]) -> f32[8,256] {
  %w = (s32[], f32[8,256]{1,0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %rs = f32[128]{0} reduce-scatter(%z), metadata={op_name="jit(f)/transpose(jvp(layers_0-3))/mlp/dot_general"}
}
"""


def test_collective_bytes_counts_results_and_loop_trips():
    totals = hlo.collective_bytes(HLO)
    assert totals["all-gather"] == 4 * 256 * 256 * 4  # result of the -start pair, 4 trips
    assert totals["all-reduce"] == 4 * 1024 * 2
    assert totals["reduce-scatter"] == 128 * 4


def test_a_loops_body_is_found_after_its_condition():
    # XLA writes condition= before body=: both are called computations, the body once per trip.
    text = HLO.replace("condition=%cond, body=%body", "condition=%wide.cond.clone, body=%wide.body.clone")
    text = text.replace("%body (p:", "%wide.body.clone (p:")
    module = hlo.parse_module(text)
    assert module.by_name["w"].called == ("wide.cond.clone", "wide.body.clone")
    assert module.executions()["wide.body.clone"] == 4
    assert hlo.collective_bytes(module)["all-gather"] == 4 * 256 * 256 * 4


PIPELINED_LOOP = """\
%fused_compare (param_0.5852: s32[]) -> pred[] {
  %param_0.5852 = s32[] parameter(0), metadata={scheduling_name="param_0.5852"}
  %constant_1397_2 = s32[] constant(3)
  ROOT %compare.11.2 = pred[] compare(%param_0.5852, %constant_1397_2), direction=LT, metadata={scheduling_name="compare.11.2"}
}

%cond (cond_param.5: (s32[], f32[1])) -> pred[] {
  %cond_param.5 = (s32[], f32[1]{0}) parameter(0), metadata={scheduling_name="cond_param.5"}
  %get-tuple-element.2745 = s32[] get-tuple-element(%cond_param.5), index=0, metadata={scheduling_name="get-tuple-element.2745"}
  ROOT %loop_compare_fusion.5 = pred[] fusion(%get-tuple-element.2745), kind=kLoop, calls=%fused_compare, metadata={scheduling_name="loop_compare_fusion.5"}
}

%body (p: (s32[], f32[1])) -> (s32[], f32[1]) {
  %p = (s32[], f32[1]{0}) parameter(0)
  %ar = f32[1024]{0} all-reduce(%y), to_apply=%add
}

ENTRY %main (a: f32[1]) -> f32[1] {
  %constant_607_clone_1 = s32[] constant(0)
  %copy.555 = s32[] copy(%constant_607_clone_1)
  %copy.276 = s32[] copy(%copy.555)
  %tuple.342 = (s32[], f32[1]{0}) tuple(%copy.276, %a)
  %while.235 = (s32[], f32[1]{0}) while(%tuple.342), condition=%cond, body=%body, metadata={scheduling_name="while.235"}, backend_config={"known_induction_variable":{"tuple_index":"0"},"dynamic_variables":[]}
}
"""


def test_trips_of_a_loop_whose_condition_compares_in_a_fusion():
    # XLA's GPU compiler with pipelined collectives (planning/overlap.py) writes the micro-batch loop's
    # condition as a fusion and drops known_trip_count; read as 1 trip, the step's compute halved.
    module = hlo.parse_module(PIPELINED_LOOP)
    assert module.by_name["while.235"].trip_count == 3
    assert hlo.collective_bytes(module)["all-reduce"] == 3 * 1024 * 4


def test_readable_scopes():
    assert hlo.readable_scope("jit(step)/while/body/transpose(jvp(layers_0-7))/attention/dot_general") == (
        "layers_0-7/attention/dot_general (backward)"
    )
    assert hlo.readable_scope("state['params']['layers']['wq']") == "state/params/layers/wq (argument)"
    # A serving step's layer is a nested function: its name is not a scope of the model's.
    assert hlo.readable_scope("jit(decode)/jit(run_layer)/attention/dynamic_update_slice") == (
        "attention/dynamic_update_slice"
    )


STACKED = """\
%fused_dynamic_update_slice.10 (param_0.531: bf16[4,2,64,192], param_1.524: s32[], param_2.400: bf16[2,64,192]) -> bf16[4,2,64,192] {
  %param_0.531 = bf16[4,2,64,192]{3,2,1,0} parameter(0), metadata={scheduling_name="param_0.531"}
  %param_2.400 = bf16[2,64,192]{2,1,0} parameter(2), metadata={scheduling_name="param_2.400"}
  %bitcast.33.1 = bf16[1,2,64,192]{3,2,1,0} bitcast(%param_2.400), metadata={op_name="jit(train_step)/jvp(layers_0-3)/while/body/jit(dynamic_update_index_in_dim)/broadcast_in_dim"}
  %copy.208 = bf16[1,2,64,192]{3,2,1,0} copy(%bitcast.33.1)
  %param_1.524 = s32[] parameter(1), metadata={scheduling_name="param_1.524"}
  %constant_15 = s32[] constant(0)
  ROOT %dynamic-update-slice.21.1 = bf16[4,2,64,192]{3,2,1,0} dynamic-update-slice(%param_0.531, %copy.208, %param_1.524, %constant_15, %constant_15, /*index=5*/%constant_15), metadata={op_name="jit(train_step)/jvp(layers_0-3)/while/body/jit(dynamic_update_index_in_dim)/dynamic_update_slice"}
}

%body (param.59: (s32[], bf16[2,64,64], bf16[4,2,64,192], bf16[4,2,64,64])) -> (s32[], bf16[2,64,64], bf16[4,2,64,192], bf16[4,2,64,64]) {
  %param.59 = (s32[], bf16[2,64,64], bf16[4,2,64,192], bf16[4,2,64,64]) parameter(0)
  %get-tuple-element.629 = bf16[2,64,64]{2,1,0} get-tuple-element(%param.59), index=1
  %get-tuple-element.634 = bf16[4,2,64,192]{3,2,1,0} get-tuple-element(%param.59), index=2
  %get-tuple-element.636 = bf16[4,2,64,64]{3,2,1,0} get-tuple-element(%param.59), index=3
  %copy.63 = s32[] copy(%i)
  %gate.1 = bf16[2,64,192]{2,1,0} fusion(%get-tuple-element.629, %w), kind=kCustom, calls=%gemm, metadata={op_name="jit(train_step)/jvp(layers_0-3)/while/body/closed_call/mlp/remat2"}
  %loop_dynamic_update_slice_fusion.11 = bf16[4,2,64,192]{3,2,1,0} fusion(%get-tuple-element.634, %copy.63, %gate.1), kind=kCustom, calls=%fused_dynamic_update_slice.10, metadata={op_name="jit(train_step)/jvp(layers_0-3)/while/body/jit(dynamic_update_index_in_dim)/dynamic_update_slice"}
  %dynamic-update-slice.5 = bf16[4,2,64,64]{3,2,1,0} dynamic-update-slice(%get-tuple-element.636, %get-tuple-element.629, %copy.63, %copy.63, %copy.63), metadata={op_name="jit(train_step)/jvp(layers_0-3)/while/body/jit(dynamic_update_index_in_dim)/dynamic_update_slice"}
}
"""


def test_stacked_residuals_are_named_by_the_op_that_made_them():
    # A scan stores each layer's residual into its stack with a dynamic_update_slice (fused or not); the
    # buffer is named by what the stored value is: the MLP's output here, the layer's input (the carry).
    table = hlo._instructions(STACKED)
    mlp = hlo._scope_of(table, "loop_dynamic_update_slice_fusion.11")
    carry = hlo._scope_of(table, "dynamic-update-slice.5")
    assert mlp == "layers_0-3/mlp (stacked for the backward pass)"
    assert carry == "layers_0-3/layer input (stacked for the backward pass)"
    assert (hlo.category(mlp), hlo.category(carry)) == ("mlp", "layers (other)")


def test_matmul_flops_count_scan_trips():
    def f(ws, x):
        return jax.lax.scan(lambda x, w: (x @ w, None), x, ws)[0].sum()

    jaxpr = jax.make_jaxpr(f)(jnp.ones((3, 16, 16)), jnp.ones((4, 16)))
    assert hlo.matmul_flops(jaxpr) == 3 * 2 * 4 * 16 * 16


def test_matmul_flops_leave_out_the_matmuls_nobody_uses():
    # jax.vjp inside a custom_vjp rule traces the forward matmul as well as the pullback, and a rule's
    # cotangent for an input nobody differentiates is computed, then dropped: XLA removes both, so must
    # the count, through the shard_map (or jit) whose body makes them.
    @jax.custom_vjp
    def project(x, w):
        return x @ w

    def backward(residuals, g):
        x, w = residuals
        return g @ w.T, jax.vjp(lambda w: x @ w, w)[1](g)[0]  # Forward x @ w unused; d w unused below.

    project.defvjp(lambda x, w: (x @ w, (x, w)), backward)
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    mapped = jax.shard_map(project, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
    step = jax.value_and_grad(lambda x, w: mapped(x, w).sum())
    jaxpr = jax.make_jaxpr(step)(jnp.ones((4, 8)), jnp.ones((8, 16)))
    assert hlo.matmul_flops(jaxpr) == 2 * (2 * 4 * 8 * 16)  # The forward and d x: no d w, no 2nd forward.


@pytest.mark.newest  # The Pallas kernel differs between JAX versions.
@pytest.mark.parametrize("causal", [True, False])
def test_matmul_flops_count_the_pallas_flash_kernel_from_its_shapes(causal):
    """JAX's Pallas flash kernel is one opaque op in the jaxpr: its matmuls (2 forward, 7 backward, over
    every query-key pair, half of them when causal) are counted from its shapes (interpret mode on CPU)."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    b, length, heads, head_dim = 2, 256, 4, 64
    q = jnp.zeros((b, length, heads, head_dim), jnp.bfloat16)

    def loss(q, k, v):
        return pallas_attention.mha(q, k, v, None, causal=causal, interpret=True).astype(jnp.float32).sum()

    pairs = b * heads * length * length * head_dim * (0.5 if causal else 1.0)
    assert hlo.matmul_flops(jax.make_jaxpr(loss)(q, q, q)) == 2 * 2 * pairs
    grad = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, q, q)
    assert hlo.matmul_flops(grad) == (2 + 7) * 2 * pairs
    # The model's FLOPs, as MFU counts them: a backward that recomputes nothing (dP, dV, dQ, dK).
    assert hlo.matmul_flops(grad, recomputed=False) == (2 + 4) * 2 * pairs


def test_matmul_flops_count_cudnn_attention_by_its_mask():
    """cuDNN's primitives cannot be traced without a GPU; the rule reads only name, mask and shapes."""
    from types import SimpleNamespace as NS

    def eqn(name, mask):
        shapes = ((2, 128, 8, 64), (2, 128, 2, 64))  # BTNH: 8 query heads over 2 key/value heads
        return NS(primitive=NS(name=name), params={"mask_type": mask},
                  invars=[NS(aval=NS(shape=shape)) for shape in shapes])  # fmt: skip

    pairs = 2 * 8 * 128 * 128 * 64
    assert hlo.fused_attention_flops(eqn("dot_product_attention_fwd_wrapper", "MaskType.CAUSAL")) == 2 * pairs
    assert (
        hlo.fused_attention_flops(eqn("dot_product_attention_bwd_wrapper", "MaskType.NO_MASK")) == 10 * pairs
    )
    backward = eqn("dot_product_attention_bwd_wrapper", "MaskType.CAUSAL")
    assert hlo.fused_attention_flops(backward, recomputed=False) == 4 * pairs  # Without recomputing QK.
    assert hlo.fused_attention_flops(eqn("dot_general", None)) is None


def test_matmul_flops_count_shard_map_bodies_once_per_shard():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))

    def f(x, w):  # split over a (2 shards); b repeats the same work and counts once
        return jax.shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=(P("a", None), P()),
                             out_specs=P("a", None))(x, w)  # fmt: skip

    assert hlo.matmul_flops(jax.make_jaxpr(f)(jnp.ones((8, 16)), jnp.ones((16, 32)))) == 2 * 8 * 16 * 32

    # A body that takes its own part by its index along an axis (a sequence split by hand) does different
    # work on each of that axis's devices; a shard_map nested in it that splits nothing more counts once.
    def own_rows(x, w):
        mine = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index("b") * 2, 2)
        inner = jax.shard_map(lambda m, w: (m + jax.lax.axis_index("b")) @ w, in_specs=(P(), P()),
                              mesh=jax.sharding.get_abstract_mesh(), out_specs=P(), axis_names=set(),
                              check_vma=False)  # fmt: skip
        return inner(mine, w)

    def g(x, w):
        return jax.shard_map(own_rows, mesh=mesh, in_specs=(P(), P()), out_specs=P(("a", "b")),
                             check_vma=False)(x, w)  # fmt: skip

    assert hlo.matmul_flops(jax.make_jaxpr(g)(jnp.ones((8, 16)), jnp.ones((16, 32)))) == 4 * 2 * 2 * 16 * 32


def test_live_buffers_of_a_real_compile(tmp_path):
    target = resolve_target("h100-sxm", n_devices=8)
    mesh = Mesh(np.array(target.devices), ("fsdp",))
    w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    x = jax.ShapeDtypeStruct((64, 1024), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    traced = jax.jit(jax.grad(lambda w, x: jnp.tanh(x @ w).sum())).trace(w, x)
    traced.lower().compile(compiler_options={"xla_dump_to": str(tmp_path), "xla_dump_hlo_as_text": True})
    buffers, peak = hlo.live_at_peak(tmp_path)
    assert peak and buffers and sum(b.bytes for b in buffers) <= peak
    assert any(b.shape == "f32[1024,1024]" for b in buffers)  # the gathered weight or its gradient


def test_tuple_elements_drop_xla_comments_and_layouts():
    # XLA numbers the elements of long tuples, "/*index=2*/"; shapes are shown without them and layouts.
    shape = "(s32[], f32[2]{0}, /*index=2*/bf16[30,4,4096,11008]{3,2,1,0}, (s32[], /*index=1*/f32[8]{0}))"
    assert hlo._tuple_element(shape, "2") == "bf16[30,4,4096,11008]"
    assert hlo._tuple_element(shape, "3,1") == "f32[8]"


def test_collective_bytes_count_the_branch_of_a_conditional_that_moves_most():
    # A device runs one branch (a 1F1B tick runs its stage's op): the bytes are the larger psum's alone.
    from jax.sharding import AxisType

    mesh = Mesh(np.array(jax.devices()[:8]), ("x",), axis_types=(AxisType.Auto,))

    def body(a_N):
        small, big = (lambda a: jax.lax.psum(a[:16], "x").sum()), (lambda a: jax.lax.psum(a, "x").sum())
        return jax.lax.switch(jax.lax.axis_index("x") % 2, [small, big], a_N)[None]

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    text = step.lower(jnp.ones((8 * 1024,), jnp.float32)).compile().as_text()
    assert "conditional" in text
    assert hlo.collective_bytes(text)["all-reduce"] == 1024 * 4


@pytest.mark.newest
def test_loops_of_which_a_device_runs_one_count_as_the_costliest_alone():
    # A 1F1B tick runs its stage's op as one of several loops, each run once or never (in place, where a
    # conditional copies what it returns): FLOPs, collective bytes and the step-time replay count the
    # costliest loop alone, once per tick, as of a conditional's branches.
    from jax.sharding import AxisType

    from shardmem.parallel.pipeline import _run_one_of
    from shardmem.planning import cost
    from shardmem.planning.targets import GPU_TARGETS

    mesh = Mesh(np.array(jax.devices()[:8]), ("x",), axis_types=(AxisType.Auto,))

    def body(a_N, w_NxN):
        def small(carry):
            a, w = carry
            return jax.lax.psum(a[:16], "x").sum() + a, w[:, :8] @ w[:8]

        def big(carry):
            a, w = carry
            return jax.lax.psum(a, "x") + a, w @ w

        def tick(carry, op):
            return _run_one_of(op, [None, small, big], carry), None

        return jax.lax.scan(tick, (a_N, w_NxN), jnp.arange(6) % 3)[0][0]

    step = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))
    args = jax.ShapeDtypeStruct((8 * 2**22,), jnp.float32), jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    text = jax.jit(step).lower(*args).compile().as_text()
    module = hlo.parse_module(text)
    assert "conditional" not in text
    groups = [group for c in module.computations.values() for group in hlo.one_of_groups(c).values()]
    assert [len(group) for group in groups] == [2]  # The two loops of a tick.
    assert hlo.collective_bytes(module)["all-reduce"] == 6 * 2**24  # The big psum, every tick.
    assert hlo.matmul_flops(jax.make_jaxpr(step)(*args)) == 8 * 6 * 2 * 1024**3  # Every shard's big matmul.
    h100 = cost.Hardware("h100-sxm", GPU_TARGETS["h100-sxm"].peak_flops, 3.35e12, 450e9, 50e9, 64e9)
    estimate = cost.estimate_step_time(module, h100, [0] * 8)
    assert sum(c.bytes for c in estimate.collectives if c.kind == "all-reduce") == 6 * 2**24
    # Given the ops some stage runs at each tick (a 1F1B table's), a tick costs the slowest of those: the
    # big op at two ticks of six, the small one at three, nothing at the idle one.
    by_tick = cost.estimate_step_time(module, h100, [0] * 8, tick_ops=[{1}, {1, 2}, {1}, set(), {2}, {1}])
    assert sum(c.bytes for c in by_tick.collectives if c.kind == "all-reduce") == 2 * 2**24 + 3 * 64
    assert by_tick.seconds < estimate.seconds
    jaxpr = jax.make_jaxpr(step)(*args)  # Each op's FLOPs as often as the schedule runs it.
    assert hlo.matmul_flops(jaxpr, {1: 0.5, 2: 0.25}) == 8 * 6 * 2 * (0.25 * 1024**3 + 0.5 * 1024**2 * 8)


def _layer_fusion(name: str, prefix: str, rows: str, op_name: str) -> str:
    """A fused computation that slices ``rows`` of a stacked weight and reduces its product with ``x``,
    its instructions named with ``prefix`` (XLA names each copy of a layer's fusion differently)."""
    return f"""
%{name} ({prefix}0: f32[2,4], {prefix}1: f32[8,4]) -> f32[2] {{
  %{prefix}0 = f32[2,4]{{1,0}} parameter(0)
  %{prefix}1 = f32[8,4]{{1,0}} parameter(1)
  %{prefix}w = f32[2,4]{{1,0}} slice(%{prefix}1), slice={{[{rows}], [0:4]}}, metadata={{op_name="{op_name}"}}
  %{prefix}m = f32[2,4]{{1,0}} multiply(%{prefix}0, %{prefix}w)
  %{prefix}z = f32[] constant(0)
  ROOT %{prefix}r = f32[2]{{0}} reduce(%{prefix}m, %{prefix}z), dimensions={{1}}, to_apply=%add
}}
"""


TWO_LAYERS = f"""HloModule m

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}
{_layer_fusion("first", "p", "0:2", "layer0")}{_layer_fusion("second", "q", "0:2", "layer1")}\
{_layer_fusion("third", "u", "2:4", "layer0")}
ENTRY %main (x: f32[2,4], w: f32[8,4]) -> f32[2] {{
  %x = f32[2,4]{{1,0}} parameter(0)
  %w = f32[8,4]{{1,0}} parameter(1)
  %f0 = f32[2]{{0}} fusion(%x, %w), kind=kInput, calls=%first, metadata={{op_name="a"}}
  %f1 = f32[2]{{0}} fusion(%x, %w), kind=kInput, calls=%second, metadata={{op_name="b"}}
  %f2 = f32[2]{{0}} fusion(%x, %w), kind=kInput, calls=%third
  ROOT %sum = f32[2]{{0}} add(%f0, %f1)
}}
"""


def test_fusions_that_differ_only_in_names_are_one_kernel_and_a_slices_bounds_make_another():
    module = hlo.parse_module(TWO_LAYERS)
    assert len(module.kernels()) == 2  # %first and %second are one kernel; %third slices other rows.
