# ruff: noqa: E501  (HLO text is copied as XLA writes it)
"""The step-time model: each piece against hand arithmetic on HLO written out, then whole plans."""

import dataclasses
import json
import re

import pytest

from shardmem.config import load_config
from shardmem.planning import collectives, cost, hlo
from shardmem.planning.collectives import Cluster, Group
from shardmem.planning.targets import GPU_TARGETS, resolve_target

# On the newest JAX too (.ci/run): the HLO text XLA writes (replica groups, loops, async collectives).
pytestmark = pytest.mark.newest

H100 = cost.Hardware("h100-sxm", GPU_TARGETS["h100-sxm"].peak_flops, 3.35e12, 450e9, 50e9, 64e9)
TWO_HOSTS = [0, 0, 0, 0, 1, 1, 1, 1]


def _module(body: str) -> hlo.HloModule:
    return hlo.parse_module(f"HloModule m\n\nENTRY %main (a: f32[8]) -> f32[8] {{\n{body}\n}}\n")


def _all_reduce(groups: str, size: int = 1 << 25) -> str:
    return f"  %ar = bf16[{size}]{{0}} all-reduce(%a), channel_id=1, replica_groups={groups}, use_global_device_ids=true, to_apply=%add"


def test_replica_groups_in_every_form_xla_writes():
    def groups(attributes):
        return cost.replica_groups(hlo.Instruction("x", "f32[2]", "all-reduce", (), attributes), 8)

    assert groups("replica_groups={{0,1},{2,3}}") == [[0, 1], [2, 3]]
    assert groups("replica_groups=[4,2]<=[8]") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups("replica_groups=[2,4]<=[4,2]T(1,0)") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups("replica_groups=mesh['a'=4,'b'=2] {'a'}") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups("source_target_pairs={{0,1},{1,0}}") == [[0, 1], [1, 0]]
    assert groups("to_apply=%add") == [list(range(8))]


def test_replica_groups_of_the_mesh_form_with_device_ids_and_sub_axes():
    def groups(attributes, devices=8):
        return cost.replica_groups(hlo.Instruction("x", "f32[2]", "all-gather", (), attributes), devices)

    # XLA 0.10 on data=8 x fsdp=16 GPUs: the mesh's device array is the iota [8,16] transposed, so the
    # groups along 'axis_0' are 16 neighbours (one fsdp group over 2 hosts), not one group of all 128.
    fsdp = groups("replica_groups=mesh['axis_0'=16,'axis_1'=1,'axis_2'=8], device_ids=([8,16]T(1,0)) "
                  "{'axis_0'}, dimensions={0}", 128)  # fmt: skip
    assert fsdp == [list(range(16 * j, 16 * j + 16)) for j in range(8)]
    assert groups("replica_groups=mesh['a'=2,'b'=4], device_ids=(0,2,4,6,1,3,5,7) {'b'}") == [
        [0, 2, 4, 6], [1, 3, 5, 7]]  # fmt: skip
    # Sub-axes (later XLA, bare names): a:(pre)size splits axis a into [pre, size, rest].
    assert groups("replica_groups=mesh[a=8] {a:(1)2}") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups("replica_groups=mesh[a=8] {a:(2)2}") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups("replica_groups=mesh[a=8] {a:(4)2,a:(1)2}") == [[0, 4, 1, 5], [2, 6, 3, 7]]
    assert groups("replica_groups=maximal_mesh[device_id=3] {}") == [[3]]
    assert groups("replica_groups={}, to_apply=%add") == [list(range(8))]  # XLA's "every device"
    with pytest.raises(cost.UnreadGroups, match="replica_groups=somehow"):
        groups("replica_groups=somehow[8]")


def _axis_groups(mesh) -> dict[tuple[str, ...], list[list[int]]]:
    """Every subset of a mesh's axes -> its device groups (by the devices' position in the mesh, which is
    the partition id XLA's groups name)."""
    import itertools

    import numpy as np

    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    names = list(mesh.axis_names)
    table = {}
    for k in range(len(names) + 1):
        for axes in itertools.combinations(range(len(names)), k):
            rest = [i for i in range(len(names)) if i not in axes]
            size = int(np.prod([ids.shape[i] for i in axes]))
            table[tuple(names[i] for i in axes)] = sorted(
                ids.transpose(rest + list(axes)).reshape(-1, size).tolist()
            )
    return table


