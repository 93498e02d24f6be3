# ruff: noqa: E501  (HLO text is copied as XLA writes it)
"""Deviceless Cloud TPU targets: slices from their names, plans compiled by libtpu on this CPU machine
(CI installs the ``tpu`` extra), exact per-chip bytes, the verdict around a v5e chip's 16 GiB."""

import collections
import importlib.util
import json
from pathlib import Path

import pytest

import shardmem
from shardmem.cli import main
from shardmem.config import config_from_dict
from shardmem.errors import ConfigError, DoesNotFit, PlanError
from shardmem.models.llama import ModelConfig
from shardmem.planning import cost, hlo, targets
from shardmem.planning.targets import TPU_TARGETS, link_domains, resolve_target, tpu_slice

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason='libtpu is not installed: pip install -e ".[tpu]"'
)

# Dimensions in whole TPU tiles (128 lanes), so that the only padding is the scalars'.
_MODEL = {"vocab_size": 512, "d_model": 256, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "d_ff": 512,
          "seq_len": 128}  # fmt: skip


def _config(target: str, model=None, **sections):
    return config_from_dict({
        "model": model or _MODEL,
        "mesh": {"axes": {"fsdp": -1}},
        "train": {"global_batch": 8},
        "precision": {"params": "float32", "compute": "bfloat16"},
        "memory": {"target": target},
        **sections,
    })  # fmt: skip


def test_slice_names_count_tensorcores_on_v4_and_v5p_and_chips_on_v5e_and_v6e():
    assert tpu_slice("v5p-8") == ("tpu-v5p", 4, 1)
    assert tpu_slice("v4-16") == ("tpu-v4", 8, 1)
    assert tpu_slice("v6e-8") == ("tpu-v6e", 8, 1)
    assert tpu_slice("v5litepod-16") == ("tpu-v5e", 16, 1)
    assert tpu_slice("2xv5e-16") == ("tpu-v5e", 16, 2)
    assert tpu_slice("h100-sxm") is None
    with pytest.raises(ConfigError, match=r"'v5p-7'.*count TensorCores, 2 per chip.*v5p-8 is 4 chips"):
        tpu_slice("v5p-7")
    with pytest.raises(ConfigError, match=r"12 chips per slice is no v5e slice shape.*v5e-\{1, 4, 8, 16"):
        resolve_target("v5e-12")
    with pytest.raises(ConfigError, match=r"'tpu-v6e' needs a chip count"):
        resolve_target("tpu-v6e")


def test_a_multi_host_slice_is_one_ici_domain_and_slices_meet_over_dcn():
    # v5p-64: 32 chips in a 2x4x4 torus, on 8 TPU VMs of 4 chips each, every chip on ICI.
    v5p = resolve_target("v5p-64")
    assert len(v5p.devices) == 32 and v5p.devices[0].device_kind == "TPU v5"
    assert collections.Counter(d.process_index for d in v5p.devices) == {i: 4 for i in range(8)}
    assert set(link_domains(v5p.devices)) == {0}
    assert v5p.label == "32 x TPU v5 (2x4x4, 8 TPU VMs), deviceless"
    assert v5p.memory_bytes == 95 << 30 and v5p.peak_flops == 459e12
    # A v6e-8 is one host of 8 chips; a v5e-16 four VMs of 4.
    assert len({d.process_index for d in resolve_target("v6e-8").devices}) == 1
    assert len({d.process_index for d in resolve_target("v5e-16").devices}) == 4
    # Two v5e-16 slices: 32 chips, two link domains of 16 (the step-time model's slow link is DCN).
    two = resolve_target("2xv5e-16")
    assert collections.Counter(link_domains(two.devices)) == {0: 16, 1: 16}


