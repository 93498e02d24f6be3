# ruff: noqa: E501  (HLO text is copied as XLA writes it)
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardmem.planning import hlo
from shardmem.planning.targets import resolve_target

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


def test_readable_scopes():
    assert hlo.readable_scope("jit(step)/while/body/transpose(jvp(layers_0-7))/attention/dot_general") == (
        "layers_0-7/attention/dot_general (backward)"
    )
    assert hlo.readable_scope("state['params']['layers']['wq']") == "state/params/layers/wq (argument)"


def test_matmul_flops_count_scan_trips():
    def f(ws, x):
        return jax.lax.scan(lambda x, w: (x @ w, None), x, ws)[0].sum()

    jaxpr = jax.make_jaxpr(f)(jnp.ones((3, 16, 16)), jnp.ones((4, 16)))
    assert hlo.matmul_flops(jaxpr) == 3 * 2 * 4 * 16 * 16


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
