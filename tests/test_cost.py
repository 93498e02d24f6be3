# ruff: noqa: E501  (HLO text is copied as XLA writes it)
"""The step-time model: each piece against hand arithmetic on HLO written out, then whole plans."""

import dataclasses
import json
import re

import pytest

from shardmem.config import load_config
from shardmem.planning import cost, hlo
from shardmem.planning.targets import GPU_TARGETS

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
    data = json.loads(json.dumps(pipelined.to_json()))["step_time"]
    assert set(data["breakdown"]) == {"compute", "memory_bound", "launch", "exposed_communication",
                                      "exposed_host_transfers"}  # fmt: skip
    assert data["bounds"]["no_overlap"] >= data["seconds"]


def test_the_replayed_kernels_do_the_programs_flops():
    from shardmem.planning.memory import plan

    report = plan(load_config("configs/tiny.yaml", ["precision.compute=bfloat16"]), "h100-sxm")
    assert report.step_time.kernel_flops == pytest.approx(report.flops_per_step / report.devices, rel=1e-9)


def test_the_bubble_is_the_schedules_idle_share_of_the_pipeline_loop(pipelined):
    st, schedule = pipelined.step_time, pipelined.pipeline
    assert schedule["bubble_fraction"] == pytest.approx((2 - 1) / (4 + 2 - 1))
    ticks = [loop for loop in st.loops if "pipeline" in loop.scope]
    loop = max(ticks, key=lambda t: t.trips * t.seconds_per_trip)
    assert st.bubble == pytest.approx(schedule["bubble_fraction"] * loop.trips * loop.seconds_per_trip)


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