def test_without_libtpu_a_tpu_target_is_one_line_saying_what_to_install(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(targets.importlib.util, "find_spec", lambda n: None if n == "libtpu" else real(n))
    targets._tpu_topology.cache_clear()
    try:
        with pytest.raises(PlanError, match=r"not installed: pip install -e \"\.\[tpu\]\""):
            resolve_target("v5e-4")
        assert main(["plan", "configs/tiny.yaml", "--target", "v5e-4"]) == 2
    finally:
        targets._tpu_topology.cache_clear()
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "libtpu" in err and "jax[tpu]" in err


@pytest.mark.newest
def test_plan_on_a_v5e_slice_gives_exact_per_chip_bytes_and_the_same_api_as_gpus():
    report = shardmem.plan(_config("v5e-4"))
    assert report.devices == 4 and report.target == "tpu-v5e" and not report.approximate
    # float32, FSDP over 4 chips; the RMSNorm scales (two a layer and the final one) are replicated.
    norms = (2 * _MODEL["n_layers"] + 1) * _MODEL["d_model"]
    per_chip = (ModelConfig(**_MODEL).param_count() - norms) * 4 // 4 + norms * 4
    assert report.per_device["params"] == per_chip
    # Adam's mu and nu, and three int32 scalars: Adam's and the learning-rate schedule's counts, the step.
    assert report.per_device["optimizer"] == 2 * per_chip + 3 * 4
    # XLA's arguments are the same bytes padded to TPU tiles (the batch and the two scalars here).
    assert report.cross_check["matches"] and report.cross_check["tile_padding_bytes"] > 0
    assert report.device_memory_bytes == 16 << 30 and report.fits
    assert any("TPU, deviceless" in w and "memory.reserve" in w for w in report.warnings)
    # The step-time model reads the TPU's spec, and counts every trip of the layer scan.
    assert report.step_time is not None and report.step_time.uncertainty is None
    assert any(loop.trips == _MODEL["n_layers"] for loop in report.step_time.loops)
    # It counts the matmuls libtpu wrote as convolutions by their real taps: the jaxpr's FLOPs, but for the
    # few small products the TPU compiler turns into other kernels (2% here, none at llama-7b's widths).
    assert report.step_time.kernel_flops == pytest.approx(report.flops_per_step / 4, rel=0.05)
    assert {c.link for c in report.step_time.collectives} == {"nvlink"}  # One slice: all ICI.
    json.dumps(report.to_json())


@pytest.mark.newest
def test_a_step_libtpu_refuses_as_over_the_chips_hbm_is_a_verdict_exit_3(monkeypatch, capsys):
    # XLA's TPU compiler fails on a program over the chip's HBM (RESOURCE_EXHAUSTED), as llama-7b does on a
    # v5e-16 (23.52G of temporaries over 15.75G); simulated here, the real one takes a minute to fail.
    from shardmem.planning import memory

    message = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
               "(23.52G) exceeds available HBM (15.75G).")  # fmt: skip

    def compile_(traced, options, dump):
        raise RuntimeError(message)

    monkeypatch.setattr(memory, "_compile", compile_)
    with pytest.raises(
        DoesNotFit, match=r"does not fit on 4 x TPU v5 lite.*exceeds available HBM \(15.75G\)"
    ):
        shardmem.plan(_config("v5e-4"))
    args = ["plan", "configs/tiny.yaml", "--target", "v5e-4", "--set", "precision.compute=bfloat16"]
    assert main(args) == 3
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.count("\n") == 0 and "does not fit" in err and "shardmem tune" in err
    # What is known per chip without the compile: the shapes' bytes, and libtpu's figures (issue 41).
    tiny = shardmem.load_config("configs/tiny.yaml", ["precision.compute=bfloat16"])
    program = shardmem.build_program(
        tiny, shardmem.build_mesh(tiny.mesh.axes, resolve_target("v5e-4").devices)
    )
    params = memory.per_device_bytes(program.abstract_state["params"])
    lines = {line.split("│")[0].strip(): line for line in captured.out.splitlines()}
    assert "libtpu refused the step; per chip" in captured.out
    assert shardmem.units.format_bytes(params) in lines["parameters"], captured.out
    assert "23.52 GiB" in lines["temporaries (HLO temporaries, libtpu)"]
    assert "15.75 GiB" in lines["available HBM (libtpu)"]
    assert all(key in lines for key in ("optimizer state", "batch"))
    # With --json, the verdict as JSON too, as a GPU plan that does not fit gives it (issue 30, item 9).
    assert main([*args, "--json"]) == 3
    captured = capsys.readouterr()
    verdict = json.loads(captured.out)
    assert verdict["fits"] is False and verdict["target"] == "v5e-4" and verdict["refused_by_compiler"]
    assert (verdict["required_bytes"], verdict["available_bytes"]) == (int(23.52 * 2**30), int(15.75 * 2**30))
    assert verdict["per_device"]["params"] == params and verdict["per_device"]["temp"] == int(23.52 * 2**30)
    assert {"optimizer", "batch"} <= set(verdict["per_device"])
    assert captured.err.count("\n") == 1 and "does not fit" in captured.err