def _compiled_collectives(devices, shape, names, specs):
    """The collectives of one small sharded training step (an MLP, its gradient and an update), compiled for
    ``devices`` laid out as a mesh: (instruction, mesh)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    mesh = Mesh(np.array(devices).reshape(shape), names)
    shard = {k: NamedSharding(mesh, v) for k, v in specs.items()}

    def step(w, x):
        grads = jax.grad(lambda w: jnp.mean((jax.nn.relu(x @ w["a"]) @ w["b"]) ** 2))(w)
        return jax.tree.map(lambda p, g: p - 0.1 * g, w, grads)

    w = {"a": jax.ShapeDtypeStruct((1024, 512), jnp.float32, sharding=shard["a"]),
         "b": jax.ShapeDtypeStruct((512, 1024), jnp.float32, sharding=shard["b"])}  # fmt: skip
    x = jax.ShapeDtypeStruct((256, 1024), jnp.float32, sharding=shard["x"])
    text = jax.jit(step, out_shardings={"a": shard["a"], "b": shard["b"]}).lower(w, x).compile().as_text()
    module = hlo.parse_module(text)
    found = [i for i in module.by_name.values() if hlo.collective_kind(i)]
    assert found
    return found, mesh


@pytest.mark.parametrize("where", ["cpu 2x2x2", "h100 16 hosts: data 8 x fsdp 16", "h100 16 hosts: 2x8x8"])
def test_the_groups_of_real_compiled_collectives_are_mesh_axes(where):
    """Whatever form this JAX's XLA prints, the groups read are those of a set of mesh axes; the FSDP
    all-gathers of a data x fsdp mesh over 16 hosts are groups of 16 (2 hosts), not all 128 devices."""
    import jax
    from jax.sharding import PartitionSpec as P

    from shardmem.planning.targets import resolve_target

    if where.startswith("cpu"):
        devices, shape, names = jax.devices("cpu")[:8], (2, 2, 2), ("data", "fsdp", "tensor")
    elif "fsdp 16" in where:
        devices, shape, names = (
            resolve_target("h100-sxm", n_devices=128, hosts=16).devices,
            (8, 16),
            ("data", "fsdp"),
        )
    else:
        devices, shape, names = (
            resolve_target("h100-sxm", n_devices=128, hosts=16).devices,
            (2, 8, 8),
            ("data", "fsdp", "tensor"),
        )
    if names == ("data", "fsdp"):
        specs = {"a": P("fsdp", None), "b": P(None, "fsdp"), "x": P(("data", "fsdp"), None)}
    else:
        specs = {"a": P("fsdp", "tensor"), "b": P("tensor", "fsdp"), "x": P(("data", "fsdp"), None)}
    collectives, mesh = _compiled_collectives(devices, shape, names, specs)
    table = _axis_groups(mesh)
    read = {}
    for ins in collectives:
        groups = sorted(cost.replica_groups(ins, mesh.devices.size))
        axes = [a for a, g in table.items() if g == groups]
        assert axes, f"{ins.name}: {ins.attributes[:160]} read as groups no mesh axes make"
        read.setdefault(hlo.collective_kind(ins), set()).add(axes[0])
    if names == ("data", "fsdp"):
        assert read["all-gather"] == {("fsdp",)}  # the weights' gathers: 16 GPUs on 2 hosts
        hosts = [d.process_index for d in mesh.devices.flat]
        assert all(len({hosts[d] for d in g}) == 2 for g in table[("fsdp",)])


def test_a_collective_across_hosts_costs_more_than_the_same_inside_one():
    inside = cost.estimate_step_time(_module(_all_reduce("{{0,1},{2,3},{4,5},{6,7}}")), H100, TWO_HOSTS)
    across = cost.estimate_step_time(_module(_all_reduce("{{0,4},{1,5},{2,6},{3,7}}")), H100, TWO_HOSTS)
    assert [c.link for c in inside.collectives] == ["nvlink"]
    assert [c.link for c in across.collectives] == ["network"]
    assert across.communication > 5 * inside.communication  # 50 GB/s against 450 GB/s per GPU
    # Ring all-reduce of 64 MiB over 2 devices: 2 (n - 1) / n of the bytes at the link's achieved rate.
    moved = 2 * (2 - 1) / 2 * (1 << 26)
    assert inside.communication == pytest.approx(cost.COLLECTIVE_LATENCY["nvlink"] + moved / (450e9 * 0.8))


def test_a_bigger_group_moves_more_bytes_per_device():
    two = cost.estimate_step_time(_module(_all_reduce("[4,2]<=[8]")), H100, [0] * 8)
    eight = cost.estimate_step_time(_module(_all_reduce("[1,8]<=[8]")), H100, [0] * 8)
    assert (two.collectives[0].group_size, eight.collectives[0].group_size) == (2, 8)
    latency = cost.COLLECTIVE_LATENCY["nvlink"]
    assert (eight.communication - latency) / (two.communication - latency) == pytest.approx(
        (2 * 7 / 8) / (2 * 1 / 2)
    )


def test_an_async_collective_hides_behind_the_compute_between_its_start_and_done():
    dot = (
        "  %d{i} = bf16[4096,4096]{{1,0}} dot(%x, %y), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}"
    )
    shapes = "  %x = bf16[4096,4096]{1,0} parameter(0)\n  %y = bf16[4096,4096]{1,0} parameter(1)"
    start = "  %s = bf16[1048576]{0} all-reduce-start(%a), replica_groups={{0,4}}, to_apply=%add\n"
    done = "  %e = bf16[1048576]{0} all-reduce-done(%s)\n"
    hidden = _module(shapes + "\n" + start + "\n".join(dot.format(i=i) for i in range(3)) + "\n" + done)
    exposed = _module(shapes + "\n" + start + done + "\n".join(dot.format(i=i) for i in range(3)))
    a = cost.estimate_step_time(hidden, H100, TWO_HOSTS)
    b = cost.estimate_step_time(exposed, H100, TWO_HOSTS)
    assert a.communication == b.communication > 0
    dot_seconds = 2 * 4096**3 / (989.4e12 * cost.MATMUL_EFFICIENCY)
    assert a.compute == pytest.approx(3 * dot_seconds)  # The roofline of a large matmul: its FLOPs.
    assert a.exposed_communication == pytest.approx(
        max(0.0, a.communication - a.compute - 3 * cost.KERNEL_GAP)
    )
    assert b.exposed_communication == pytest.approx(b.communication)
    assert a.seconds < b.seconds
    assert a.full_overlap_seconds <= a.seconds <= a.no_overlap_seconds


def test_a_loop_runs_its_body_once_per_trip_and_in_place_updates_count_their_slice():
    text = """HloModule m

