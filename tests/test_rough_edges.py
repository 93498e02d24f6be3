"""Rough edges a new user met (issue 12): each message or figure says what it means."""

import os

import jax
import numpy as np
import pytest

import shardmem
from shardmem.config import load_config
from shardmem.errors import ConfigError
from shardmem.explore.sweep import SweepRow, progress_line
from shardmem.parallel.rules import rule_warnings
from shardmem.planning.report import render
from shardmem.program import build_program
from shardmem.run.metrics import StepRate

TINY = "configs/tiny.yaml"


def test_a_yaml_mapping_without_a_space_after_the_colon_says_so():
    with pytest.raises(ConfigError, match=r"put a space after the colon: --set 'mesh.axes=\{data: 3\}'"):
        load_config(TINY, ["mesh.axes={data:3}"])
    assert load_config(TINY, ["mesh.axes={data: 8}"]).mesh.axes["data"] == 8


def _warnings(config) -> list[str]:
    program = build_program(config, shardmem.build_mesh(config.mesh.axes, jax.devices()[:8]))
    return rule_warnings(program.sharding_table(), program.rules, program.mesh)


def test_replicated_parameter_warning_only_where_sharding_was_possible():
    small = ["model.vocab_size=32000", "model.d_model=256", "model.n_layers=4", "model.d_ff=512"]
    data_parallel = load_config(TINY, [*small, "mesh.axes={data: 8, fsdp: 1, tensor: 1}"])
    assert _warnings(data_parallel) == []  # Pure data parallelism replicates everything by design.
    fsdp = load_config(TINY, [*small, "mesh.axes={data: 1, fsdp: 8, tensor: 1}"])
    assert _warnings(fsdp) == []  # Norm scales stay replicated, and are too small to mention.
    unsharded = load_config(TINY, [*small, "mesh.axes={data: 1, fsdp: 8, tensor: 1}",
                                   'param_rules={"embedding": [null, null]}'])  # fmt: skip
    (warning,) = _warnings(unsharded)
    assert "embedding [32000, 256]" in warning and "layers" not in warning and "param_rules" in warning


def test_a_mesh_axis_no_rule_uses_is_warned_about():
    # `stages` (for stage) planned silently, its devices repeating the same work; so did a dense
    # model's expert axis with a batch rule that leaves it out (tiny.yaml's).
    (typo,) = _warnings(load_config(TINY, ["mesh.axes.stages=2"]))
    assert typo.startswith("mesh.axes.stages=2 (did you mean 'stage'?) shards nothing: no rule this model")
    (dense,) = _warnings(load_config(TINY, ["mesh.axes.expert=2"]))
    assert dense.startswith("mesh.axes.expert=2 shards nothing") and "rules.batch" in dense
    assert _warnings(load_config(TINY, ["mesh.axes.expert=2", "rules.batch=[data, fsdp, expert]"])) == []


def test_time_left_comes_from_the_steps_pace_not_the_compile():
    now = [0.0]
    rate = StepRate(total=100, clock=lambda: now[0])
    now[0] = 30.0  # compiled and ran the first 10 steps slowly
    rate.update(10)
    assert rate.seconds_left() is None
    now[0] = 31.0
    rate.update(20)  # 10 steps a second from here on
    assert rate.seconds_left() == pytest.approx(8.0)


def test_sweep_progress_lines_name_the_candidate_and_its_verdict():
    row = SweepRow(("remat.policy=full", "train.global_batch=8"), peak_bytes=3 * 2**30, fits=True)
    assert progress_line(3, 8, row, 41.2) == "[3/8 after 41 s] policy=full global_batch=8: 3.00 GiB, fits"
    failed = SweepRow(("remat.policy=bogus",), error="remat.policy='bogus' is not a remat policy\nmore")
    assert progress_line(1, 2, failed, 0).endswith(
        "policy=bogus: error: remat.policy='bogus' is not a remat policy"
    )


def test_cpu_report_says_what_its_budget_is(capsys):
    report = shardmem.plan(load_config(TINY), target="cpu", count_remat_overhead=False)
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render(report))
    text = console.export_text()
    assert "of device" not in text and "of its RAM share" in text
    assert "this machine's RAM / 8 simulated devices" in text and "not a GPU prediction" in text
    assert np.isclose(report.per_device["peak"] / report.device_memory_bytes, float(
        text.split("% of its RAM share")[0].split()[-1]) / 100, atol=1e-3)  # fmt: skip