@pytest.mark.newest
def test_two_slices_put_the_data_axis_across_them():
    config = _config("2xv5e-4", mesh={"axes": {"data": 2, "fsdp": 4}}, rules={"batch": ["data", "fsdp"]})
    report = shardmem.plan(config)
    assert report.devices == 8 and "2 slices of 2x2 over DCN" in report.target_label
    mesh = shardmem.build_mesh({"data": 2, "fsdp": 4}, resolve_target("2xv5e-4").devices)
    assert [sorted(set(link_domains(row))) for row in mesh.devices] == [[0], [1]]  # data: across slices
    # Inside a slice the collectives are XLA's (over ICI); between slices libtpu lowers the gradients'
    # all-reduce to MegaScale sends over DCN, one peer per slice.
    links = {(c.kind, c.group_size, c.link) for c in report.step_time.collectives}
    assert ("all-reduce", 2, "network") in links and any(link == "nvlink" for *_, link in links)
    assert "MegaScale sends over DCN" in report.step_time_note
    assert report.collectives["all-reduce"] > 0


@pytest.mark.slow  # About 30 s each on the 2-core machine: libtpu's compile time grows with the arrays.
@pytest.mark.parametrize("vocab_size, fits", [(262144, True), (393216, False)])
def test_verdict_around_a_v5e_chips_16_gib(vocab_size, fits):
    # One v5e chip, float32 with Adam (16 bytes a parameter), the parameters mostly in the two embedding
    # tables: 562M of them (8.4 GiB) fit the 11.55 GiB budget, 830M (12.4 GiB) do not.
    model = {**_MODEL, "vocab_size": vocab_size, "d_model": 1024, "n_layers": 1, "n_heads": 8,
             "n_kv_heads": 8, "d_ff": 2048}  # fmt: skip
    config = _config("tpu-v5e", model=model, mesh={"axes": {"fsdp": 1}}, train={"global_batch": 1})
    report = shardmem.plan(config)
    assert report.devices == 1 and report.target_label.startswith("1 x TPU v5 lite (1x1")
    assert abs(report.budget_bytes - (16 * 0.9 - 1) * (1 << 30) / 1.16) < 2  # float rounding
    assert report.per_device["params"] == ModelConfig(**model).param_count() * 4
    assert report.fits is fits


