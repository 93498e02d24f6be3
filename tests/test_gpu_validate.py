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
    # A guard against a hang, not a time limit: over 180 s beside another xdist worker on a shared machine.
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
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
    assert [bar["result"] for bar in payload["bars"]] == ["N/A"] * 5  # Peaks (2), verdicts (2), step time.
    assert payload["grads"] == [] and payload["train"] is None  # --only names neither.

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


def _plan(peak_gib, fits, flops=1e15, no_remat=None, step_s=0.5):
    return {"status": "ok", "peak_bytes": int(peak_gib * GIB), "fits": fits, "flops_per_step": flops,
            "flops_no_remat": no_remat, "remat": "0-3: none", "step_time_s": step_s}  # fmt: skip


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


def test_a_run_without_memory_figures_has_no_peak_ratios():
    cpu_run = {"status": "ok", "step_s_median": 0.5, "tokens_per_step": 8192, "after_compile": {}}
    row = _row("a", _plan(10, True), _plan(10, True), cpu_run)  # CPU: memory_stats() is None.
    assert row["measured_over_predicted"] == {} and row["peak_set_at_compile"] is False


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
    off = [_row("a", _plan(10, True), _plan(10, True), _ran(10.4))]  # 4% over the prediction.
    assert _bars(off)["measured/predicted peak within 3%, median (local plan)"] == "FAIL"

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
    assert {b["bar"]: b["result"] for b in bars}[
        "measured/predicted peak within 3%, median (local plan)"
    ] == "PASS"
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
    window = "pallas; sliding window of 16 not in the stand-in, ..., standing in for cudnn (which ...)"
    assert gv._kernel(window) == "pallas for cudnn"
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