# Issue 20, item 9: absurd sizes crashed XLA (exit 134, no output), raised tracebacks or hung.
ABSURD = {
    "train.global_batch=1000000000000000000": "train.global_batch=1000000000000000000: at most 2,147,483,647",
    "model.seq_len=1000000000000": "model.seq_len=1000000000000: at most",
    "model.d_model=1000000000000": "model.d_model=1000000000000: at most",
    "model.vocab_size=1000000000000": "model.vocab_size=1000000000000: at most",
    "mesh.axes.fsdp=1099511627776": "mesh.axes.fsdp=1099511627776: at most 1,048,576",
    "model.n_layers=100000000": "model.n_layers=100000000: at most 10,000",
    # Each dimension within bounds, their products not: XLA aborted on the L x L scores' extent.
    "model.seq_len=2000000000": r"model.seq_len=2000000000: the attention scores .* would have 2.56e\+20",
    "model.d_model=2000000000": r"model.d_model=2000000000, model.n_heads=4, .*would have 1.6e\+19 elements",
    "mesh.axes.fsdp=8192": "a mesh of 16,384 devices, more than the 4096 simulated CPU devices",
}


@pytest.mark.parametrize("command", ["plan", "train"])
@pytest.mark.parametrize("override", list(ABSURD))
def test_absurd_sizes_are_one_line_config_errors(command, override, capsys, monkeypatch, tmp_path):
    import re

    from shardmem.cli import main

    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # train sets it otherwise
    args = ["--target", "cpu"] if command == "plan" else ["--run-dir", str(tmp_path / "run")]
    assert main([command, TINY, *args, "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardmem: error: ") and re.search(ABSURD[override], err)


def test_large_but_possible_sizes_still_load():
    config = load_config(TINY, ["model.seq_len=131072", "model.vocab_size=262144", "model.n_layers=200",
                                "train.global_batch=4096", "mesh.axes.fsdp=4096"])  # fmt: skip
    assert config.model.seq_len == 131072
    from shardmem.config import config_from_dict

    with pytest.raises(ConfigError, match=r"data.batch.x.shape=\['global_batch', 2000000000, 2000000\]: an"):
        config_from_dict({"data": {"batch": {"x": {"shape": ["global_batch", 2_000_000_000, 2_000_000]}}}})


@pytest.mark.newest
def test_a_native_abort_while_stderr_is_silenced_still_leaves_one_line(tmp_path):
    # XLA aborts the process (SIGABRT) on a shape whose extent overflows int64; with stderr pointed
    # at /dev/null for the compile, the user saw nothing at all, only exit status 134.
    import subprocess
    import sys

    script = tmp_path / "abort.py"
    script.write_text(
        "import jax, jax.numpy as jnp\n"
        "from shardmem._quiet import native_stderr_silenced\n"
        "f = jax.jit(lambda x: jnp.broadcast_to(x, (2**31 - 1,) * 3).sum())\n"
        "lowered = f.lower(jnp.float32(1))\n"
        "with native_stderr_silenced(watch=True):\n"
        "    import os; os.write(2, b'expected native noise\\n')\n"
        "    try:\n"
        "        lowered.compile()\n"
        "    finally:  # An XLA that raises instead of aborting: abort as it would, for the watcher.\n"
        "        os.write(2, b'F0000 stand-in.cc:1] Check failed: overflow in static extent product\\n')\n"
        "        os.abort()\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
    assert done.returncode == -6  # SIGABRT, as before: only the silence changes.
    ours = [line for line in done.stderr.splitlines() if line.startswith("shardmem:")]
    (line,) = ours
    prefix = "shardmem: error: the process died in native code (XLA) while compiling or starting devices; "
    assert line.startswith(prefix + "its last message: "), line
    xla = "overflow in static extent product: dimensions=[2147483647, 2147483647, 2147483647]."
    assert line.endswith((xla, "Check failed: overflow in static extent product")), line
    assert "expected native noise" not in done.stderr


def test_a_sigterm_to_the_whole_process_group_leaves_a_watched_block_alone(tmp_path):
    # `timeout -s TERM`, SLURM's time limit or `kill -- -PGID` signal the watcher with the command: it
    # died, the block's end got a broken pipe, and a train still compiling failed as "XLA could not
    # compile the step: [Errno 32] Broken pipe" (exit 2) where it should stop at its first step, saved.
    import subprocess
    import sys

    script = tmp_path / "term.py"
    script.write_text(
        "import os, signal, time\n"
        "from shardmem._quiet import _watchers, native_stderr_silenced\n"
        "signal.signal(signal.SIGTERM, lambda *args: print('stop at the next step'))  # as train does\n"
        "with native_stderr_silenced(watch=True):\n"
        "    pid, deadline = _watchers[0].pid, time.monotonic() + 60\n"
        "    while time.monotonic() < deadline:  # Until the watcher has set its signal mask.\n"
        "        status = open(f'/proc/{pid}/status').read()\n"
        "        if int(status.split('SigBlk:')[1].split()[0], 16) & (1 << (signal.SIGINT - 1)):\n"
        "            break\n"
        "        time.sleep(0.01)\n"
        "    os.killpg(0, signal.SIGTERM)\n"
        "    time.sleep(0.5)\n"
        "print('block ended')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # This checkout's shardmem.
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          start_new_session=True, env={**os.environ, "PYTHONPATH": root})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["stop at the next step", "block ended"] and done.stderr == ""


def test_a_block_that_ends_normally_prints_nothing_of_what_it_silenced(capfd):
    from shardmem._quiet import _watchers, native_stderr_silenced

    with native_stderr_silenced(watch=True):
        os.write(2, b"Could not find cuda drivers\n")
        with native_stderr_silenced():  # Nested blocks share the outer one.
            os.write(2, b"inner noise\n")
    os.write(2, b"after\n")
    assert not _watchers  # The watcher ended with the block: no child process left behind.
    assert capfd.readouterr().err == "after\n"


def test_mu_dtype_with_sgd_is_warned_about():
    # Issue 20, item 14: sgd keeps no first moment, so optimizer.mu_dtype silently did nothing.
    sgd = load_config(TINY, ["optimizer.name=sgd", "optimizer.mu_dtype=bfloat16", "model.n_layers=2",
                             "remat.layers={}"])  # fmt: skip
    report = shardmem.plan(sgd, target="cpu", count_remat_overhead=False)
    assert "optimizer.mu_dtype=bfloat16 does nothing with optimizer.name=sgd (no first moment is kept)" in (
        "\n".join(report.warnings)
    )
    adam = shardmem.plan(sgd.replace("optimizer.name=adamw"), target="cpu", count_remat_overhead=False)
    assert not any("mu_dtype" in w for w in adam.warnings)


def test_the_tune_summary_keeps_each_figure_on_one_line():
    # Issue 20, item 14: in a narrow terminal the figures wrapped, "0 B" into "0" over "B".
    import io

    from rich.console import Console

    from shardmem.explore.tune import Trial, TuneResult, render_tune

    why = "the cheapest plan that fits: it recomputes the attention only, keeping the MLP's projections"
    trials = [
        Trial("remat.policy=minimal remat.layers={0-3: full}", (), 2**30, 0, 0.123, True, "compiled", why)
    ]
    result = TuneResult("remat", None, None, trials[0], trials, 1, 2**31, "cpu", ["searched 1", "chose it"])
    out = Console(file=io.StringIO(), width=60)
    out.print(render_tune(result))
    lines = out.file.getvalue().splitlines()
    row = next((line for line in lines if "fits" in line), "")
    assert all(figure in row for figure in ("1.00 GiB", "0 B", "+12.3%")), "\n".join(lines)


def test_the_default_sweep_output_folder_is_ignored_by_git():
    # Issue 20, item 14: `sweep` without --out writes sweep-<config name>/ into the checkout.
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "check-ignore", "-q", "sweep-tiny/sweep.csv"], cwd=root)
    assert done.returncode == 0, "sweep-*/ is missing from .gitignore"


