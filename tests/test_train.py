"""Tests for shardmem.run.training and the ``train``/``launch`` commands: the gate, the loop, checkpoints,
preemption, resuming (after kill -9, and onto a different mesh), divergence and multi-process runs.

Subprocess runs use ``python -m shardmem`` like a user would; they share a persistent compilation
cache so that only the first one pays for compiling the step.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from rich.console import Console

from shardmem.cli import main
from shardmem.config import load_config
from shardmem.errors import ConfigError
from shardmem.parallel.mesh import build_mesh
from shardmem.program import build_program
from shardmem.run.checkpoint import Checkpointer, CheckpointError
from shardmem.run.metrics import format_record, read_metrics
from shardmem.run.training import DivergedError, DoesNotFitError, _utilization, train

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
STEPS = 24
# The tiny model with two layers and one remat segment compiles fast; every step is logged.
FAST = ["model.n_layers=2", "remat.layers={}", "remat.policy=none", "optimizer.warmup_steps=2",
        "train.log_every=1", f"train.steps={STEPS}", "train.checkpoint_every=4"]  # fmt: skip
FSDP_OVER_ALL = "mesh.axes={data: 1, fsdp: -1, tensor: 1}"


def _sets(overrides):
    return [arg for item in overrides for arg in ("--set", item)]


@pytest.fixture(scope="module")
def child_env(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDMEM_", "SLURM_", "OMPI_"))}
    env.pop("JOB_COMPLETION_INDEX", None)
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax-cache")),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    return env


def _run(env, *args, timeout=240):
    return subprocess.run([sys.executable, "-m", "shardmem", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def _start(env, *args):
    return subprocess.Popen([sys.executable, "-m", "shardmem", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _wait_for_step(process, run_dir: Path, step: int, timeout: float = 180) -> int:
    """Returns the newest logged step once it reaches ``step`` (polling metrics.jsonl)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = read_metrics(run_dir / "metrics.jsonl")
        if records and records[-1]["step"] >= step:
            return records[-1]["step"]
        if process.poll() is not None:
            output = process.stdout.read()
            pytest.fail(f"the run ended (exit {process.returncode}) before step {step}:\n{output}")
        time.sleep(0.005)
    process.kill()
    pytest.fail(f"no step {step} within {timeout} s")


def _wait_for_committed_checkpoint(process, run_dir: Path, timeout: float = 120) -> None:
    """Waits until a checkpoint is committed (Orbax renames a finished step's folder to its number)."""
    checkpoints = run_dir / "checkpoints"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir()):
            return
        if process.poll() is not None:
            pytest.fail(f"the run ended (exit {process.returncode}) before its first checkpoint")
        time.sleep(0.005)
    process.kill()
    pytest.fail(f"no checkpoint committed within {timeout} s")


def _restore(run_dir: Path, config, devices, step: int):
    program = build_program(config, build_mesh(config.mesh.axes, devices))
    with Checkpointer(run_dir / "checkpoints", every=1, keep=1) as checkpointer:
        return checkpointer.restore(program.abstract_state, step)


