"""Real schedulers: examples/slurm.sbatch on a single-node SLURM cluster, and Open MPI's mpirun.

``scripts/cluster.sh start`` installs Debian's slurm-wlm, munge and openmpi-bin when they are missing
and starts slurmctld and slurmd (one node, this machine's CPUs); the tests skip, saying why, only where
that cannot be done (not root, no apt-get, no network). The sbatch script runs as shipped, with sbatch
options and environment variables adapting it to 2 tasks of 2 simulated CPU devices each.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from shardmem.config import load_config
from shardmem.parallel.mesh import build_mesh
from shardmem.program import build_program
from shardmem.run.checkpoint import Checkpointer
from shardmem.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
STEPS = 40
OVERRIDES = ["model.n_layers=1", "remat.layers={}", "remat.policy=none", "optimizer.warmup_steps=2",
             "train.log_every=1", f"train.steps={STEPS}", "train.checkpoint_every=1000",
             "mesh.axes={data: 2, fsdp: -1, tensor: 1}"]  # fmt: skip
SBATCH_CPU = ["--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
              "--time=15"]  # fmt: skip


def _sets(overrides):
    return [arg for item in overrides for arg in ("--set", item)]


@pytest.fixture(scope="module")
def job_env(tmp_path_factory):
    """The environment jobs inherit: this checkout first, CPU devices, a shared compilation cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDMEM_", "SLURM_", "OMPI_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        JAX_PLATFORMS="cpu",
        SHARDMEM_LOCAL_DEVICES="2",
        SHARDMEM=f"{sys.executable} -m shardmem",
        PYTHONUNBUFFERED="1",
        JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax-cache")),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    return env


@pytest.fixture(scope="module")
def slurm():
    started = subprocess.run(["bash", str(ROOT / "scripts" / "cluster.sh"), "start"], capture_output=True,
                             text=True, timeout=600)  # fmt: skip
    if started.returncode != 0:
        pytest.skip(f"no SLURM cluster: {(started.stderr.strip().splitlines() or ['?'])[-1]}")


def _submit(env, out: Path, *options: str, args=()) -> str:
    done = subprocess.run(
        ["sbatch", "--parsable", *SBATCH_CPU, f"--output={out}", *options,
         str(ROOT / "examples" / "slurm.sbatch"), TINY, *_sets(OVERRIDES), *args],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout.strip().split(";")[0]


def _job(job_id: str) -> dict[str, str]:
    text = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(item.split("=", 1) for item in text.split() if "=" in item)


def _wait_until_done(job_id: str, out: Path, timeout: float = 420) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = _job(job_id)
        if job.get("JobState") in (
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
        ):
            return job
        time.sleep(1)
    subprocess.run(["scancel", job_id])
    pytest.fail(f"job {job_id} still {_job(job_id).get('JobState')} after {timeout} s:\n{_read(out)}")


def _wait_for_step(run_dir: Path, step: int, job_id: str, out: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")][-1:] >= [step]:
            return
        if _job(job_id).get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
            pytest.fail(f"job {job_id} ended before step {step}:\n{_read(out)}")
        time.sleep(0.2)
    subprocess.run(["scancel", job_id])
    pytest.fail(f"no step {step} within {timeout} s:\n{_read(out)}")


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no output)"


def _final_state(run_dir: Path, step: int):
    config = load_config(TINY, OVERRIDES)
    program = build_program(config, build_mesh(config.mesh.axes, jax.devices()))
    with Checkpointer(run_dir / "checkpoints", every=1, keep=1) as checkpointer:
        return checkpointer.restore(program.abstract_state, step)


def test_slurm_time_limit_signal_requeues_and_resumes_to_the_same_parameters(slurm, job_env, tmp_path):
    reference_dir, requeued_dir = tmp_path / "reference", tmp_path / "requeued"
    reference_out, requeued_out = tmp_path / "reference.out", tmp_path / "requeued.out"
    reference = _submit(job_env, reference_out, args=["--run-dir", str(reference_dir)])
    # A long limit here, and the time-limit signal sent when the test wants it: SLURM sends
    # --signal=B:USR1@N "up to 60 s" early, and these jobs take seconds.
    requeued = _submit(job_env, requeued_out, "--signal=B:USR1@1", args=["--run-dir", str(requeued_dir)])
    _wait_for_step(requeued_dir, 3, requeued, requeued_out)
    subprocess.run(
        ["scancel", "--batch", "--signal=USR1", requeued], check=True
    )  # What the time limit sends.
    first = _wait_until_done(reference, reference_out)
    assert first["JobState"] == "COMPLETED", _read(reference_out)
    deadline = time.monotonic() + 420
    while _job(requeued).get("Restarts", "0") == "0" or _job(requeued).get("JobState") != "COMPLETED":
        assert time.monotonic() < deadline, _read(requeued_out)
        if _job(requeued).get("JobState") in ("FAILED", "CANCELLED", "TIMEOUT"):
            pytest.fail(_read(requeued_out))
        time.sleep(1)
    output = _read(requeued_out)
    assert "mesh data=2 fsdp=2 tensor=1 over 4 devices in 2 processes" in output, output
    stopped = [line for line in output.splitlines() if "stopped by SIGTERM at step" in line]
    assert stopped and "resuming from step" in output, output
    assert "Traceback" not in output, output
    for got, want in zip(jax.tree.leaves(_final_state(requeued_dir, STEPS)),
                         jax.tree.leaves(_final_state(reference_dir, STEPS)), strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_scancel_saves_a_checkpoint(slurm, job_env, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = _submit(job_env, out, args=["--run-dir", str(run_dir), "--set", "train.steps=100000"])
    _wait_for_step(run_dir, 3, job, out)
    subprocess.run(["scancel", job], check=True)
    _wait_until_done(job, out)
    with Checkpointer(run_dir / "checkpoints", every=1, keep=1) as checkpointer:
        saved = checkpointer.latest_step()
    assert saved is not None and saved >= 3, _read(out)


def test_mpirun_trains_across_two_processes(job_env, tmp_path):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        installed = subprocess.run(["bash", str(ROOT / "scripts" / "cluster.sh"), "install"],
                                   capture_output=True, text=True, timeout=600)  # fmt: skip
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            pytest.skip(f"no Open MPI: {(installed.stderr.strip().splitlines() or ['?'])[-1]}")
    env = {k: v for k, v in job_env.items() if k != "SHARDMEM"}
    root_flag = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    done = subprocess.run(
        [mpirun, *root_flag, "--oversubscribe", "-n", "2", "-x", "PYTHONPATH", "-x", "JAX_PLATFORMS",
         "-x", "SHARDMEM_LOCAL_DEVICES", "-x", "JAX_COMPILATION_CACHE_DIR",
         "-x", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", sys.executable, "-m", "shardmem", "train", TINY,
         *_sets([*OVERRIDES, "train.steps=6"]), "--run-dir", str(tmp_path / "run")],
        env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    output = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", done.stdout + done.stderr)  # mpirun gives them a tty
    assert done.returncode == 0, output
    assert "mesh data=2 fsdp=2 tensor=1 over 4 devices in 2 processes" in output, output
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == list(range(1, 7))