# Issue 30: what a new user and an adversary hit.
@pytest.mark.parametrize("target, slices", [("100000xv5e-256", "100,000"), ("5000xv5e-256", "5,000")])
def test_a_runaway_slice_count_is_one_line_before_any_topology_is_built(target, slices, capsys, monkeypatch):
    # 100000xv5e-256 was OOM-killed at 18 GB building 25.6 million devices; 5000x ran 28 s to an error.
    from shardmem.cli import main
    from shardmem.planning import targets

    def built(*args):
        raise AssertionError("a topology was built")

    monkeypatch.setattr(targets, "_tpu_topology", built)
    assert main(["plan", TINY, "--target", target]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"target '{target}': {slices} slices of 256 chips make" in err
    assert "at most 256 such slices (256xv5e-256)" in err


JOBS = "use 1 or more worker processes, or omit it for one per CPU"
OPTIONS = {  # Each was silently accepted, or read another way than its neighbours (issue 30, item 5).
    "tune --max-compiles 0": "--max-compiles 0: --search remat needs at least 2",  # Was: the default, 40.
    "tune --max-compiles -3": "--max-compiles -3: --search remat needs at least 2",
    "tune --search layout --max-compiles 2": "--max-compiles 2: --search layout needs at least 3: two",
    "tune --search layout --jobs -2": f"--jobs -2: {JOBS}",  # Was: one worker.
    "tune --search layout --jobs 0": f"--jobs 0: {JOBS}",
    "sweep --grid remat.policy=none,full --jobs 0": f"--jobs 0: {JOBS}",
    "sweep --grid remat.policy=none,full --jobs -2": f"--jobs -2: {JOBS}",
    "sweep --grid remat.policy=none,full --steps 3": "--steps 3: only --measure times steps",  # Was: ignored.
    "tune --objective throughput": "--objective throughput: only --search layout or serve uses it (this is "
    "--search remat); add --search layout, or drop --objective",  # Was: ignored.
    "tune --search batch --jobs 2": "--jobs 2: only --search layout uses it (this is --search batch)",
    "plan --top -1": "--top -1: give the number of buffers to list, 0 or more",
    "tune --search serve --no-offload": "--no-offload: --search serve offloads nothing to host memory",
    "tune --search batch --no-offload": "--no-offload: only --search remat or layout chooses what to offload "
    "(this is --search batch",  # Was: ignored, a config's remat.policy=offload kept.
    "tune --search micro_batches --no-offload": "--no-offload: only --search remat or layout chooses",
}


@pytest.mark.parametrize("command", list(OPTIONS))
def test_numeric_and_search_options_are_checked_alike_before_any_compile(command, capsys, monkeypatch):
    from shardmem.cli import main
    from shardmem.planning import memory

    def compiled(*args, **kwargs):
        raise AssertionError("compiled before checking the options")

    monkeypatch.setattr(memory, "_compile", compiled)
    name, *args = command.split()
    assert main([name, TINY, "--target", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"shardmem: error: {OPTIONS[command]}"), err


@pytest.mark.parametrize(
    "args, error",
    [
        (["plan", TINY, "--set", "model.n_heads=3"], "model.n_kv_heads=2 does not divide model.n_heads=3"),
        (["tune", TINY, "--max-compiles", "0"], "--max-compiles 0: --search remat needs at least 2"),
        (["sweep", TINY, "--grid", "remat.policy=none", "--jobs", "0"], "--jobs 0: use 1 or more"),
        (["plan", TINY, "--bogus"], "unrecognized arguments: --bogus"),  # argparse's own.
    ],
)
def test_with_json_an_error_is_a_json_object_on_stdout_too(args, error, capsys, monkeypatch):
    # A script reading `--json` output got nothing to parse on a malformed input (issue 30's bar).
    import json

    from shardmem.cli import main
    from shardmem.planning import memory

    def compiled(*args, **kwargs):
        raise AssertionError("compiled before checking the input")

    monkeypatch.setattr(memory, "_compile", compiled)
    try:
        code = main([*args, "--target", "cpu", "--json"])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2 and json.loads(out)["exit_code"] == 2
    assert error in json.loads(out)["error"] and error in err and "Traceback" not in err


def test_tune_out_never_overwrites_the_input_config(tmp_path, capsys, monkeypatch):
    # It did: the file's comments and its remat plan were lost (issue 30, item 7).
    from shardmem.cli import main

    config = tmp_path / "mine.yaml"
    text = "# my notes\n" + open(TINY).read()
    config.write_text(text)
    (tmp_path / "link.yaml").hardlink_to(config)
    monkeypatch.chdir(tmp_path)
    for out in ("mine.yaml", "./mine.yaml", str(config), "link.yaml"):
        assert main(["tune", str(config), "--target", "cpu", "--out", out]) == 2
        err = capsys.readouterr().err
        fix = f"write beside it, e.g. --out {out[:-5]}-tuned.yaml"
        assert err == (f"shardmem: error: --out {out!r} is the input config, which the tuned one would "
                       f"overwrite (its comments lost); {fix}\n")  # fmt: skip
    assert config.read_text() == text


def test_plan_html_and_png_never_overwrite_the_input_config_or_each_other(tmp_path, capsys, monkeypatch):
    # `plan configs/tiny.yaml --png configs/tiny.yaml` wrote the picture over the config (exit 0).
    from shardmem.cli import main
    from shardmem.planning import memory

    def compiled(*args, **kwargs):
        raise AssertionError("compiled before checking the paths")

    monkeypatch.setattr(memory, "_compile", compiled)
    config = tmp_path / "mine.yaml"
    text = open(TINY).read()
    config.write_text(text)
    monkeypatch.chdir(tmp_path)
    for flag, ext in (("--png", ".png"), ("--html", ".html")):
        for out in ("mine.yaml", "./mine.yaml", str(config)):
            assert main(["plan", str(config), flag, out]) == 2
            err = capsys.readouterr().err
            assert err == (f"shardmem: error: {flag} {out!r} is the input config, which the timeline would "
                           f"overwrite; write it beside it, e.g. {flag} {out[:-5]}{ext}\n")  # fmt: skip
    assert config.read_text() == text
    assert main(["plan", str(config), "--html", "plan.out", "--png", "./plan.out"]) == 2
    assert capsys.readouterr().err == ("shardmem: error: --html and --png both name './plan.out': the image "
                                       "would overwrite the page; give each a file of its own\n")  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.yaml"]


def test_unannotated_parameters_are_no_news_on_a_data_parallel_mesh():
    # Issue 30, item 13: a model of someone else's (no logical axes) planned on data parallelism alone was
    # warned its parameters are replicated, as every device holds them by design there.
    from jax.sharding import PartitionSpec

    from shardmem.parallel.rules import Rules, ShardingRow

    rows = [ShardingRow("transformer/h_0/attn/c_attn/kernel", (768, 2304), "float32", (), PartitionSpec(),
                        768 * 2304 * 4, 768 * 2304 * 4),
            ShardingRow("wte/embedding", (50257, 768), "float32", ("vocab", "rotary"), PartitionSpec(),
                        50257 * 768 * 4, 50257 * 768 * 4)]  # fmt: skip

    def warnings(axes):
        mesh = shardmem.build_mesh(axes, jax.devices()[:8])
        return rule_warnings(rows, Rules.from_config({}, mesh.axis_names, {}), mesh)  # The defaults.

    assert warnings({"data": 8, "fsdp": 1, "tensor": 1}) == []
    sharded = warnings({"data": 2, "fsdp": 4, "tensor": 1})  # Here the rules could have sharded them.
    assert any(w.startswith("parameters without logical axes (replicated): transformer/h_0") for w in sharded)
    assert any(w.startswith("logical axes with no rule (replicated): rotary") for w in sharded)


FAILED = "XLA failed: xla_gpu_enable_triton_gemm=False"


@pytest.mark.parametrize(
    "text, limit, clipped",
    [
        ("short", 10, "short"),
        (f"{FAILED} was set", 46, f"{FAILED} ..."),
        (f"{FAILED} was set", 40, "XLA failed ..."),
        ("one, two, three", 12, "one, two ..."),
    ],
)  # fmt: skip
def test_long_notes_are_cut_at_a_word(text, limit, clipped):
    # layout.md once showed a note cut at "...triton_gemm=Fals" (issue 30, item 10).
    from shardmem.units import clip

    assert clip(text, limit) == clipped