def _assert_trees_equal(actual, expected, **tolerance):
    paths = jax.tree_util.tree_leaves_with_path(expected)
    for (path, want), got in zip(paths, jax.tree.leaves(actual), strict=True):
        check = np.testing.assert_allclose if tolerance else np.testing.assert_array_equal
        check(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path), **tolerance)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted in-process run of the fast tiny config on the 8 test devices."""
    config = load_config(TINY, FAST)
    run_dir = tmp_path_factory.mktemp("reference")
    return config, train(config, run_dir, console=Console(quiet=True))


@pytest.mark.newest
def test_train_writes_the_run_dir_and_the_loss_falls(reference):
    config, result = reference
    assert (result.status, result.start_step, result.final_step) == ("finished", 0, STEPS)
    run_dir = result.run_dir
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records == result.history
    assert all(r["tokens_per_s"] > 0 and r["step_time_s"] > 0 for r in records[1:])
    assert "mfu" not in records[-1], "no MFU without a known peak FLOP/s (CPU)"
    assert records[-1]["loss"] < records[0]["loss"] - 1.0, [r["loss"] for r in records]
    assert load_config(run_dir / "config.yaml") == config
    assert json.loads((run_dir / "plan.json").read_text())["fits"] is True
    with Checkpointer(run_dir / "checkpoints", every=1, keep=3) as checkpointer:
        assert checkpointer.all_steps() == [16, 20, 24]  # every 4 steps, the last 3 kept
    assert int(result.state["step"]) == STEPS


@pytest.mark.newest
def test_one_process_trains_with_the_plans_compiled_step(tmp_path, monkeypatch):
    import shardmem.run.training

    built = []
    monkeypatch.setattr(shardmem.run.training, "build_program",
                        lambda *a, **k: built.append(build_program(*a, **k)) or built[-1])  # fmt: skip
    result = train(load_config(TINY, [*FAST, "train.steps=3"]), tmp_path, console=Console(quiet=True))
    assert result.final_step == 3 and len(built) == 1
    if not hasattr(built[0].step, "_cache_size"):
        pytest.skip("this JAX's jit has no _cache_size()")
    assert built[0].step._cache_size() == 0, "the step was compiled again on its first call"


def test_a_start_that_fails_before_its_first_step_leaves_the_run_directory_as_it_was(tmp_path):
    # The weights to start from are missing: found after the compile, once the run directory is set up.
    config = load_config(TINY, [*FAST, f"finetune.init_from={tmp_path / 'none.safetensors'}"])
    with pytest.raises(ConfigError, match="finetune.init_from"):
        train(config, tmp_path / "runs" / "new", console=Console(quiet=True))
    assert not (tmp_path / "runs").exists(), "a new run directory (and runs/, which it made) stays"
    there = tmp_path / "there"
    there.mkdir()
    (there / "notes.txt").write_text("the user's")
    with pytest.raises(ConfigError, match="finetune.init_from"):
        train(config, there, console=Console(quiet=True))
    assert [p.name for p in there.iterdir()] == ["notes.txt"], "its run.lock or checkpoints/ stays"


@pytest.mark.newest
def test_checkpoint_restores_exactly_onto_half_the_devices(reference):
    config, result = reference
    restored = _restore(result.run_dir, config, jax.devices()[:4], STEPS)
    meshes = {tuple(leaf.sharding.mesh.shape.items()) for leaf in jax.tree.leaves(restored)}
    assert meshes == {(("data", 2), ("fsdp", 2), ("tensor", 1))}
    _assert_trees_equal(restored, result.state)


def test_kill_9_then_restart_ends_with_the_uninterrupted_parameters(reference, child_env, tmp_path):
    config, result = reference
    kill_at = random.Random().randint(2, STEPS - 6)
    run_dir = tmp_path / "run"
    args = ["train", TINY, *_sets(FAST), "--run-dir", str(run_dir)]
    process = _start(child_env, *args)
    killed_at = _wait_for_step(process, run_dir, kill_at)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    with Checkpointer(run_dir / "checkpoints", every=1, keep=3) as checkpointer:
        assert checkpointer.latest_step() is None or checkpointer.latest_step() < STEPS

    restarted = _run(child_env, *args)
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    message = f"killed at step {killed_at} (asked for {kill_at})"
    _assert_trees_equal(_restore(run_dir, config, jax.devices(), STEPS), result.state)
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), message
    assert [r["loss"] for r in records] == [r["loss"] for r in result.history], message


@pytest.mark.slow
def test_sigterm_saves_and_the_run_resumes_on_a_smaller_mesh(reference, child_env, tmp_path):
    config, result = reference
    run_dir = tmp_path / "run"
    args = ["train", TINY, *_sets(FAST), "--run-dir", str(run_dir)]
    process = _start(child_env, *args)
    _wait_for_step(process, run_dir, 1)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 0, output
    stopped = read_metrics(run_dir / "metrics.jsonl")[-1]["step"]
    assert stopped < STEPS, "SIGTERM came too late to test anything"
    assert f"stopped by SIGTERM at step {stopped}" in output
    assert "Traceback" not in output
    with Checkpointer(run_dir / "checkpoints", every=1, keep=3) as checkpointer:
        assert checkpointer.latest_step() == stopped
    _assert_trees_equal(_restore(run_dir, config, jax.devices(), stopped)["step"], np.int32(stopped))

    resumed = _run(child_env, *args, "--local-devices", "4")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming from step {stopped}" in resumed.stdout
    assert "mesh data=2 fsdp=2 tensor=1 over 4 devices" in resumed.stdout
    losses = [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")]
    # Another mesh sums in another order: the same run up to rounding.
    np.testing.assert_allclose(losses, [r["loss"] for r in result.history], rtol=1e-4)


def test_a_failed_resume_leaves_the_run_files_and_a_finished_run_says_how_to_continue(reference, tmp_path):
    config, result = reference
    run_dir = tmp_path / "run"
    shutil.copytree(result.run_dir, run_dir)
    console = Console(record=True, width=300)
    again = train(config, run_dir, console=console)
    assert (again.status, again.start_step, again.final_step) == ("finished", STEPS, STEPS)
    text = console.export_text()
    assert f"already trained to step {STEPS}" in text and "the rate jumps" in text, text
    before = {name: (run_dir / name).read_bytes() for name in ("config.yaml", "plan.json")}
    fewer = train(config.replace(f"train.steps={STEPS - 1}"), run_dir, console=Console(quiet=True))
    assert (fewer.status, fewer.final_step) == ("finished", STEPS)
    # Nothing ran, so the run's record stays: it took the smaller train.steps, and the next start of the
    # run's own command said "train changed".
    assert {name: (run_dir / name).read_bytes() for name in before} == before
    with pytest.raises(ConfigError) as refused:
        train(load_config(TINY, [*FAST, "model.d_model=128"]), run_dir, console=Console(quiet=True))
    assert {name: (run_dir / name).read_bytes() for name in before} == before
    # One line naming the key that changed (it was a page of optimizer-state paths, no key named).
    message = str(refused.value)
    assert "\n" not in message and message.startswith("model.d_model=128 (was 64): this run's"), message
    assert "set them back, or start a new --run-dir" in message
    (run_dir / "config.yaml").unlink()  # No record of the last start: the arrays that differ, in one line.
    with pytest.raises(ConfigError, match="does not match the state being restored: ") as refused:
        train(load_config(TINY, [*FAST, "model.d_model=128"]), run_dir, console=Console(quiet=True))
    message = str(refused.value)
    assert "\n" not in message and "more; restore with the model and optimizer" in message, message


def test_resuming_a_fine_tune_with_another_lora_alpha_is_refused_before_it_writes(tmp_path):
    lora = "finetune.lora={rank: 4, alpha: 8, targets: [layers/wq]}"
    run_dir = tmp_path / "run"
    first = train(load_config(TINY, [*FAST, lora, "train.steps=4"]), run_dir, console=Console(quiet=True))
    assert first.final_step == 4
    before = {name: (run_dir / name).read_bytes() for name in ("config.yaml", "plan.json")}
    changed = load_config(TINY, [*FAST, lora.replace("alpha: 8", "alpha: 16"), "train.steps=6"])
    with pytest.raises(ConfigError, match=r"finetune.lora.alpha=16.0, but this run's checkpoints were "
                                          r"trained with finetune.lora.alpha=8.0"):  # fmt: skip
        train(changed, run_dir, console=Console(quiet=True))  # The adapters' scale would change silently.
    assert {name: (run_dir / name).read_bytes() for name in before} == before


def test_resuming_a_fine_tune_takes_its_base_by_another_path_to_it_but_not_another_base(
    tmp_path, monkeypatch
):
    """init_from was compared as text: the same folder by a relative path, or with a trailing slash (as
    tab completion writes it), was refused as another base ("resuming would mix the two"). A resume
    restores the base from the run's checkpoint, so it needs no init_from folder: it refused one gone."""
    base = train(load_config(TINY, [*FAST, "train.steps=2"]), tmp_path / "base", console=Console(quiet=True))
    lora = "finetune.lora={rank: 4, alpha: 8, targets: [layers/wq]}"
    run_dir = tmp_path / "run"
    first = load_config(TINY, [*FAST, lora, "train.steps=2", f"finetune.init_from={base.run_dir}"])
    assert train(first, run_dir, console=Console(quiet=True)).final_step == 2
    monkeypatch.chdir(tmp_path)
    same = load_config(TINY, [*FAST, lora, "train.steps=3", "finetune.init_from=base/"])
    assert train(same, run_dir, console=Console(quiet=True)).final_step == 3
    (tmp_path / "base").rename(tmp_path / "elsewhere")  # The run, moved to where its base is not.
    console = Console(record=True, width=400)
    gone = load_config(TINY, [*FAST, lora, "train.steps=4", "finetune.init_from=base/"])
    assert train(gone, run_dir, console=console).final_step == 4
    assert "warning" not in console.export_text(), console.export_text()
    (tmp_path / "elsewhere").rename(tmp_path / "base")
    shutil.copytree(tmp_path / "base", tmp_path / "other")
    other = load_config(TINY, [*FAST, lora, "train.steps=5", "finetune.init_from=other"])
    said = r"init_from='other', but this run's checkpoints were trained with finetune.init_from='base/'"
    with pytest.raises(ConfigError, match=said):
        train(other, run_dir, console=Console(quiet=True))