%fused_dus (p0: f32[80,1024,1024], p1: f32[1,1024,1024], p2: s32[]) -> f32[80,1024,1024] {
  %p0 = f32[80,1024,1024]{2,1,0} parameter(0)
  %p1 = f32[1,1024,1024]{2,1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %u = f32[80,1024,1024]{2,1,0} dynamic-update-slice(%p0, %p1, %p2, %z, %z)
}

%body (p: (s32[], f32[80,1024,1024], f32[1,1024,1024])) -> (s32[], f32[80,1024,1024], f32[1,1024,1024]) {
  %p = (s32[], f32[80,1024,1024]{2,1,0}, f32[1,1024,1024]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %stack = f32[80,1024,1024]{2,1,0} get-tuple-element(%p), index=1
  %new = f32[1,1024,1024]{2,1,0} get-tuple-element(%p), index=2
  %f = f32[80,1024,1024]{2,1,0} fusion(%stack, %new, %i), kind=kLoop, calls=%fused_dus
  ROOT %t = (s32[], f32[80,1024,1024]{2,1,0}, f32[1,1024,1024]{2,1,0}) tuple(%i, %f, %new)
}

ENTRY %main (a: (s32[], f32[80,1024,1024], f32[1,1024,1024])) -> f32[8] {
  %a = (s32[], f32[80,1024,1024]{2,1,0}, f32[1,1024,1024]{2,1,0}) parameter(0)
  %w = (s32[], f32[80,1024,1024]{2,1,0}, f32[1,1024,1024]{2,1,0}) while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"80"}}
}
"""
    estimate = cost.estimate_step_time(hlo.parse_module(text), H100, [0])
    slice_bytes = 1024 * 1024 * 4
    # Each trip reads the update and writes it into the stack in place: not the 320 MiB stack itself.
    assert estimate.memory_bound == pytest.approx(80 * 2 * slice_bytes / (3.35e12 * cost.MEMORY_EFFICIENCY))
    assert estimate.kernels == 80
    assert estimate.loops[0].trips == 80


def test_interconnect_overrides_the_targets_links():
    config = load_config(
        "configs/llama-70b.yaml", ["interconnect.network=200Gb/s", "interconnect.nvlink=300GB/s"]
    )
    assert config.interconnect.network == 25e9
    target = dataclasses.make_dataclass("T", ["name", "spec"])("h100-sxm", GPU_TARGETS["h100-sxm"])
    hardware = cost.Hardware.of(target, config.interconnect)
    assert (hardware.network_bandwidth, hardware.nvlink_bandwidth, hardware.host_bandwidth) == (
        25e9,
        300e9,
        64e9,
    )
    with pytest.raises(Exception, match="interconnect.network.*400Gb/s"):
        load_config("configs/llama-70b.yaml", ["interconnect.network=fast"])


DGX_H100 = Cluster.of(GPU_TARGETS["h100-sxm"])


def _on(cluster: Cluster, name: str = "h100-sxm") -> cost.Hardware:
    spec = GPU_TARGETS[name]
    return cost.Hardware(name, spec.peak_flops, spec.memory_bandwidth, cluster.nvlink_bandwidth,
                         cluster.nic_bandwidth, spec.host_bandwidth, cluster)  # fmt: skip


def _all_gather(groups: str, result_bytes: int) -> hlo.HloModule:
    return _module(f"  %ag = bf16[{result_bytes // 2}]{{0}} all-gather(%a), channel_id=1, "
                   f"replica_groups={groups}, dimensions={{0}}, use_global_device_ids=true")  # fmt: skip


def test_an_fsdp_all_gather_over_8_nodes_costs_an_eighth_of_a_ring_through_each_gpus_own_nic():
    gathered = 8 << 30  # 8 GiB gathered over 64 GPUs: 128 MiB each (the latency is 1%)
    hosts = [d // 8 for d in range(64)]
    nccl = cost.estimate_step_time(_all_gather("[1,64]<=[64]", gathered), _on(DGX_H100), hosts)
    # The naive charge: every GPU pushes (n-1)/n of the gathered bytes through its own 400 Gb/s NIC.
    naive = 63 / 64 * gathered / (50e9 * collectives.NIC_EFFICIENCY)
    assert nccl.collectives[0].link == "network" and nccl.collectives[0].algorithm.startswith("ring")
    assert 1 / 9 < nccl.communication / naive < 1 / 7
    # NCCL's rail-aligned rings: the node's 8 NICs carry its share, NVLink (450 GB/s at 0.80) is the bound.
    assert nccl.communication == pytest.approx(63 / 64 * gathered / (450e9 * 0.80), rel=0.02)
    plain = cost.estimate_step_time(_all_gather("[1,64]<=[64]", gathered), H100, hosts)  # no cluster
    assert plain.communication > 6 * nccl.communication


def test_a_group_inside_one_node_never_touches_the_network():
    module = _module(_all_reduce("[2,8]<=[16]"))
    hosts = [d // 8 for d in range(16)]
    fast = cost.estimate_step_time(module, _on(DGX_H100), hosts)
    slow_nics = dataclasses.replace(DGX_H100, nic_bandwidth=1e8, nics_per_node=1)
    assert cost.estimate_step_time(module, _on(slow_nics), hosts).communication == fast.communication
    assert [(c.link, c.algorithm) for c in fast.collectives] == [("nvlink", "nvls/Simple")]
    across = cost.estimate_step_time(_module(_all_reduce("[8,2]<=[2,8]T(1,0)")), _on(slow_nics), hosts)
    assert across.collectives[0].link == "network" and across.communication > 100 * fast.communication


@pytest.mark.parametrize(
    ("name", "nodes", "published", "source"),
    [
        ("h100-sxm", 1, 476e9, "NVLS all-reduce on 8 x H100, NVIDIA/nccl-tests#290"),
        ("a100-80g", 1, 235e9, "8 x A100 all-reduce, NCCL tuning.cc's cap; ~240 in NVIDIA/nccl#1712"),
        ("h100-sxm", 2, 8 * 47e9, "46-48 GB/s per NDR NIC, 8 per node (NVIDIA/nccl-tests#290)"),
        ("h100-sxm", 248, 350e9, "248 x 8 H200 at 512 MB, ~350 GB/s (NVIDIA/nccl-tests#283)"),
    ],
)
def test_bus_bandwidth_reaches_published_nccl_tests_figures(name, nodes, published, source):
    cluster = Cluster.of(GPU_TARGETS[name])
    size = 512 << 20 if nodes > 100 else 8 << 30
    assert collectives.bus_bandwidth(
        "all-reduce", size, Group(8 * nodes, nodes, 8), cluster
    ) == pytest.approx(published, rel=0.1), source


def test_small_messages_are_latency_bound_and_bus_bandwidth_grows_with_size():
    for nodes in (1, 2, 16):
        group = Group(8 * nodes, nodes, 8)
        sizes = [8 << (2 * i) for i in range(16)]
        busbw = [collectives.bus_bandwidth("all-reduce", s, group, DGX_H100) for s in sizes]
        assert busbw == sorted(busbw)
        tiny, _ = collectives.collective_seconds("all-reduce", 8, group, DGX_H100)
        double, _ = collectives.collective_seconds("all-reduce", 16, group, DGX_H100)
        assert double == pytest.approx(tiny, rel=1e-3) and tiny > 10e-6  # a latency, not bytes / rate
    # Published small-message latencies: 8 x H20 (NVLink 4 as H100) 12.5 us at 8 B (deepseek-ai/DeepEP#303);
    # 16 x 8 H100 62 us (NVIDIA/nccl#1469).
    one, _ = collectives.collective_seconds("all-reduce", 8, Group(8), DGX_H100)
    sixteen, _ = collectives.collective_seconds("all-reduce", 8, Group(128, 16, 8), DGX_H100)
    assert one == pytest.approx(12.5e-6, rel=0.25) and sixteen == pytest.approx(62e-6, rel=0.25)


def test_in_network_reduction_speeds_up_an_all_reduce_across_nodes():
    group, size = Group(64, 8, 8), 1 << 30
    plain, _ = collectives.collective_seconds("all-reduce", size, group, DGX_H100)
    sharp, algorithm = collectives.collective_seconds(
        "all-reduce", size, group, dataclasses.replace(DGX_H100, sharp=True)
    )
    assert algorithm == "collnet/Simple" and sharp < 0.8 * plain


def test_fewer_nics_per_node_slow_only_the_collectives_that_cross_nodes():
    four = dataclasses.replace(DGX_H100, nics_per_node=4, nic_bandwidth=25e9)  # 4 x 200 Gb/s
    busbw = collectives.bus_bandwidth("all-reduce", 8 << 30, Group(16, 2, 8), four)
    assert busbw == pytest.approx(95e9, rel=0.05)  # NVIDIA/nccl-tests#252: 95 GB/s, ~24 GB/s per NIC
    assert collectives.bus_bandwidth("all-reduce", 8 << 30, Group(8), four) == collectives.bus_bandwidth(
        "all-reduce", 8 << 30, Group(8), DGX_H100
    )


@pytest.mark.parametrize(
    ("text", "rate"),
    [("400Gb/s", 50e9), ("400 Gbit/s", 50e9), ("400GBIT/s", 50e9), ("400Gbps", 50e9), ("400 gbits/s", 50e9),
     ("50GB/s", 50e9), ("50 GBps", 50e9), ("50 GByte/s", 50e9), ("1.8TB/s", 1.8e12), ("5e10B/s", 50e9)],
)  # fmt: skip
def test_interconnect_rates_carry_an_unambiguous_unit(text, rate):
    assert load_config("configs/tiny.yaml", [f"interconnect.network={text}"]).interconnect.network == rate


@pytest.mark.parametrize("value", ["400", "400.0", "'400'", "400GB", "0Gb/s", "-5Gb/s", "1e-300GB/s",
                                   "infGB/s", "nanGB/s", "1e30GB/s", "true"])  # fmt: skip
def test_a_unitless_or_absurd_rate_is_an_error_naming_the_key_the_value_and_the_fix(value):
    from shardmem.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        load_config("configs/tiny.yaml", [f"interconnect.network={value}"])
    message = str(error.value)
    assert message.startswith("interconnect.network:") and "400Gb/s" in message and "50GB/s" in message
    assert "\n" not in message


def test_a_config_with_rates_round_trips_and_its_cluster_reaches_the_estimate():
    from shardmem.config import config_from_dict
    from shardmem.errors import ConfigError

    config = load_config("configs/tiny.yaml", ["interconnect.network=200Gb/s", "interconnect.nics_per_node=4",
                                               "interconnect.sharp=true", "interconnect.host=31.5GB/s"])  # fmt: skip
    assert config_from_dict(config.to_dict(), config.name) == config
    assert config.to_dict()["interconnect"]["network"] == "25GB/s"
    target = dataclasses.make_dataclass("T", ["name", "spec"])("h100-sxm", GPU_TARGETS["h100-sxm"])
    cluster = cost.Hardware.of(target, config.interconnect).cluster
    assert (cluster.nics_per_node, cluster.nic_bandwidth, cluster.sharp, cluster.nvls) == (
        4,
        25e9,
        True,
        True,
    )
    with pytest.raises(ConfigError, match="interconnect.nics_per_node=0"):
        load_config("configs/tiny.yaml", ["interconnect.nics_per_node=0"])


@pytest.fixture(scope="module")
def pipelined():
    """tiny in 2 stages x 4 micro-batches over 2 hosts, planned deviceless for H100s."""
    from shardmem.planning.memory import plan

    config = load_config("configs/tiny.yaml", [
        "mesh.axes={stage: 2, data: 2, fsdp: 1, tensor: 2}", "mesh.hosts=2", "mesh.devices_per_host=4",
        "rules.layers=stage", "train.micro_batches=4", "remat.policy=full", "remat.layers={}",
        "precision.compute=bfloat16",
    ])  # fmt: skip
    return plan(config, "h100-sxm")


def test_every_gpu_plan_predicts_its_step_time(pipelined):
    st = pipelined.step_time
    assert st is not None and st.hardware == "h100-sxm"
    assert sum(st.breakdown().values()) == pytest.approx(st.seconds)
    assert st.full_overlap_seconds <= st.seconds <= st.no_overlap_seconds
    assert st.tokens_per_second == pytest.approx(16 * 64 / st.seconds)  # global_batch x seq_len
    assert 0 < st.mfu <= st.hfu  # full remat recomputes: hardware FLOPs exceed the model's
    assert {c.link for c in st.collectives} == {"nvlink", "network"}  # stage spans the hosts
    assert all(c.algorithm for c in st.collectives)  # costed as NCCL runs them
    data = json.loads(json.dumps(pipelined.to_json()))["step_time"]
    assert set(data["breakdown"]) == {"compute", "memory_bound", "launch", "exposed_communication",
                                      "exposed_host_transfers"}  # fmt: skip
    assert data["bounds"]["no_overlap"] >= data["seconds"]


def test_the_plan_reports_the_links_and_cluster_it_used_in_finite_json(pipelined):
    from shardmem.planning.report import render

    links = pipelined.step_time.to_json()["links"]
    assert links["description"].startswith("2 nodes x 4 GPUs; per node 4 x 400 Gb/s NICs")
    assert (links["nics_per_node"], links["network_bandwidth"], links["nvls"]) == (4, 50e9, True)
    json.dumps(pipelined.to_json(), allow_nan=False)  # finite: no Infinity or NaN
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render(pipelined))
    assert "links: 2 nodes x 4 GPUs" in console.export_text()


def test_the_replayed_kernels_do_the_programs_flops():
    from shardmem.planning.memory import plan

    report = plan(load_config("configs/tiny.yaml", ["precision.compute=bfloat16"]), "h100-sxm")
    assert report.step_time.kernel_flops == pytest.approx(report.flops_per_step / report.devices, rel=1e-9)


def test_the_bubble_is_the_schedules_idle_share_of_the_pipeline_loops(pipelined):
    st, schedule = pipelined.step_time, pipelined.pipeline
    assert schedule["bubble_fraction"] == pytest.approx((2 - 1) / (4 + 2 - 1))
    # GPipe's forward and backward loops of ticks, each idle for the same share (not the layers inside).
    ticks = [loop for loop in st.loops if loop.scope in ("pipeline", "pipeline (backward)")]
    # XLA's while-loop double buffering (planning/overlap.py) runs two ticks a trip, the odd one peeled.
    assert len(ticks) == 2 and all(loop.trips in (4 + 2 - 1, (4 + 2 - 1) // 2) for loop in ticks), ticks
    total = sum(loop.trips * loop.seconds_per_trip for loop in ticks)
    assert st.bubble == pytest.approx(schedule["bubble_fraction"] * total)


def test_cpu_plans_rank_layouts_with_this_machines_measured_rates():
    from shardmem.planning.memory import plan

    report = plan(load_config("configs/tiny.yaml", ["mesh.axes={data: 1, fsdp: 1, tensor: 1}"]), "cpu")
    st = report.step_time
    assert st.hardware.startswith("cpu") and st.seconds > 0 and st.uncertainty is None
    assert "approximate" in report.step_time_note and "sweep --measure" in report.step_time_note
    hardware = cost.Hardware.host(8)
    assert hardware.peak("f32") == pytest.approx(
        cost.Hardware.host(1).peak("f32") / 8
    )  # the cores are shared


def test_a_slow_compile_of_a_program_without_loops_says_to_scan_the_layers():
    from shardmem.planning.memory import SLOW_COMPILE_SECONDS, MemoryReport, _slow_compile_warnings

    unrolled = _module("  %d = f32[8]{0} add(%a, %a)")
    looped = _module(
        '  %w = f32[8]{0} while(%a), condition=%c, body=%b, backend_config={"known_trip_count":{"n":"4"}}'
    )
    fields = {f.name: None for f in dataclasses.fields(MemoryReport)}

    def report(module, seconds):
        return MemoryReport(**{**fields, "module": module, "compile_seconds": seconds})

    assert "scan them" in _slow_compile_warnings(report(unrolled, SLOW_COMPILE_SECONDS + 1))[0]
    assert not _slow_compile_warnings(report(unrolled, 1.0))
    assert not _slow_compile_warnings(report(looped, SLOW_COMPILE_SECONDS + 1))


def test_the_timeline_says_what_the_step_it_draws_costs_in_time(pipelined):
    from shardmem.planning.timeline import timeline

    page = timeline(pipelined).to_html()
    assert "predicted step time" in page and "tokens/s" in page


def test_plan_refuses_a_bare_number_for_a_rate_in_one_line(capsys):
    from shardmem.cli import main

    code = main(
        ["plan", "configs/tiny.yaml", "--target", "h100-sxm", "--json", "--set", "interconnect.network=400"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "interconnect.network: 400 has no unit" in err and "400Gb/s" in err


def test_host_rates_are_pinned_by_the_environment_and_shared_with_a_search_s_workers(monkeypatch):
    """CPU plans cost the step with this machine's rates: SHARDMEM_HOST_RATES pins them (two runs then
    agree), a malformed value is one line naming it, and a search's worker processes get the parent's
    measured rates rather than measuring their own (their candidates' step times differed by the load)."""
    from shardmem.errors import ConfigError
    from shardmem.explore.sweep import planning_pool

    monkeypatch.setenv(cost.HOST_RATES_ENV, "8e10,2e10")
    assert cost.host_rates() == (8e10, 2e10) and cost.Hardware.host(8).peak("f32") == 1e10
    for bad in ("fast", "8e10", "8e10,-1", "inf,1e9"):
        monkeypatch.setenv(cost.HOST_RATES_ENV, bad)
        with pytest.raises(ConfigError, match=rf"SHARDMEM_HOST_RATES='{re.escape(bad)}': write two positive"):
            cost.host_rates()
    monkeypatch.delenv(cost.HOST_RATES_ENV)
    monkeypatch.setattr(cost, "measure_host_rates", lambda: (1.5e10, 3.25e9))  # the parent's measurement
    with planning_pool(load_config("configs/tiny.yaml"), "cpu", 1, 8) as pool:
        assert pool.submit(cost.host_rates).result() == (1.5e10, 3.25e9)


def test_measuring_the_host_rates_first_starts_jax_quietly():
    # A sweep's (and tune --search layout's) parent measures the rates before it plans anything, and so
    # started JAX's backends there: the CUDA plugin's C++ complaint ("Could not find cuda drivers", with
    # absl's preamble) reached the terminal above the sweep's table.
    import subprocess
    import sys

    code = "import shardmem\nfrom shardmem.planning import cost\nprint(cost.measure_host_rates())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr == "", done.stderr


# --- GEMMs on a GPU: waves of tiles over the SMs ---------------------------------------------------

_A100 = GPU_TARGETS["a100-80g"]
A100 = cost.Hardware(
    "a100-80g", _A100.peak_flops, _A100.memory_bandwidth, 300e9, 25e9, 32e9, sms=_A100.sm_count
)
_RATE = _A100.peak_flops["f16"] * cost.MATMUL_EFFICIENCY  # A whole large GEMM's FLOP/s.
_BANDWIDTH = _A100.memory_bandwidth * cost.MEMORY_EFFICIENCY


def _gemm_module(m: int, n: int, k: int) -> hlo.HloModule:
    """A prefill's projection as XLA's GPU compiler writes it: a Triton GEMM fusion of [m,k] x [k,n]."""
    return hlo.parse_module(f"""HloModule m

%gemm_fusion_dot_computation (p0: f16[{m},{k}], p1: f16[{k},{n}]) -> f16[{m},{n}] {{
  %p0 = f16[{m},{k}]{{1,0}} parameter(0)
  %p1 = f16[{k},{n}]{{1,0}} parameter(1)
  ROOT %dot = f16[{m},{n}]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

ENTRY %main (x: f16[{m},{k}], w: f16[{k},{n}]) -> f16[{m},{n}] {{
  %x = f16[{m},{k}]{{1,0}} parameter(0)
  %w = f16[{k},{n}]{{1,0}} parameter(1)
  ROOT %y = f16[{m},{n}]{{1,0}} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion_dot_computation, backend_config={{"fusion_backend_config":{{"kind":"__triton_gemm"}}}}
}}
""")


def _compute(module: hlo.HloModule, hardware=A100) -> float:
    return cost.estimate_step_time(module, hardware, [0]).compute


def test_a_gemm_of_few_rows_leaves_sms_idle_in_its_one_wave_of_tiles(monkeypatch):
    # 128 rows x 8192 columns in 128 x 128 tiles: 64 blocks for the A100's 108 SMs, one wave with 44
    # SMs idle, so the GEMM takes one tile's time on one SM: 108/64 of its FLOPs at the whole GPU's rate.
    monkeypatch.setattr(cost, "GEMM_TILES", ((128, 128),))
    monkeypatch.setattr(cost, "SPLIT_K", (1,))
    m, n, k = 128, 8192, 8192
    one_tile = 2.0 * 128 * 128 * k / (_RATE / 108)
    weights = 2 * (m * k + k * n + m * n) / _BANDWIDTH
    assert one_tile > weights > 2.0 * m * n * k / _RATE  # The roofline would charge the weights' bytes.
    assert _compute(_gemm_module(m, n, k)) == pytest.approx(one_tile)
    # Twice the rows fill the same wave's blocks twice as tall: 128 blocks, two waves.
    assert _compute(_gemm_module(2 * m, n, k)) == pytest.approx(2 * one_tile)


def test_split_k_fills_the_sms_and_pays_for_its_f32_partials_in_memory(monkeypatch):
    monkeypatch.setattr(cost, "GEMM_TILES", ((128, 128),))
    monkeypatch.setattr(cost, "SPLIT_K", (1, 8))
    m, n, k = 128, 1024, 65536  # 8 tiles; split 8 ways, 64 blocks of 8192 deep: one wave.
    split = 2.0 * 128 * 128 * (k // 8) / (_RATE / 108)
    partials = 2 * 4 * 8 * m * n  # Eight f32 partials written, then read by the sum.
    memory = (2 * (m * k + k * n + m * n) + partials) / _BANDWIDTH
    assert _compute(_gemm_module(m, n, k)) == pytest.approx(max(split, memory) + cost.KERNEL_GAP)
    assert max(split, memory) + cost.KERNEL_GAP < 8 * split  # Unsplit: 8 blocks of the whole depth.


def test_large_gemms_keep_the_measured_rate_and_skinny_ones_are_slower_than_the_roofline():
    # The 8192^3 matmul the 0.80 was measured on fills its waves: within 0.2% of the roofline on an
    # H200 (132 SMs) and an A100, with the whole catalogue of tiles and splits.
    h200 = GPU_TARGETS["h200"]
    hardware = cost.Hardware(
        "h200", h200.peak_flops, h200.memory_bandwidth, 450e9, 50e9, 64e9, sms=h200.sm_count
    )
    big = _gemm_module(8192, 8192, 8192)
    for gpu, rate in ((hardware, h200.peak_flops["f16"]), (A100, _A100.peak_flops["f16"])):
        assert _compute(big, gpu) == pytest.approx(2.0 * 8192**3 / (rate * cost.MATMUL_EFFICIENCY), rel=2e-3)
    # A 128-token prefill's MLP projection (Llama 2 7B) on the A100: no tile and split of the catalogue
    # fills the SMs without more HBM traffic, so it is slower than its roofline (51 us of weights).
    roofline = cost.estimate_step_time(
        _gemm_module(128, 11008, 4096), dataclasses.replace(A100, sms=None), [0]
    )
    assert _compute(_gemm_module(128, 11008, 4096)) > 1.05 * roofline.compute


def test_a_cublas_call_and_a_batched_dot_are_read_as_gemms():
    kernels = cost._Kernels(
        hlo.parse_module("""HloModule m

ENTRY %main (x: f16[4,128,2752], w: f16[4,2752,4096]) -> f16[4,128,4096] {
  %x = f16[4,128,2752]{2,1,0} parameter(0)
  %w = f16[4,2752,4096]{2,1,0} parameter(1)
  %c = (f16[4,128,4096]{2,1,0}, s8[1024]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["2"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":["0"],"rhs_batch_dimensions":["0"]}}}
  ROOT %d = f32[4,128,4096]{2,1,0} dot(%x, %w), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}
"""),
        A100,
        {},
    )
    for name in ("c", "d"):
        assert kernels.gemm(kernels.module.by_name[name]) == cost.Gemm(batch=4, m=128, n=4096, k=2752)
    assert cost.Hardware.of(resolve_target("a100-80g", n_devices=1)).sms == 108
