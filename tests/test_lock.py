"""Tests for shardmem.run.lock: one run per run directory, stale locks taken over, the holder named."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shardmem.cli import main
from shardmem.errors import ConfigError
from shardmem.run.lock import RunDirLock

ROOT = Path(__file__).resolve().parents[1]
HOLD = "import sys, time; from shardmem.run.lock import RunDirLock; RunDirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)"  # noqa: E501


@pytest.fixture
def holder(tmp_path):
    """Another process that holds the lock of ``tmp_path`` until killed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], env=env, stdout=subprocess.PIPE,
                               text=True)  # fmt: skip
    assert process.stdout.readline().strip() == "held"
    yield process
    process.kill()
    process.wait()


def test_a_held_lock_names_its_holder_and_a_dead_one_is_taken_over(tmp_path, holder):
    with pytest.raises(ConfigError) as error:
        RunDirLock(tmp_path).acquire()
    message = str(error.value)
    assert f"is in use by pid {holder.pid} on host {socket.gethostname()} since " in message, message
    assert "choose another --run-dir" in message and "\n" not in message
    holder.send_signal(signal.SIGKILL)  # The kernel drops its lock; its name stays in the file.
    holder.wait()
    with RunDirLock(tmp_path) as lock:
        assert lock.stale and lock.stale.startswith(f"pid {holder.pid} on host "), lock.stale
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
        with pytest.raises(ConfigError, match=f"in use by pid {os.getpid()}"):
            RunDirLock(tmp_path).acquire()  # Also within one process.
    with RunDirLock(tmp_path) as again:
        assert again.stale is None, "a clean release is no stale lock"
    assert (tmp_path / "run.lock").read_text() == ""


def _no_flock(monkeypatch):
    def flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", flock)


def test_without_file_locks_the_holders_name_decides(tmp_path, monkeypatch):
    _no_flock(monkeypatch)
    lock_file = tmp_path / "run.lock"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # fmt: skip
    lock_file.write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead), "started": "then"}))
    with RunDirLock(tmp_path) as lock:
        assert lock.stale.startswith(f"pid {dead} on host")
    lock_file.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "started": "now"}))
    with pytest.raises(ConfigError, match=f"in use by pid {os.getppid()}"):
        RunDirLock(tmp_path).acquire()
    lock_file.write_text(json.dumps({"host": "node-17", "pid": 1234, "started": "now"}))
    with pytest.raises(ConfigError) as error:
        RunDirLock(tmp_path).acquire()
    assert "pid 1234 on host node-17" in str(error.value)
    assert f"if that run is gone, delete {str(lock_file)!r}" in str(error.value)


@pytest.mark.slow
def test_a_second_train_in_a_locked_run_dir_exits_2_naming_the_holder(tmp_path, holder, capsys):
    code = main(["train", str(ROOT / "configs" / "tiny.yaml"), "--set", "model.n_layers=1", "--set",
                 "remat.layers={}", "--run-dir", str(tmp_path)])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert f"shardmem: error: run directory {str(tmp_path)!r} is in use by pid {holder.pid}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.lock"], "the holder's files are untouched"


def test_a_locked_run_dir_is_reported_before_any_planning(tmp_path, holder, capsys, monkeypatch):
    # Issue 30, item 8: the lock was reported only after the step's compile (42 s for a large model).
    from shardmem.run import training

    def planned(*args, **kwargs):
        raise AssertionError("built or planned the step before checking the lock")

    monkeypatch.setattr(training, "build_program", planned)
    monkeypatch.setattr(training, "_plan_once", planned)
    assert main(["train", str(ROOT / "configs" / "tiny.yaml"), "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shardmem: error: run directory {str(tmp_path)!r} is in use by pid {holder.pid}")
    assert err.count("\n") == 1
    RunDirLock(tmp_path / "elsewhere").check()  # No lock file: nothing to say, nothing created.
    assert not (tmp_path / "elsewhere").exists()