def test_mfu_counts_model_flops_and_hfu_the_recomputation_too():
    report = SimpleNamespace(flops_per_step=150.0, flops_no_remat=100.0)
    assert _utilization(report, 2.0, 100.0) == {"mfu": 0.5, "hfu": 0.75}
    no_remat = SimpleNamespace(flops_per_step=100.0, flops_no_remat=None)
    assert _utilization(no_remat, 2.0, 100.0) == {"mfu": 0.5, "hfu": 0.5}
    assert _utilization(report, 2.0, None) == {}, "no MFU without a known peak FLOP/s"
    line = format_record({"step": 3, "loss": 1.0, "mfu": 0.5, "hfu": 0.75})
    assert "MFU 50.0% (HFU 75.0%)" in line


def test_gate_refuses_a_step_that_does_not_fit_before_allocating(tmp_path):
    config = load_config(TINY, [*FAST, "memory.reserve=0", "memory.usable_fraction=0.000001"])
    gc.collect()  # Earlier tests' garbage, freed during the call, made the count fall (CI: 552 -> 474).
    live_before = {id(array) for array in jax.live_arrays()}
    with pytest.raises(DoesNotFitError, match=r"budget is [\d.]+ KiB .*--force") as raised:
        train(config, tmp_path / "run", console=Console(quiet=True))
    assert not raised.value.report.fits
    gc.collect()
    allocated = [array.shape for array in jax.live_arrays() if id(array) not in live_before]
    assert not allocated, f"the gate allocated arrays: {allocated[:5]}"
    assert not (tmp_path / "run").exists()