# One CPU dry run for the tests of what it ran (one probe and one process: dry runs are slow on 2 cores).
DRY_RUN = ("tiny-pallas", "tiny-loss-chunked", "tiny-today-qlora", "tiny-today-window", "serve-tiny-b2",
           "generate", "gemm")  # fmt: skip


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The CPU dry run of ``DRY_RUN``: its exit code and stderr, its JSON results and its markdown."""
    out = tmp_path_factory.mktemp("dry_run")
    argv = [sys.executable, str(ROOT / "bench" / "gpu_validate.py"), "--cpu", "--out", str(out),
            "--steps", "2", "--jobs", "2", *(a for name in DRY_RUN for a in ("--only", name))]  # fmt: skip
    # A guard against a hang, not a time limit.
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    payload = (
        json.loads((out / "gpu_validate.json").read_text()) if (out / "gpu_validate.json").is_file() else {}
    )
    table = (out / "gpu_validate.md").read_text() if (out / "gpu_validate.md").is_file() else ""
    return proc, payload, table


@pytest.mark.slow
def test_cpu_dry_run_of_the_pallas_and_chunked_loss_trials(dry_run):
    proc, payload, table = dry_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["trial"]: row for row in payload["rows"]}
    pallas = rows["tiny-pallas"]
    assert pallas["measured"]["status"] == "ok" and pallas["measured"]["finite_loss"]
    assert pallas["measured"]["attention"].startswith("pallas (interpret mode)")
    assert (
        pallas["plans"]["twin"]["attention"].startswith("pallas")
        and pallas["plans"]["twin"]["status"] == "ok"
    )
    assert rows["tiny-loss-chunked"]["measured"]["status"] == "ok"
    assert "| tiny-pallas | none | pallas / pallas |" in table


@pytest.mark.slow  # Not newest: minutes of dry run; serving, LoRA and NF4 have newest tests of their own.
def test_cpu_dry_run_of_issue42s_trials_and_serving(dry_run):
    proc, payload, table = dry_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["trial"]: row for row in payload["rows"]}
    for name in ("tiny-today-qlora", "tiny-today-window"):
        measured, plans = rows[name]["measured"], rows[name]["plans"]
        assert measured["status"] == "ok" and measured["finite_loss"], measured
        assert plans["local"]["status"] == plans["twin"]["status"] == "ok"
    # The adapters and their optimizer state are the trained parameters; the NF4 base is frozen.
    qlora = rows["tiny-today-qlora"]["plans"]["twin"]["per_device"]
    assert 0 < qlora["params"] < qlora["frozen"]
    assert "sliding window of 16" in rows["tiny-today-window"]["plans"]["twin"]["attention"]
    serving, bars = payload["serving"], {b["bar"]: b for b in payload["bars"]}
    tokens_bar = bars["serving: greedy tokens on the device equal the CPU's (seed 0)"]
    if importlib.util.find_spec("shardmem.program.serving") is None:  # Before the serving program lands.
        assert serving["status"] == "skipped" and "no serving program" in serving["message"]
        assert tokens_bar["result"] == "N/A" and "Serving: skipped" in table
        return
    row = serving["rows"][0]
    assert row["trial"] == "serve-tiny-b2" and row["plan"]["status"] == "ok", row
    assert row["plan"]["serve"]["batch"] == 2 and row["plan"]["decode_s_mean"] > 0
    measured = row["measured"]
    assert measured["status"] == "ok" and measured["finite_logits"], measured
    assert len(measured["prefill_s"]) == 3 and len(measured["decode_s"]) == 32 - 16
    generated = serving["generate"]
    assert generated["equal"] and generated["device"]["tokens"] == generated["cpu"]["tokens"]
    assert [len(t) for t in generated["device"]["tokens"]] == [gv.GENERATE_TOKENS] * len(gv.GENERATE_PROMPTS)
    assert tokens_bar["result"] == "PASS" and "| serve-tiny-b2 | 2 | 16 / 32 |" in table


def test_peak_bar_judges_the_median_and_names_the_worst_trial():
    def rows(*errors):
        return [
            _row(f"t{i}", _plan(10, True), _plan(10, True), _ran(10 * (1 + e))) for i, e in enumerate(errors)
        ]

    bar = next(b for b in gv.check_bars(rows(0.01, 0.02, 0.10), measurable=True) if "(twin plan)" in b["bar"])
    assert bar["result"] == "PASS" and bar["median"] == pytest.approx(0.02) and bar["worst_trial"] == "t2"
    assert "worst t2 +10.0%" in bar["detail"]
    assert _bars(rows(0.04, -0.04, 0.0))["measured/predicted peak within 3%, median (twin plan)"] == "FAIL"


def test_step_time_error_is_predicted_over_measured_and_its_bar_the_median():
    def row(name, predicted_s, measured_s):
        return _row(name, _plan(10, True, step_s=predicted_s), _plan(10, True, step_s=predicted_s),
                    _ran(10, step_s=measured_s))  # fmt: skip

    fast = row("a", 0.45, 0.5)
    assert fast["step_time_error"]["twin"] == pytest.approx(-0.1)
    bar = "predicted/measured step time within 15%, median (twin plan)"
    assert _bars([fast, row("b", 0.6, 0.5), row("c", 0.55, 0.5)])[bar] == "PASS"  # -10%, +20%, +10%
    assert _bars([row("b", 0.6, 0.5), row("c", 0.3, 0.5)])[bar] == "FAIL"  # median 30%
    assert _row("d", _plan(1, True), _plan(1, True), {"status": "oom"})["step_time_error"] == {}


def _grad(**changes):
    good = {"check": "grads-offload-fp32", "status": "ok", "policy": "offload", "equal": True,
            "params_equal": True, "offloaded": True, "finite": True, "max_relative_error": 3e-7,
            "worst_leaf": "layers/mlp/kernel", "tolerance": 1e-4}  # fmt: skip
    return {**good, **changes}


def test_gradient_bar_fails_on_a_difference_a_crash_or_nothing_offloaded():
    def result(*checks):
        bars = gv.check_bars([], measurable=False, grads=list(checks))
        return next(b for b in bars if b["bar"].startswith("offloaded"))["result"]

    assert result(_grad(), _grad(check="grads-offload-today")) == "PASS"
    assert result(_grad(equal=False, max_relative_error=0.3)) == "FAIL"
    assert result(_grad(offloaded=False)) == "FAIL"  # Equal because nothing was offloaded proves nothing.
    assert result(_grad(params_equal=False)) == "FAIL"
    assert result(_grad(), {"check": "grads-offload-today", "status": "crashed"}) == "FAIL"
    assert result() == "FAIL"


def test_relative_errors_per_leaf():
    import numpy as np

    reference = {"a": np.ones((4, 4), np.float32), "b": {"c": np.zeros(3, np.float32)}}
    other = {"a": reference["a"] * 1.01, "b": {"c": np.zeros(3, np.float32)}}
    errors = gv.relative_errors(reference, other)
    assert set(errors) == {"a", "b/c"}
    assert errors["a"] == pytest.approx(0.01, rel=1e-4) and errors["b/c"] == 0.0


def test_memory_line_reads_the_log_line_train_prints():
    from shardmem.run.metrics import format_record

    line = format_record({"step": 3, "loss": 2.5, "memory_bytes_in_use": 9 * GIB,
                          "memory_planned_bytes": int(9.5 * GIB)})  # fmt: skip
    match = gv.MEMORY_LINE.search(line)
    assert match and match["live"] == "9.00 GiB" and match["planned"] == "9.50 GiB"
    assert gv.MEMORY_LINE.search(format_record({"step": 3, "loss": 2.5})) is None


def test_train_bar_needs_the_line_and_the_peak_on_a_gpu():
    ran = {"status": "ok", "steps_logged": 6, "log_line": "step 6  loss 9.1  mem 20.1 GiB / plan 20.3 GiB",
           "peak_over_planned": 0.995}  # fmt: skip
    assert gv._train_bar(ran, measurable=True)["result"] == "PASS"
    assert gv._train_bar({**ran, "log_line": None}, measurable=True)["result"] == "FAIL"
    assert (
        gv._train_bar({"status": "oom", "message": "RESOURCE_EXHAUSTED"}, measurable=True)["result"] == "FAIL"
    )
    assert (
        gv._train_bar({**ran, "log_line": None, "peak_over_planned": None}, measurable=False)["result"]
        == "N/A"
    )


def test_reference_mfu_is_the_best_7b_width_cudnn_trial():
    def row(name, step_s, attention):
        twin = {**_plan(50, True, flops=4e14, no_remat=4e14), "predicted_mfu": 0.6}
        return _row(name, _plan(50, True, flops=4e14, no_remat=4e14), twin,
                    {**_ran(50, step_s=step_s), "attention": attention})  # fmt: skip

    rows = [row("7bw-today-none", 1.0, "cudnn"), row("7bw-today-full", 0.8, "cudnn"),
            row("1b-flash", 0.1, "cudnn"), row("7bw-none-fits", 0.5, "xla")]  # fmt: skip
    best = gv.reference_mfu(rows)
    assert best["trial"] == "7bw-today-full" and best["mfu"] == pytest.approx(4e14 / 0.8 / 1e15)
    assert best["predicted_mfu"] == 0.6
    assert gv.reference_mfu(rows[2:]) is None


def test_issue33_trials_run_todays_program_first_and_every_piece_has_a_cpu_twin():
    first = gv.GPU_TRIALS[0]
    assert first.name.startswith("7bw-today") and set(gv.TODAY) <= set(first.overrides)
    assert [c.name for c in gv.GRAD_CHECKS] == [c.name for c in gv.CPU_GRAD_CHECKS]
    assert (
        gv.GRAD_CHECKS[0].matmul_precision == "highest"
        and "precision.compute=float32" in gv.GRAD_CHECKS[0].overrides
    )
    assert gv.TRAIN_RUN.name == gv.CPU_TRAIN_RUN.name == "train"
    names = [t.name for t in gv.GPU_TRIALS]
    assert len(names) == len(set(names)) and "7bw-none-too-big" in names


@pytest.mark.slow
def test_cpu_dry_run_of_the_gradient_checks_and_the_train_run(tmp_path):
    argv = [sys.executable, str(ROOT / "bench" / "gpu_validate.py"), "--cpu", "--out", str(tmp_path),
            "--only", "grads-offload-fp32", "--only", "grads-offload-today", "--only", "train"]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads((tmp_path / "gpu_validate.json").read_text())
    assert payload["rows"] == []
    grads = {g["check"]: g for g in payload["grads"]}
    assert set(grads) == {"grads-offload-fp32", "grads-offload-today"}
    for g in grads.values():
        assert g["status"] == "ok" and g["equal"] and g["params_equal"] and g["finite"], g
        assert g["offloaded"] and g["host_transfers"] > 0  # The offloaded residuals' moves.
        assert g["leaves"] > 4 and g["loss"]["none"] == pytest.approx(g["loss"]["offload"], rel=1e-3)
    assert grads["grads-offload-fp32"]["compute"] == "float32"
    assert grads["grads-offload-fp32"]["max_relative_error"] <= 1e-4
    train = payload["train"]
    assert train["status"] == "ok" and train["steps_logged"] == 4 and train["exit_code"] == 0, train
    results = {b["bar"]: b["result"] for b in payload["bars"]}
    assert results["offloaded remat's gradients equal no remat's"] == "PASS"
    assert results["train logs live memory against the plan"] == "N/A"  # CPU devices report no memory.
    table = (tmp_path / "gpu_validate.md").read_text()
    assert "| grads-offload-fp32 | offload (float32, matmuls highest) |" in table
    assert "| train run |" in table


def test_judge_grads_allows_bf16_round_off_no_larger_than_full_remats():
    errors = {"wk": 0.019, "wq": 0.001}
    assert gv.judge_grads(errors, 1e-2) == (False, "wk")
    assert gv.judge_grads(errors, 1e-2, floor={"wk": 0.012, "wq": 0.0}) == (True, "wk")
    assert gv.judge_grads({"wk": 0.3, "wq": 0.001}, 1e-2, floor={"wk": 0.012, "wq": 0.0})[0] is False
    assert gv.judge_grads({"a": 0.0}, 1e-4) == (True, "a")


def test_step_time_reads_the_measured_steps_of_a_gpu_round(tmp_path):
    spec = importlib.util.spec_from_file_location("step_time", ROOT / "bench" / "step_time.py")
    step_time = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_time)
    rows = [{"trial": "7bw-today-none", "measured": {"status": "ok", "step_s_median": 0.7125}},
            {"trial": "7bw-none-too-big", "measured": {"status": "oom"}},
            {"trial": "1b-none", "measured": {"status": "skipped"}}]  # fmt: skip
    (tmp_path / "gpu_validate.json").write_text(json.dumps({"rows": rows}))
    assert step_time.measured_from(tmp_path / "gpu_validate.json") == {"7bw-today-none": 712.5}


def test_a_failed_twin_plan_is_made_again_with_the_machines_cuda_toolkit(monkeypatch):
    calls = []

    def plan_trial(trial, target, env, timeout, niceness=0, extra=()):
        calls.append(extra)
        return (
            _plan(10, True)
            if extra
            else {"status": "error", "exit_code": 1, "message": "exit 1: ptxas said no"}
        )

    monkeypatch.setattr(gv, "plan_trial", plan_trial)
    monkeypatch.setattr(gv, "cuda_toolkit", lambda: "/usr/local/cuda")
    plan = gv.plan_twin(gv.Trial("a", "configs/tiny.yaml", ()), "h200", {}, 10)
    assert (
        plan["status"] == "ok" and plan["cuda_dir"] == "/usr/local/cuda" and "ptxas" in plan["first_attempt"]
    )
    assert calls == [(), ("memory.compiler_options={xla_gpu_cuda_data_dir: '/usr/local/cuda'}",)]
    monkeypatch.setattr(gv, "cuda_toolkit", lambda: None)
    assert gv.plan_twin(gv.Trial("a", "configs/tiny.yaml", ()), "h200", {}, 10)["status"] == "error"
    # A plan that timed out is not made again: it would only time out twice.
    monkeypatch.setattr(gv, "cuda_toolkit", lambda: "/usr/local/cuda")
    monkeypatch.setattr(
        gv, "plan_trial", lambda *a, **k: {"status": "error", "exit_code": None, "message": "timed out"}
    )
    assert "cuda_dir" not in gv.plan_twin(gv.Trial("a", "configs/tiny.yaml", ()), "h200", {}, 10)


def test_bars_judge_only_the_pieces_that_were_asked_for():
    bars = gv.check_bars(None, measurable=True, grads=[_grad()])
    assert [b["bar"] for b in bars] == ["offloaded remat's gradients equal no remat's"]
    assert [b["result"] for b in gv.check_bars([], measurable=True)][:2] == ["FAIL", "FAIL"]  # None ran.


def test_the_parts_share_the_deadline_and_their_ends_add_up():
    ends = gv.part_deadlines(510)
    assert list(ends) == ["gradients", "train", "trials", "gemm", "serving"] == list(gv.PART_BUDGETS)
    assert ends["serving"] == pytest.approx(510) and ends["gradients"] == pytest.approx(90)
    assert ends["trials"] - ends["train"] == pytest.approx(gv.PART_BUDGETS["trials"])
    assert sum(gv.PART_BUDGETS.values()) <= 540  # With the probe and the imports, inside a 600 s command.
    assert gv.part_deadlines(1020)["train"] == pytest.approx(2 * 150)  # Shares scale with --deadline.


def test_a_tight_plan_is_a_report_not_an_error(monkeypatch):
    report = {"fits": True, "per_device": {"peak": 5 * GIB}, "budget_bytes": 4 * GIB,
              "device_memory_bytes": 6 * GIB, "flops_per_step": 1e12, "flops_no_remat": 1e12,
              "remat": "0-1: none", "target_label": "h200 (deviceless)", "compile_seconds": 1.0}  # fmt: skip
    monkeypatch.setattr(gv, "_run", lambda argv, env, timeout: (5, json.dumps(report), "", 1.0))
    plan = gv.plan_trial(gv.Trial("a", "configs/tiny.yaml", ()), "h200", {}, 10)
    assert plan["status"] == "ok" and plan["exit_code"] == 5 and plan["peak_bytes"] == 5 * GIB


def test_issue42_trials_and_their_cpu_twins():
    gpu = {t.name: t for t in gv.GPU_TRIALS}
    cpu = {t.name: t for t in gv.CPU_TRIALS}
    for name in ("today-lora", "today-qlora", "today-window", "today-offload"):
        assert set(gv.TODAY) <= set(gpu[f"7bw-{name}"].overrides) and f"tiny-{name}" in cpu
    assert gv.LORA in gpu["7bw-today-qlora"].overrides and gv.QLORA_NF4 in gpu["7bw-today-qlora"].overrides
    assert gv.QLORA_NF4 not in gpu["7bw-today-lora"].overrides
    assert "model.sliding_window=1024" in gpu["7bw-today-window"].overrides
    assert [t.name for t in gv.GPU_TRIALS][:5] == ["7bw-today-none", "7bw-today-offload", "7bw-today-lora",
                                                   "7bw-today-qlora", "7bw-today-window"]  # fmt: skip
    assert len(gv.SERVE_TRIALS) == len(gv.CPU_SERVE_TRIALS) == 4
    short = gv.SERVE_TRIALS[0]  # First: serving-truth.md's first-token shape.
    assert short.name == "serve-7bw-b1-p128"
    assert {"serve.batch=1", "serve.prompt_len=128", "precision.params=bfloat16"} <= set(short.overrides)
    assert [t.name for t in gv.SERVE_TRIALS if "serve.kv_dtype=int8" in t.overrides] == ["serve-7bw-b32-int8"]
    assert gv.GENERATE_RUN.name == gv.CPU_GENERATE_RUN.name == "generate"


def _serve_plan(peak_gib=10.0, decode_s=0.002, ttft_s=0.1):
    return {"status": "ok", "peak_bytes": int(peak_gib * GIB), "decode_s_mean": decode_s, "ttft_s": ttft_s,
            "serve": {"batch": 8, "prompt_len": 1024, "max_len": 1088}, "attention": "pallas, standing in "
            "for cudnn: ..."}  # fmt: skip


def _served(peak_gib=10.0, decode_s=0.002, prefill_s=0.1):
    return {"status": "ok", "peak_bytes_in_use": int(peak_gib * GIB), "decode_s_mean": decode_s,
            "prefill_s_median": prefill_s}  # fmt: skip


def _serving(*rows, equal=True):
    tokens = {"status": "ok", "tokens": [[5, 6], [7, 8]]}
    generate = {"device": tokens, "cpu": tokens, "equal": equal,
                "first_difference": None if equal else {"prompt": 1, "step": 0}}  # fmt: skip
    return {"status": "ok", "rows": list(rows), "generate": generate}


def _serving_results(serving, measurable=True):
    return {b["bar"]: b for b in gv.check_bars(None, measurable=measurable, serving=serving)}


def test_serving_rows_and_bars():
    trial = gv.Trial("serve-b8", "configs/llama-7b.yaml", ())
    good = gv.summarize_serving(trial, _serve_plan(), _served(peak_gib=10.3, decode_s=0.0021, prefill_s=0.08))
    assert good["peak_error"] == pytest.approx(0.03) and good["decode_error"] == pytest.approx(
        0.002 / 0.0021 - 1
    )
    assert good["ttft_error"] == pytest.approx(0.25)  # Shown, not judged: the issue sets no bar on it.
    bars = _serving_results(_serving(good))
    assert [b["result"] for b in bars.values()] == ["PASS"] * 3
    assert "4 tokens equal" in bars["serving: greedy tokens on the device equal the CPU's (seed 0)"]["detail"]

    slow = gv.summarize_serving(trial, _serve_plan(), _served(decode_s=0.0026))  # Predicted 23% fast.
    fat = gv.summarize_serving(trial, _serve_plan(), _served(peak_gib=10.6))
    oom = gv.summarize_serving(trial, _serve_plan(), {"status": "oom"})
    results = {name: b["result"] for name, b in _serving_results(_serving(good, slow, fat, oom)).items()}
    assert results == {
        "serving: predicted decode step within 20% of measured, every batch (twin plan)": "FAIL",
        "serving: measured/predicted peak within 5%, every batch (twin plan)": "FAIL",
        "serving: greedy tokens on the device equal the CPU's (seed 0)": "PASS",
    }
    assert oom["peak_error"] is None and oom["decode_error"] is None
    assert not good["peak_set_at_compile"]
    tuned = {**_served(peak_gib=12), "after_compile": {"peak_bytes_in_use": 12 * GIB}}
    assert gv.summarize_serving(trial, _serve_plan(), tuned)["peak_set_at_compile"]
    differ = _serving_results(_serving(good, equal=False))[
        "serving: greedy tokens on the device equal the CPU's (seed 0)"
    ]
    assert differ["result"] == "FAIL" and "prompt 1, step 0" in differ["detail"]


def test_serving_bars_on_cpu_and_where_the_part_was_skipped():
    on_cpu = _serving_results(_serving(), measurable=False)
    assert [b["result"] for b in on_cpu.values()] == ["N/A", "N/A", "PASS"]
    assert (
        "CPU against CPU" in on_cpu["serving: greedy tokens on the device equal the CPU's (seed 0)"]["detail"]
    )
    skipped = {"status": "skipped", "message": "this shardmem's CLI has no serving program"}
    bars = _serving_results(skipped)
    assert [b["result"] for b in bars.values()] == ["N/A"] * 3
    assert all("no serving program" in b["detail"] for b in bars.values())
    meta = {"label": "GPU validation", "device_kind": "NVIDIA H200", "platform": "gpu", "jax": "0",
            "bytes_limit": 140 * GIB, "twin": "h200", "steps": 5}  # fmt: skip
    assert "Serving: skipped (this shardmem's CLI has no serving program)." in gv.markdown(
        meta, [], list(bars.values()), serving=skipped
    )


def test_compare_generations_finds_the_first_difference():
    def run(*tokens):
        return {"status": "ok", "tokens": [list(t) for t in tokens]}

    assert gv.compare_generations(run((1, 2), (3, 4)), run((1, 2), (3, 4)))["equal"]
    assert gv.compare_generations(run((1, 2), (3, 4)), run((1, 2), (3, 5)))["first_difference"] == {
        "prompt": 1, "step": 1}  # fmt: skip
    assert gv.compare_generations(run((1, 2), (3,)), run((1, 2), (3, 4)))["first_difference"] == {
        "prompt": 1, "step": 1}  # fmt: skip
    crashed = gv.compare_generations({"status": "error", "message": "exit 1"}, run((1,)))
    assert crashed == {"equal": False, "first_difference": None}


def test_serving_figures_read_plan_serve_json():
    report = {"fits": True, "verdict": "fits", "serve": {"batch": 2}, "budget_bytes": 100,
              "per_device": {"peak": 60, "weights": 40, "kv_cache": 10}, "prefill": {"attention": "cudnn"},
              "decode": {"target_label": "h200 (deviceless)"},
              "time": {"time_to_first_token": 0.1, "decode_seconds": {"first": 0.001, "last": 0.003,
                                                                      "mean": 0.002}}}  # fmt: skip
    figures = gv.serving_figures(report)
    assert figures["peak_bytes"] == 60 and figures["ttft_s"] == 0.1 and figures["decode_s_mean"] == 0.002
    assert figures["attention"] == "cudnn" and figures["status"] == "ok"


@pytest.mark.slow
def test_cpu_dry_run_times_the_gemms_and_costs_what_was_compiled(dry_run):
    proc, payload, table = dry_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    gemm = payload["gemm"]
    assert gemm["status"] == "ok" and gemm["device_kind"] == "cpu", gemm
    assert [row["rows"] for row in gemm["rows"]] == list(gv.CPU_GEMM_ROWS)
    for row in gemm["rows"]:
        assert row["measured_s"] > 0 and row["predicted_s"] > row["compute_s"] > 0
        assert row["kernels"]["dot"] == len(gv.CPU_GEMM_SHAPES) * gv.GEMM_LAYERS  # None fused away.
    assert "each over 8 weights and inputs of its own" in table and "| 128 | " in table


def test_gemm_kernels_counts_cublas_calls_and_triton_fusions():
    text = """
  %a = (bf16[128,4096]{1,0}, s8[0]{0}) custom-call(%p0, %p1), custom_call_target="__cublas$gemm"
  %b = bf16[128,4096]{1,0} fusion(%p0, %p2), kind=kCustom, calls=%f,
      backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %c = bf16[1,4096]{1,0} dot(%p3, %p4), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %d = bf16[128,4096]{1,0} dot(%q0, %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
"""  # %d: the Triton fusion's own dot, in its computation.
    assert gv.gemm_kernels(text) == {"cublas": 1, "triton": 1, "dot": 1}
    table = "\n".join(gv._gemm_table({"status": "ok", "device_kind": "NVIDIA H200", "shapes": [[4096, 4096]],
                                        "dispatch_s": 1e-5, "rows": [{
        "rows": 128, "measured_s": 2e-3, "predicted_s": 1.5e-3, "predicted_over_measured": 0.75,
        "compute_s": 1.2e-3, "memory_bound_s": 0.2e-3, "launch_s": 0.1e-3, "tflops": 300.0,
        "weight_gbs": 2000.0, "kernels": {"cublas": 8, "triton": 0, "dot": 0}}]}))  # fmt: skip
    assert "| 128 | 2 | 1.5 | 0.75 | 1.2 / 0.2 / 0.1 | 300.0 | 2,000 | cublas 8 |" in table
    partial = gv._gemm_table({"status": "partial", "device_kind": "NVIDIA H200", "shapes": [[4096, 4096]],
                              "rows": []})  # fmt: skip
    assert "Partial: the part's time ran out after these rows." in partial[1]
    assert gv._gemm_table({"status": "timeout", "message": "no result within 30 s"}) == [
        "",
        "GEMMs: timeout (no result within 30 s).",
    ]


@pytest.mark.slow
def test_the_gemm_program_is_one_gpu_gemm_per_weight_none_merged():
    # Compiled deviceless for an H100: with one input per shape, XLA merged a shape's 8 dots into one.
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from shardmem.planning.targets import resolve_target

    device = resolve_target("h100-sxm", n_devices=1).devices[0]
    spec = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=SingleDeviceSharding(device))  # noqa: E731
    weights = [[spec(shape) for _ in range(gv.GEMM_LAYERS)] for shape in gv.GEMM_SHAPES]
    xs = [[spec((128, k)) for _ in range(gv.GEMM_LAYERS)] for k, _ in gv.GEMM_SHAPES]
    text = jax.jit(gv.gemm_products).lower(xs, weights).compile().as_text()
    kernels = gv.gemm_kernels(text)
    assert kernels["cublas"] + kernels["triton"] + kernels["dot"] == len(gv.GEMM_SHAPES) * gv.GEMM_LAYERS
