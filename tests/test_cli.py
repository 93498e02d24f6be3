"""End-to-end runs of the `shardmem` command, as a user would type them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from shardmem.cli import main
from shardmem.config import load_config
from shardmem.errors import ConfigError
from shardmem.planning.targets import configure_local_memory

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def shardmem(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "shardmem", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


@pytest.mark.newest
def test_plan_json_is_one_object_with_the_documented_keys():
    result = shardmem("plan", "configs/tiny.yaml", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    for key in ("target", "devices", "mesh", "per_device", "budget_bytes", "fits", "flops_per_step",
                "top_buffers"):  # fmt: skip
        assert key in report
    assert set(report["per_device"]) == {"params", "frozen", "optimizer", "model_state", "batch", "outputs",
                                         "temp", "alias", "host", "code", "peak"}  # fmt: skip
    assert all(isinstance(v, int) for v in report["per_device"].values())
    assert report["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1} and report["devices"] == 8
    assert {"bytes", "scope", "shape"} <= set(report["top_buffers"][0])
    assert report["jax_version"] == jax.__version__


def test_plan_table_for_a_gpu_target_and_overrides():
    result = shardmem("plan", "configs/llama-7b.yaml", "--set", "model.n_layers=4", "--set",
                      "remat.layers={}", "--sharding")  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("NVIDIA H100 80GB HBM3", "peak", "FITS", "Largest buffers live at the peak",
                 "Parameter sharding", "layers/wq", "0-3: none", "attention pallas, standing in for cudnn",
                 "fused attention from its shapes",
                 f"by JAX {jax.__version__}"):  # fmt: skip
        assert text in out


def test_plan_json_with_sharding_has_the_sharding_table(capsys):
    args = ["plan", TINY, "--target", "cpu", "--json", "--sharding", "--set", "rules.embed=[data, fsdp]"]
    assert main(args) == 0
    rows = {row["path"]: row for row in json.loads(capsys.readouterr().out)["sharding"]}
    assert rows["layers/wq"] == {
        "path": "layers/wq", "shape": [4, 64, 4, 16], "dtype": "float32",
        "logical": ["layers", "embed", "heads", "head_dim"], "spec": [None, ["data", "fsdp"], "tensor"],
        "bytes_per_device": 4 * 64 * 4 * 16 * 4 // 8, "bytes_total": 4 * 64 * 4 * 16 * 4,
    }  # fmt: skip
    assert rows["final_norm/scale"]["spec"] == [] and "lm_head" in rows
    assert main(["plan", TINY, "--target", "cpu", "--json"]) == 0
    assert "sharding" not in json.loads(capsys.readouterr().out)


def test_plan_that_does_not_fit_exits_3_and_still_reports():
    result = shardmem("plan", "configs/tiny.yaml", "--set", "memory.usable_fraction=0.0000001",
                      "--set", "memory.reserve=0")  # fmt: skip
    assert result.returncode == 3
    assert "DOES NOT FIT" in result.stdout
    # With what to try next, as libtpu's refusal on a TPU target says it (issue 30, item 10).
    assert "next: shard more (mesh.axes.fsdp over more devices), recompute more" in result.stdout
    assert "shardmem tune with the same config and --target searches these" in result.stdout


@pytest.fixture(scope="module")
def tiny_report():
    """The tiny config planned for the cpu target (one compile, shared)."""
    from shardmem.planning.memory import plan

    return plan(load_config(TINY), "cpu", top=1)


@pytest.mark.parametrize("usable, verdict, code", [(1.08, "tight", 5), (0.95, "does not fit", 3)])
def test_a_plan_over_the_budget_only_by_the_deviceless_margin_is_tight(usable, verdict, code, tiny_report,
                                                                        monkeypatch, capsys):  # fmt: skip
    """Over the budget (usable memory / 1.16) but within the usable memory: tight, likely fits (exit 5), as
    llm-foundry's MPT-7B on 8 H100s plans (64.4 GiB against a 60.5 GiB budget, 70.2 GiB usable); over the
    usable memory itself: does not fit (exit 3). In the text, the JSON and the exit code (issue 41)."""
    import dataclasses

    report = tiny_report
    peak = report.per_device["peak"]
    usable_bytes = int(usable * peak)
    report = dataclasses.replace(report, deviceless_margin=0.16, usable_bytes=usable_bytes,
                                 budget_bytes=int(usable_bytes / 1.16), fits=False)  # fmt: skip
    monkeypatch.setattr("shardmem.planning.memory.plan", lambda *args, **kwargs: report)
    assert main(["plan", TINY, "--json"]) == code
    data = json.loads(capsys.readouterr().out)
    assert (data["verdict"], data["fits"], data["usable_bytes"]) == (verdict, False, usable_bytes)
    assert main(["plan", TINY]) == code
    text = " ".join(capsys.readouterr().out.split())  # Lines as one, wherever the console wrapped them.
    if verdict == "tight":
        assert "TIGHT, LIKELY FITS" in text and "DOES NOT FIT" not in text
        assert "tight: " in text and "over the budget only by the deviceless margin (0.16)" in text
        assert "plan with --target local on the GPU for an exact verdict" in text
    else:
        assert "DOES NOT FIT" in text and "next: shard more" in text and "tight" not in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["configs/tiny.yaml", "--set", "remat.policy=fulll"], "remat.policy='fulll'"),
        (["configs/tiny.yaml", "--set", "mesh.axes.tensor=3"], "mesh.axes"),
        (["configs/tiny.yaml", "--set", "rules.heads=model"], "mesh axis 'model'"),
        (["missing.yaml"], "cannot read config"),
    ],
)
def test_config_errors_exit_2_without_a_traceback(args, message, capsys, monkeypatch):
    # In this process (main() is what the command runs); the last case as a user meets it, end to end.
    monkeypatch.chdir(ROOT)
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("shardmem: error: ") and err.count("\n") == 1, err
    if args == ["missing.yaml"]:
        result = shardmem("plan", *args)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_unknown_target_is_a_usage_error(capsys):
    def usage_error(target: str) -> str:
        with pytest.raises(SystemExit) as exited:  # argparse's, as the command exits on it
            main(["plan", TINY, "--target", target])
        assert exited.value.code == 2
        return capsys.readouterr().err

    err = usage_error("tpu-v5")
    assert "unknown target 'tpu-v5'" in err and "choose from cpu, local, h100-sxm" in err
    assert "did you mean h100-sxm or h100-sxm-96g?" in usage_error("h100")


def test_policies_lists_presets_policies_and_targets():
    result = shardmem("policies")
    assert result.returncode == 0
    for text in ("offload", "llama-70b", "68,976,648,192", "h200"):
        assert text in result.stdout
    sections = ("remat policies", "model presets", "targets")
    assert all(line.startswith("  ") or line in sections for line in result.stdout.splitlines())


def test_version_names_shardmem_jax_and_python(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("shardmem 0.1.0 (jax ") and f"jax {jax.__version__}, jaxlib " in out
    assert f"python {sys.version_info.major}.{sys.version_info.minor}." in out


def test_plan_top_must_not_be_negative(capsys):
    assert main(["plan", TINY, "--top", "-1"]) == 2
    assert "--top -1" in capsys.readouterr().err


@pytest.mark.parametrize("target, expected", [("local", "0.5"), ("cpu", None)])
def test_plan_for_local_gets_the_allocator_limit_train_runs_with(target, expected, monkeypatch, capsys):
    # JAX's default allocator limit (75% of a GPU) would otherwise cap the budget of plan --target local
    # below the one train is gated on; the variable must be set before anything starts the backend.
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "unset")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    seen = {}

    def fake_plan(config, target, **kwargs):
        seen["fraction"] = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
        raise ConfigError("planned")

    monkeypatch.setattr("shardmem.planning.memory.plan", fake_plan)
    args = ["plan", TINY, "--target", target, "--set", "memory.usable_fraction=0.5"]
    assert main(args) == 2 and "planned" in capsys.readouterr().err
    assert seen == {"fraction": expected}


def test_configure_local_memory_keeps_a_value_the_user_set(monkeypatch):
    config = load_config(TINY, ["memory.usable_fraction=0.85"])
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    configure_local_memory(config)
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.6"
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    configure_local_memory(config)
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.85"


def test_a_long_plan_says_it_is_still_compiling(monkeypatch, capfd):
    # Issue 30, item 9: a 337 s TPU compile printed nothing until it ended.
    import time

    import shardmem.cli

    def slow_plan(config, target, **kwargs):
        time.sleep(0.5)
        raise ConfigError("planned")

    monkeypatch.setattr(shardmem.cli, "_PROGRESS_AFTER_S", 0.2)
    monkeypatch.setattr(shardmem.cli, "_PROGRESS_EVERY_S", 10.0)
    monkeypatch.setattr("shardmem.planning.memory.plan", slow_plan)
    assert main(["plan", TINY, "--target", "cpu"]) == 2
    err = capfd.readouterr().err.splitlines()
    assert err[0].startswith("shardmem: still compiling the step of tiny for cpu (0 s so far)"), err
    assert err[1:] == ["shardmem: error: planned"]