# Adam with a huge step makes the gradients NaN on the 2nd step and the loss on the 3rd.
UNSTABLE = ["optimizer.learning_rate=1e30", "optimizer.warmup_steps=0", "optimizer.grad_clip=null",
            "memory.reserve=0", "memory.usable_fraction=0.000001"]  # fmt: skip


def test_forced_run_that_diverges_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    config = load_config(TINY, [*FAST, *UNSTABLE, "train.checkpoint_every=1"])
    console = Console(record=True, width=200)
    diverged = r"step 2: metrics .*grad_norm nan.*last good checkpoint is step 1"
    with pytest.raises(DivergedError, match=diverged) as e:
        train(config, tmp_path, force=True, console=console)
    assert "rerun to resume from 1" in str(e.value)
    assert "running anyway (--force)" in console.export_text()
    assert (e.value.step, e.value.last_checkpoint) == (2, 1)
    with Checkpointer(tmp_path / "checkpoints", every=1, keep=3) as checkpointer:
        assert checkpointer.all_steps() == [1]
    saved = _restore(tmp_path, config, jax.devices(), 1)
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(saved))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_a_state_that_overflowed_is_not_saved_although_its_metrics_were_finite(tmp_path):
    # A rate that overflows float32: step 1's loss and gradient are finite, the parameters after it not.
    config = load_config(TINY, [*FAST, "optimizer.learning_rate=1e39", "optimizer.warmup_steps=0",
                                "optimizer.grad_clip=null", "train.checkpoint_every=1"])  # fmt: skip
    with pytest.raises(DivergedError, match="step 1: the parameters or optimizer state after it") as e:
        train(config, tmp_path, console=Console(quiet=True))
    assert e.value.last_checkpoint is None and "no checkpoint was saved" in str(e.value)
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["step"] == 1  # Its metrics were finite and logged.


