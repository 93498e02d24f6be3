"""bench/gpu_validate.py: the CPU dry run end to end, and the verdict logic on hand-made results."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_validate", ROOT / "bench" / "gpu_validate.py")
gv = importlib.util.module_from_spec(_spec)
sys.modules["gpu_validate"] = gv  # dataclasses look their module up there.
_spec.loader.exec_module(gv)

GIB = 2**30


@pytest.mark.slow
def test_cpu_dry_run_writes_well_formed_results(tmp_path):
    trials = ("tiny-offload",)  # One trial keeps this under a minute on two shared cores.
    # A CPU compile dumps no autotune results; an empty results file (what XLA writes when it tuned
    # nothing) stands in, so that the deviceless plan that loads them runs for real.
    (tmp_path / "autotune").mkdir()
    (tmp_path / "autotune" / "tiny-offload.textproto").write_text("version: 3\n")
    argv = [sys.executable, str(ROOT / "bench" / "gpu_validate.py"), "--cpu", "--out", str(tmp_path),
            "--steps", "2", "--jobs", "2", "--autotune-off", "--autotune-results",
            *(a for t in trials for a in ("--only", t))]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]

    payload = json.loads((tmp_path / "gpu_validate.json").read_text())
    assert payload["meta"]["platform"] == "cpu"
    assert payload["meta"]["twin"] == "h200"
    assert [row["trial"] for row in payload["rows"]] == list(trials)
    for row in payload["rows"]:
        local, twin = row["plans"]["local"], row["plans"]["twin"]
        assert local["status"] == twin["status"] == row["plans"]["local-autotune-off"]["status"] == "ok"
        assert local["target"] == "local" and twin["target"] == "h200"
        assert "deviceless" in twin["target_label"]
        for plan in (local, twin):
            assert plan["peak_bytes"] > plan["per_device"]["params"] > 0
            assert plan["fits"] is True and plan["flops_per_step"] > 0
        measured = row["measured"]
        assert measured["status"] == "ok", measured
        assert len(measured["step_s"]) == 2 and measured["step_s_median"] > 0
        assert measured["finite_loss"] and len(measured["losses"]) == 2
        assert measured.get("peak_bytes_in_use") is None  # memory_stats() is None on CPU.
        assert row["measured_over_predicted"] == {}
        assert row["tokens_per_s"] == pytest.approx(measured["tokens_per_step"] / measured["step_s_median"])
        assert row["mfu"] is None  # No peak FLOP/s for a CPU.
        tuned = row["plans"]["twin-autotuned"]
        assert tuned["status"] == "ok" and tuned["target"] == "h200", tuned
        assert tuned["peak_bytes"] == twin["peak_bytes"]  # No results to apply: the same program.
    offload = payload["rows"][0]["plans"]["twin"]
    assert offload["remat"].endswith("offload") and offload["per_device"]["host"] > 0
    assert [bar["result"] for bar in payload["bars"]] == ["N/A"] * 3

    table = (tmp_path / "gpu_validate.md").read_text()
    assert table.startswith("CPU dry run (not a GPU result)")
    assert "| tiny-offload | offload |" in table and "MiB" in table
    assert "| bar | result | detail |" in table
    assert "| tiny-offload | " in table.split("local, autotune off")[1]
    assert "| tiny-offload | " in table.split("with the GPU's autotune results")[1]


def test_is_oom_recognises_xla_and_cuda_messages():
    assert gv.is_oom("jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying")
    assert gv.is_oom("CUDA_ERROR_OUT_OF_MEMORY: out of memory")
    assert not gv.is_oom("INVALID_ARGUMENT: shapes do not match")


def test_twin_target_from_device_kind():
    assert gv.twin_target("NVIDIA H200") == "h200"
    assert gv.twin_target("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert gv.twin_target("NVIDIA H100 PCIe") == "h100-pcie"
    assert gv.twin_target("NVIDIA A100-SXM4-40GB") == "a100-40g"
    assert gv.twin_target("cpu") is None


def _plan(peak_gib, fits, flops=1e15, no_remat=None):
    return {"status": "ok", "peak_bytes": int(peak_gib * GIB), "fits": fits, "flops_per_step": flops,
            "flops_no_remat": no_remat, "remat": "0-3: none"}  # fmt: skip


def _ran(peak_gib, step_s=0.5, tokens=8192):
    return {"status": "ok", "peak_bytes_in_use": int(peak_gib * GIB), "step_s_median": step_s,
            "tokens_per_step": tokens}  # fmt: skip


def _row(name, local, twin, measured, role=""):
    return gv.summarize(gv.Trial(name, "configs/tiny.yaml", (), role), {"local": local, "twin": twin},
                        measured, peak_flops=1e15)  # fmt: skip


def test_summarize_ratios_throughput_and_mfu():
    row = _row("a", _plan(10, True, flops=4e14, no_remat=2e14), _plan(8, True), _ran(10.4, step_s=0.5))
    assert row["measured_over_predicted"]["local"] == pytest.approx(1.04, rel=1e-6)
    assert row["relative_error"]["twin"] == pytest.approx(0.3, rel=1e-6)
    assert row["tokens_per_s"] == pytest.approx(8192 / 0.5)
    assert row["mfu"] == pytest.approx(2e14 / 0.5 / 1e15)  # Model FLOPs: without recomputation.
    assert row["hfu"] == pytest.approx(4e14 / 0.5 / 1e15)


def _bars(rows):
    return {bar["bar"]: bar["result"] for bar in gv.check_bars(rows, measurable=True)}


def test_bars_pass_when_peaks_agree_and_the_pair_behaves():
    rows = [
        _row("a", _plan(10, True), _plan(10.2, True), _ran(10.3)),
        _row("fit", _plan(100, True), _plan(100, True), _ran(102), role="fits-neighbour"),
        _row("big", _plan(180, False), _plan(180, False), {"status": "oom"}, role="too-big"),
    ]
    assert set(_bars(rows).values()) == {"PASS"}


def test_bars_fail_on_a_wrong_peak_an_unexpected_oom_or_a_too_big_trial_that_runs():
    off = [_row("a", _plan(10, True), _plan(10, True), _ran(10.6))]  # 6% over the prediction.
    assert _bars(off)["measured/predicted peak within 5% (local plan)"] == "FAIL"

    rows = [
        _row("fit", _plan(100, True), _plan(100, True), {"status": "oom"}, role="fits-neighbour"),
        _row("big", _plan(180, False), _plan(180, False), _ran(170), role="too-big"),
    ]
    bars = _bars(rows)
    assert bars["no trial the plan said fits ran out of memory"] == "FAIL"
    assert bars["too-big trial fails, nearest fitting neighbour runs"] == "FAIL"


def test_markdown_lists_every_trial_and_bar():
    rows = [_row("a", _plan(10, True), _plan(10.2, True), _ran(10.3))]
    meta = {"label": "GPU validation", "device_kind": "NVIDIA H200", "platform": "gpu", "jax": "0",
            "bytes_limit": 140 * GIB, "twin": "h200", "steps": 5}  # fmt: skip
    table = gv.markdown(meta, rows, gv.check_bars(rows, measurable=True))
    line = next(x for x in table.splitlines() if x.startswith("| a |"))
    assert "10.00 GiB / 10.20 GiB" in line and "+3.0% / +1.0%" in line and "16,384" in line
    assert not math.isnan(rows[0]["mfu"])


@pytest.mark.slow
def test_plan_trial_reads_a_does_not_fit_verdict():
    too_small = ("memory.reserve=0", "memory.usable_fraction=0.000001")
    trial = gv.Trial("tiny-over", "configs/tiny.yaml", (*gv.ONE_DEVICE, *too_small))
    plan = gv.plan_trial(trial, "h200", gv.child_env(cpu=True, mem_fraction=0.95), timeout=120)
    assert plan["status"] == "ok" and plan["exit_code"] == 3, plan
    assert plan["fits"] is False and plan["peak_bytes"] > plan["budget_bytes"]


def test_autotune_off_plan_is_shown_but_not_judged():
    plans = {"local": _plan(10, True), "twin": _plan(10, True), "local-autotune-off": _plan(5, True)}
    row = gv.summarize(gv.Trial("a", "configs/tiny.yaml", ()), plans, _ran(10.1), peak_flops=1e15)
    assert row["measured_over_predicted"]["local-autotune-off"] == pytest.approx(2.02, rel=1e-6)
    bars = gv.check_bars([row], measurable=True)
    assert {b["bar"]: b["result"] for b in bars}["measured/predicted peak within 5% (local plan)"] == "PASS"
    # The diagnostic plan says it fits; the verdicts said it does not, and it ran out of memory.
    plans = {"local": _plan(90, False), "twin": _plan(90, False), "local-autotune-off": _plan(50, True)}
    oom = gv.summarize(gv.Trial("b", "configs/tiny.yaml", ()), plans, {"status": "oom"}, peak_flops=1e15)
    results = {b["bar"]: b["result"] for b in gv.check_bars([oom], measurable=True)}
    assert results["no trial the plan said fits ran out of memory"] == "PASS"
    meta = {"label": "GPU validation", "device_kind": "NVIDIA H200", "platform": "gpu", "jax": "0",
            "bytes_limit": 140 * GIB, "twin": "h200", "steps": 5}  # fmt: skip
    table = gv.markdown(meta, [row], bars)
    assert "| a | 10.00 GiB / 5.00 GiB / 10.00 GiB | 10.10 GiB |" in table


def test_attention_column_names_the_kernel_run_and_the_twin_planned():
    assert (
        gv._kernel("pallas, standing in for cudnn (which needs a GPU to compile; same memory: no L x L)")
        == "pallas for cudnn"
    )
    assert gv._kernel("chunked (blocks of 512 queries)") == "chunked"
    assert gv._kernel("") == "n/a"
    twin = {**_plan(10.2, True), "attention": "pallas, standing in for cudnn: ..."}
    row = _row("a", _plan(10, True), twin, {**_ran(10.3), "attention": "cudnn"})
    meta = {"label": "GPU validation", "device_kind": "NVIDIA H200", "platform": "gpu", "jax": "0",
            "bytes_limit": 140 * GIB, "twin": "h200", "steps": 5}  # fmt: skip
    table = gv.markdown(meta, [row], gv.check_bars([row], measurable=True))
    assert "| a | none | cudnn / pallas for cudnn | 10.00 GiB / 10.20 GiB |" in table


def test_issue10_trials_cover_flash_attention_and_the_chunked_loss():
    names = {t.name: t for t in gv.GPU_TRIALS}
    assert "model.attention=auto" in names["1b-flash"].overrides
    assert "model.loss_chunk=8192" in names["1b-loss-chunked"].overrides
    assert "model.loss_chunk=null" in names["1b-loss-whole"].overrides
    assert all("model.attention=xla" in t.overrides for t in gv.GPU_TRIALS if t.role)  # Issue 5's sizing.


@pytest.mark.slow
def test_cpu_dry_run_of_the_pallas_and_chunked_loss_trials(tmp_path):
    trials = ("tiny-pallas", "tiny-loss-chunked")
    argv = [sys.executable, str(ROOT / "bench" / "gpu_validate.py"), "--cpu", "--out", str(tmp_path),
            "--steps", "2", "--jobs", "2", *(a for t in trials for a in ("--only", t))]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["trial"]: row for row in json.loads((tmp_path / "gpu_validate.json").read_text())["rows"]}
    pallas = rows["tiny-pallas"]
    assert pallas["measured"]["status"] == "ok" and pallas["measured"]["finite_loss"]
    assert pallas["measured"]["attention"].startswith("pallas (interpret mode)")
    assert (
        pallas["plans"]["twin"]["attention"].startswith("pallas")
        and pallas["plans"]["twin"]["status"] == "ok"
    )
    assert rows["tiny-loss-chunked"]["measured"]["status"] == "ok"
    assert "| tiny-pallas | none | pallas / pallas |" in (tmp_path / "gpu_validate.md").read_text()