@pytest.mark.newest
def test_plan_cli_on_a_tpu_slice_exits_by_the_verdict(capsys):
    args = ["plan", "configs/tiny.yaml", "--target", "v6e-4", "--set", "precision.compute=bfloat16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "tpu-v6e: 4 x TPU v6 lite (2x2, 1 TPU VM), deviceless" in out and "FITS" in out
    assert set(TPU_TARGETS) <= set(shardmem.planning.targets.TARGET_NAMES)


def _kernel(body: str) -> tuple[cost._Kernels, hlo.Instruction]:
    module = hlo.parse_module(f"HloModule m\n\nENTRY %main (a: f32[8]) -> f32[8] {{\n{body}\n}}\n")
    hardware = cost.Hardware.of(resolve_target("v5e-4"))
    return cost._Kernels(module, hardware, {}), module.by_name["c"]


@pytest.mark.newest
@pytest.mark.parametrize(
    "lhs, rhs, conv, flops",
    [
        # XLA's TPU compiler writes a projection [tokens, d] x [d, heads, head_dim] as a convolution whose
        # heads are a window of 32 over 63 padded positions: one real tap per output.
        ("bf16[4,4096,4096,1]{2,1,3,0}", "bf16[4096,32,128,1]{0,2,1,3}",
         "bf16[4,4096,32,128]{1,3,2,0} convolution(%l, %r), window={size=1x32 pad=0_0x31_31 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f",
         2 * 4 * 4096 * 4096 * 32 * 128),
        # ... and a batched product (queries x keys per batch and head) with the batch as a dilation.
        ("bf16[4,4096,32,128]{3,1,2,0}", "bf16[4,512,32,128]{3,1,2,0}",
         "bf16[4,32,4096,512]{3,2,1,0} convolution(%l, %r), window={size=4x32 stride=3x31 lhs_dilate=4x32}, dim_labels=0b1f_0o1i->01bf",
         2 * 4 * 32 * 4096 * 512 * 128),
        # A real 1-D convolution, 3 taps, unpadded: every tap is real.
        ("f32[8,16,100]{2,1,0}", "f32[3,16,32]{2,1,0}",
         "f32[8,32,98]{2,1,0} convolution(%l, %r), window={size=3}, dim_labels=bf0_0io->bf0",
         2 * 8 * 32 * 98 * 16 * 3),
        # Padded to keep its length: the two edge outputs have 2 real taps, not 3.
        ("f32[8,16,100]{2,1,0}", "f32[3,16,32]{2,1,0}",
         "f32[8,32,100]{2,1,0} convolution(%l, %r), window={size=3 pad=1_1}, dim_labels=bf0_0io->bf0",
         2 * 8 * 32 * 16 * (100 * 3 - 2)),
    ],
)  # fmt: skip
def test_a_convolution_counts_only_the_window_taps_on_real_input(lhs, rhs, conv, flops):
    kernels, ins = _kernel(f"  %l = {lhs} parameter(0)\n  %r = {rhs} parameter(1)\n  %c = {conv}")
    assert kernels.flops(ins)[0] == flops


@pytest.mark.newest
def test_a_megascale_send_is_a_collective_over_dcn_between_the_slices():
    attributes = ('is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",'
                  '_xla_megascale_reduce_operation="SUM",_xla_megascale_transfer_type="ALL_REDUCE"}')  # fmt: skip
    body = (f"  %g = f32[8388608]{{0}} parameter(0)\n  %t = token[] after-all()\n"
            f"  %c = (f32[8388608]{{0}}, u32[], token[]) send(%g, %t), channel_id=2, {attributes}\n"
            f"  %r = (f32[8388608]{{0}}, u32[], token[]) recv(%t), channel_id=1, {attributes}\n"
            f"  %sd = token[] send-done(%c), channel_id=2, is_host_transfer=true\n"
            f"  %rd = (f32[8388608]{{0}}, token[]) recv-done(%r), channel_id=1, is_host_transfer=true")  # fmt: skip
    kernels, send = _kernel(body)
    assert (
        hlo.collective_kind(send) == "all-reduce"
        and hlo.collective_bytes(kernels.module)["all-reduce"] == 32 << 20
    )
    estimate = cost.estimate_step_time(kernels.module, kernels.hardware, [0, 0, 0, 0, 1, 1, 1, 1])
    [collective] = estimate.collectives
    assert (collective.kind, collective.group_size, collective.link) == ("all-reduce", 2, "network")
    # A ring over 2 slices moves 2 (n - 1) / n of the bytes at DCN's achieved rate; nothing hides it.
    dcn = kernels.hardware.link("network")
    assert estimate.exposed_communication == pytest.approx(
        cost.COLLECTIVE_LATENCY["network"] + (32 << 20) / dcn
    )


def test_tune_reads_a_candidate_libtpu_refuses_as_one_that_does_not_fit(monkeypatch, tmp_path, capsys):
    # libtpu refuses a step over the chip's HBM instead of compiling it (simulated for remat "none"; a real
    # refusal needs a model that takes minutes to compile here): tune goes on to the policies that compile.
    from shardmem.explore import search
    from shardmem.explore import tune as tuning

    real = search.plan

    refusal = DoesNotFit(
        "does not fit: libtpu's compiler says ... (23.52G) exceeds available HBM (15.75G).",
        required_bytes=round(23.52 * (1 << 30)),
        available_bytes=round(15.75 * (1 << 30)),
    )

    def plan(config, target=None, **kwargs):
        if config.remat.policy == "none":
            raise refusal
        return real(config, target, **kwargs)

    monkeypatch.setattr(search, "plan", plan)  # What the planner compiles each candidate with.
    result = tuning.tune(_config("v5e-4", remat={"policy": "none"}), search="remat")
    assert result.found and result.config.remat.policy != "none" and result.report.fits
    refused = next(t for t in result.trials if t.candidate == "none")
    assert (refused.how, refused.fits, refused.peak_bytes) == ("compiled", False, round(23.52 * (1 << 30)))
    assert "libtpu refused it: 23.52 GiB needed" in refused.reason
    assert result.compiles <= 12
    # A sweep's row for it says the same, and does not count as a config error.
    from shardmem.explore.sweep import plan_candidate

    def plan_program(*args, **kwargs):
        raise refusal

    monkeypatch.setattr("shardmem.planning.memory.plan_program", plan_program)
    row = plan_candidate(_config("v5e-4"), ("remat.policy=none",), None)
    assert (row.fits, row.peak_bytes, row.config_error) == (False, refusal.required_bytes, False)
    assert "libtpu's compiler says" in row.error
    # And a sweep whose every candidate it refused exits 3, as plan does: a verdict, not a failure.
    from shardmem.cli import main

    config = str(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml")
    args = ["sweep", config, "--grid", "remat.policy=none,full", "--target", "v5e-4", "--jobs", "1"]
    assert main([*args, "--out", str(tmp_path)]) == 3
    assert "no candidate fits; see their errors" in capsys.readouterr().err


def test_a_peak_at_the_chips_hbm_says_the_compiler_fitted_it_itself():
    target, memory = resolve_target("v5e-4"), _config("v5e-4").memory
    assert len(targets.tpu_notes(target, memory, target.memory_bytes // 2)) == 1
    [_, at_hbm] = targets.tpu_notes(target, memory, int(target.memory_bytes * 0.9999))
    assert "at the chip's HBM (100.0%)" in at_hbm and "rematerializes and reschedules on its own" in at_hbm
    assert targets.tpu_notes(resolve_target("h100-sxm", n_devices=1), memory, 1 << 40) == []


@pytest.mark.newest
def test_host_offload_compiles_to_the_tpu_hosts_pinned_memory():
    report = shardmem.plan(_config("v5e-4", memory={"target": "v5e-4", "offload_optimizer": True}))
    # Adam's mu and nu leave the chip for its host: two float32 copies of each chip's parameter shard.
    norms = (2 * _MODEL["n_layers"] + 1) * _MODEL["d_model"]
    per_chip = (ModelConfig(**_MODEL).param_count() - norms) * 4 // 4 + norms * 4
    assert report.per_device["host"] >= 2 * per_chip and report.fits
    assert report.step_time.host_transfer_bytes > 0  # TPU layouts write host memory after the tiles
    # This small step's weight gathers are libtpu's own collectives, which the estimate cannot cost.
    assert "AsyncCollectiveStart" in report.step_time_note


@pytest.mark.newest
def test_a_tpu_target_starts_jax_quietly(tmp_path):
    # Issue 30, item 9: every TPU plan (and every tune worker) printed absl's and the CUDA plugin's C++
    # start-up lines, as JAX's backends started mid-plan, after the silenced topology.
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "tpu.py"
    script.write_text("import shardmem, jax, jax.numpy as jnp\n"
                      "from shardmem.planning.targets import resolve_target\n"
                      "resolve_target('v5e-4')\n"
                      "jax.jit(lambda x: x + 1).lower(jnp.float32(1))\n")  # fmt: skip
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[1])  # fmt: skip
    assert done.returncode == 0 and done.stderr == "", done.stderr