def test_a_run_that_diverges_before_any_checkpoint_says_a_rerun_starts_over(tmp_path):
    config = load_config(TINY, [*FAST, *UNSTABLE, "train.checkpoint_every=100"])
    with pytest.raises(DivergedError, match="no checkpoint was saved") as e:
        train(config, tmp_path, force=True, console=Console(quiet=True))
    assert e.value.last_checkpoint is None
    assert "start again from step 0" in str(e.value) and "resume" not in str(e.value)


def test_bad_data_found_mid_run_keeps_the_steps_done(tmp_path, monkeypatch):
    import shardmem.run.data

    def global_batch(source, step, *args):
        if step == 5:  # What a token file raises on the batch that holds a bad id.
            raise ConfigError("`data.path='ids.npy'` contains token id 999, outside [0, 256)")
        return real(source, step, *args)

    real = shardmem.run.data.global_batch
    monkeypatch.setattr(shardmem.run.data, "global_batch", global_batch)
    config = load_config(TINY, [*FAST, "train.checkpoint_every=100"])
    with pytest.raises(ConfigError, match=r"the batch of step 6: .*token id 999.*steps up to 5 are saved"):
        train(config, tmp_path, console=Console(quiet=True))
    with Checkpointer(tmp_path / "checkpoints", every=1, keep=3) as checkpointer:
        assert checkpointer.all_steps() == [5]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    # In the first batch, before the first step: a new run directory goes, as on any failed start.
    monkeypatch.setattr(shardmem.run.data, "global_batch", lambda source, step, *args: global_batch(
        source, step + 5, *args))  # fmt: skip
    with pytest.raises(ConfigError, match=r"the batch of step 1: .*token id 999"):
        train(config, tmp_path / "new", console=Console(quiet=True))
    assert not (tmp_path / "new").exists()


def test_cli_config_errors_exit_2_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # start_runtime sets it otherwise
    run_dir = str(tmp_path / "run")
    cases = [
        (["--set", "train.steps=0"], "train.steps=0: must be positive"),
        (["--set", f"data.path={tmp_path / 'missing.txt'}"], "does not exist"),
    ]
    if importlib.util.find_spec("tensorboardX") is None:
        cases.append((["--set", "train.tensorboard=true"], "run `pip install tensorboardX`"))
    for args, message in cases:
        assert main(["train", TINY, "--run-dir", run_dir, *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("shardmem: error: ") and message in err, err
    assert not Path(run_dir).exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("kept\n")
    for under in (blocker, blocker / "run"):  # Before planning: a traceback after compiling otherwise.
        assert main(["train", TINY, "--run-dir", str(under)]) == 2
        assert f"'{blocker}' is a file; choose another --run-dir" in capsys.readouterr().err
    assert blocker.read_text() == "kept\n"
    theirs = tmp_path / "theirs"  # A folder of the user's with files of the names a run writes.
    theirs.mkdir()
    (theirs / "config.yaml").write_text("my: own\n")
    assert main(["train", TINY, "--run-dir", str(theirs)]) == 2
    assert "holds config.yaml but no shardmem run (no checkpoints folder): training would overwrite it" in \
        capsys.readouterr().err  # fmt: skip
    assert (theirs / "config.yaml").read_text() == "my: own\n" and sorted(theirs.iterdir()) == [
        theirs / "config.yaml"
    ]
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # As a user without write permission.
    assert main(["train", TINY, "--run-dir", str(tmp_path / "new")]) == 2
    assert f"cannot create it in '{tmp_path}' (permission denied)" in capsys.readouterr().err
    assert main(["launch", "--nproc", "2"]) == 2
    assert "needs a command after --" in capsys.readouterr().err


def test_cli_gate_exits_3_with_the_report(child_env, tmp_path):
    run_dir = tmp_path / "run"
    too_small = ["memory.reserve=0", "memory.usable_fraction=0.000001"]
    args = ["train", TINY, *_sets([*FAST, *too_small]), "--run-dir", str(run_dir)]
    done = _run(child_env, *args)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "DOES NOT FIT" in done.stdout and "--force" in done.stderr
    assert "Traceback" not in done.stderr
    assert not run_dir.exists()


@pytest.mark.newest
def test_a_planning_error_on_process_0_stops_every_process_alike(child_env, tmp_path):
    # 2 rows cannot be split over 4 devices: process 0's plan fails, and the other one must not wait.
    overrides = [FSDP_OVER_ALL, "train.global_batch=2"]
    launched = subprocess.run(
        [sys.executable, "-m", "shardmem", "launch", "--nproc", "2", "--local-devices", "2", "--",
         "train", TINY, *_sets(overrides), "--run-dir", str(tmp_path / "run")],
        env=child_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    output = launched.stdout + launched.stderr
    assert launched.returncode == 2, output
    for process in (0, 1):
        assert f"[{process}] shardmem: error: train.global_batch=2" in output, output
    assert "Traceback" not in output


@pytest.mark.slow  # Two processes training: CI runs test_cluster.py's mpirun and test_distributed.py's.
def test_two_processes_train_like_one_and_their_checkpoint_restores_in_one(child_env, tmp_path):
    overrides = [FSDP_OVER_ALL, "train.steps=6", "train.log_every=1", "train.checkpoint_every=3"]
    two, one = tmp_path / "two", tmp_path / "one"
    launched = subprocess.run(
        [sys.executable, "-m", "shardmem", "launch", "--nproc", "2", "--local-devices", "2", "--",
         "train", TINY, *_sets(overrides), "--run-dir", str(two)],
        env=child_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert "[0] shardmem train tiny: new run" in launched.stdout
    assert "mesh data=1 fsdp=4 tensor=1 over 4 devices in 2 processes" in launched.stdout
    single = _run(child_env, "train", TINY, *_sets(overrides), "--run-dir", str(one), "--local-devices", "4")
    assert single.returncode == 0, single.stdout + single.stderr

    curves = [[r["loss"] for r in read_metrics(d / "metrics.jsonl")] for d in (two, one)]
    assert len(curves[0]) == 6
    np.testing.assert_allclose(curves[0], curves[1], rtol=1e-5)
    config = load_config(TINY, overrides)
    from_two = _restore(two, config, jax.devices(), 6)  # 4 devices in 2 processes -> 8 in one
    _assert_trees_equal(from_two, _restore(one, config, jax.devices(), 6), rtol=1e-5, atol=1e-6)


def test_a_corrupt_newest_checkpoint_is_moved_aside_and_the_run_resumes_exactly(reference, tmp_path):
    config, result = reference
    run_dir = tmp_path / "run"
    shutil.copytree(result.run_dir, run_dir)
    checkpoints = run_dir / "checkpoints"
    assert sorted(int(p.name) for p in checkpoints.iterdir()) == [16, 20, 24]
    (checkpoints / "24" / "default" / "manifest.ocdbt").write_bytes(b"garbage")
    (checkpoints / "20" / "default" / "_METADATA").unlink()
    console = Console(record=True, width=400)
    again = train(load_config(TINY, FAST), run_dir, console=console)
    assert (again.start_step, again.final_step) == (16, STEPS)
    _assert_trees_equal(again.state, result.state)
    warnings = [line for line in console.export_text().splitlines() if "does not restore" in line]
    assert [w.split(" does not")[0] for w in warnings] == ["warning: checkpoint 24", "warning: checkpoint 20"]
    assert all("moved it to" in w and w.endswith("resuming from step 16") for w in warnings), warnings
    aside = sorted(p.name for p in checkpoints.iterdir() if ".corrupt-" in p.name)
    assert [name.split(".")[0] for name in aside] == ["20", "24"]


def test_a_checkpoint_that_fills_the_disk_stops_the_run_at_once(small_disk, caplog):
    run_dir = small_disk("2m") / "run"  # One checkpoint of the 2-layer tiny model (1.4 MiB) fits.
    caplog.set_level(logging.ERROR)
    with pytest.raises(CheckpointError) as error:
        train(load_config(TINY, FAST), run_dir, console=Console(quiet=True))
    assert not caplog.records, "Orbax's ERROR logs and tracebacks would bury the message"
    message = str(error.value)
    assert "No space left on device" in message and "the last good checkpoint is step 4" in message, message
    assert read_metrics(run_dir / "metrics.jsonl")[-1]["step"] <= 8 + 4, "went on training after the failure"
    with Checkpointer(run_dir / "checkpoints", every=1, keep=3) as checkpointer:
        assert checkpointer.all_steps() == [4]


@pytest.mark.slow
def test_a_double_ctrl_c_ends_the_run_without_a_traceback_and_it_resumes(child_env, tmp_path):
    run_dir = tmp_path / "run"
    args = ["train", TINY, *_sets([*FAST, "train.steps=400"]), "--run-dir", str(run_dir)]
    process = _start(child_env, *args)
    _wait_for_step(process, run_dir, 6)
    # The second Ctrl-C drops the save in progress by design: under load, step 4's background save can
    # still be running at step 6, and then there is nothing to resume from. Interrupt once one is committed.
    _wait_for_committed_checkpoint(process, run_dir)
    process.send_signal(signal.SIGINT)
    time.sleep(random.uniform(0.0, 0.3))  # Lands in the last steps, the final save or the teardown.
    process.send_signal(signal.SIGINT)
    output = process.communicate(timeout=120)[0]
    assert process.returncode in (130, -signal.SIGINT), output
    assert "Traceback" not in output and "ERROR" not in output, output
    resumed = _run(child_env, *args[:-2], "--set", "train.steps=30", "--run-dir", str(run_dir))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming from step" in resumed.stdout


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its SigCgt mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


@pytest.mark.slow
def test_a_sigterm_while_starting_stops_the_run_saved_before_its_first_step(child_env, tmp_path):
    run_dir = tmp_path / "run"
    process = _start(child_env, "train", TINY, *_sets(FAST), "--run-dir", str(run_dir))
    deadline = time.monotonic() + 120
    while not _catches(process.pid, signal.SIGTERM):  # Set by start_runtime, before planning.
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=180)[0]
    assert process.returncode == 0, output
    assert "stopped by SIGTERM at step 0" in output and "Traceback" not in output, output
    with Checkpointer(run_dir / "checkpoints", every=1, keep=1) as checkpointer:
        assert checkpointer.latest_step() == 0


def test_a_save_a_killed_run_left_unfinished_is_deleted_at_the_start_with_a_note(reference, tmp_path):
    # Issue 20, item 11: kill -9 during a save left checkpoints/<step>.orbax-checkpoint-tmp, a partial
    # checkpoint as large as a whole one, on disk forever.
    config, result = reference
    run_dir = tmp_path / "run"
    shutil.copytree(result.run_dir, run_dir)
    unfinished = run_dir / "checkpoints" / "22.orbax-checkpoint-tmp-1764600000"
    (unfinished / "default").mkdir(parents=True)
    (unfinished / "default" / "data").write_bytes(b"half a checkpoint")
    console = Console(record=True, width=400)
    again = train(config, run_dir, console=console)
    assert again.start_step == STEPS and not unfinished.exists()
    (note,) = [line for line in console.export_text().splitlines() if "unfinished" in line]
    assert note == (f"note: deleted the unfinished checkpoint save 22.orbax-checkpoint-tmp-1764600000 that a "
                    f"stopped run left in {run_dir / 'checkpoints'}")  # fmt: skip
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["16", "20", "24"]


def test_a_run_dir_on_a_read_only_file_system_says_so(small_disk, capsys, monkeypatch):
    # Issue 20, item 14: it said "permission denied", which sends a user to chmod.
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # start_runtime sets it otherwise
    disk = small_disk("1m")
    done = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot remount read-only: {done.stderr.strip()}")
    for run_dir in (disk, disk / "run"):
        assert main(["train", TINY, "--run-dir", str(run_dir)]) == 2
        assert "(read-only file system); choose another --run-dir" in capsys.readouterr().err


def test_resuming_with_another_mu_dtype_says_the_state_is_cast(reference, tmp_path):
    # Issue 20, item 14: the optimizer state was cast to the new optimizer.mu_dtype without a word.
    config, result = reference
    run_dir = tmp_path / "run"
    shutil.copytree(result.run_dir, run_dir)
    console = Console(record=True, width=400)
    again = train(config.replace("optimizer.mu_dtype=bfloat16"), run_dir, console=console)
    assert again.start_step == STEPS
    (note,) = [line for line in console.export_text().splitlines() if "casts" in line]
    assert (
        note.startswith(f"note: checkpoint {STEPS} casts ")
        and "(float32 -> bfloat16; e.g. opt_state/" in note
    )
    assert "mu" in note and note.endswith(
        "optimizer.mu_dtype or precision.params differ from the run that saved it"
    )
    quiet = Console(record=True, width=400)
    train(config, run_dir, console=quiet)  # The same dtypes: nothing to say.
    assert "casts" not in quiet.export_text()


@pytest.mark.slow
def test_float16_run_counts_skipped_overflows_and_resumes_with_its_loss_scale(tmp_path, monkeypatch):
    from shardmem.program import optimizer

    monkeypatch.setattr(optimizer, "INITIAL_LOSS_SCALE", 2.0**30)  # Overflows float16 until halved ~12 times.
    fp16 = ["precision.compute=float16", "train.steps=20", "train.checkpoint_every=20"]
    config = load_config(TINY, [*FAST, *fp16])
    first = train(config, tmp_path, console=Console(quiet=True))
    scales = [r["loss_scale"] for r in first.history]
    skipped = [r["skipped_steps"] for r in first.history]
    assert scales[0] == 2.0**30 and scales == sorted(scales, reverse=True) and 1 < scales[-1] <= 2.0**20
    assert skipped == sorted(skipped) and 10 <= skipped[-1] <= 14
    assert all(r["grad_norm"] >= 0 for r in first.history)  # 0 on a skipped step, not inf.
    assert first.history[-1]["loss"] < first.history[0]["loss"]
    assert "loss scale" in format_record(first.history[-1]) and "skipped)" in format_record(first.history[-1])
    again = train(config.replace("train.steps=22"), tmp_path, console=Console(quiet=True))
    assert again.start_step == 20 and again.history[0]["loss_scale"] == scales[-1]
    assert again.history[0]["skipped_steps"] == skipped[-1]
