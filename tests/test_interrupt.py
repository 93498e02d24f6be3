"""Ctrl-C (SIGINT to the process group, as a terminal sends it) ends every command at once (issues 30, 41).

Each test starts its command in a process group of its own, interrupts the group at a moment it can
see (a line, a child process, a library loaded) or after a fixed time, and checks: exit 130 within 5 s
(not a segmentation fault), one line on stderr after what the command had printed, no traceback, no
process of the group left, and no file left half made. ``train`` from its first step on saves first.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


class Started:
    """A command in its own process group, its stdout and stderr read line by line as they come. It
    starts with SIGINT at its default, as a terminal's foreground command does (``sigint``:
    ``signal.SIG_IGN`` for a shell's background job), whatever the tests' own process has."""

    def __init__(self, argv, cwd=ROOT, sigint=signal.SIG_DFL):
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.process = subprocess.Popen(_with_sigint(argv, sigint), cwd=cwd, start_new_session=True, **pipes)
        self.lines: dict[str, list[str]] = {"out": [], "err": []}
        self.changed = threading.Condition()
        streams = {"out": self.process.stdout, "err": self.process.stderr}
        self.readers = [threading.Thread(target=self._read, args=(stream, name), daemon=True)
                        for name, stream in streams.items()]  # fmt: skip
        for reader in self.readers:
            reader.start()

    @property
    def err(self) -> list[str]:
        return self.lines["err"]

    def _read(self, stream, name: str):
        for line in stream:
            with self.changed:
                self.lines[name].append(line)
                self.changed.notify_all()

    def wait_for_line(self, text: str, count: int = 1, timeout: float = 240, stream: str = "err") -> None:
        lines = self.lines[stream]
        with self.changed:
            found = self.changed.wait_for(lambda: sum(text in line for line in lines) >= count, timeout)
        assert found, f"no {count}x {text!r} on std{stream} in {timeout} s: {''.join(lines)}"

    def wait_for_child(self, argv_part: str, count: int = 1, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = 0
            for pid in _group(self.process.pid):
                try:
                    found += argv_part in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
                except OSError:
                    pass
            if found >= count:
                return
            assert self.process.poll() is None, "".join(self.err)
            time.sleep(0.02)
        raise AssertionError(f"no {count}x child process with {argv_part!r} in {timeout} s")

    def wait_for_library(self, name: str, timeout: float = 240) -> None:
        """Waits until the command has loaded a shared library whose path holds ``name``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if name in Path(f"/proc/{self.process.pid}/maps").read_text():
                    return
            except OSError:
                pass
            assert self.process.poll() is None, "".join(self.err)
            time.sleep(0.005)
        raise AssertionError(f"no library {name!r} loaded in {timeout} s")

    def interrupt(self, within: float = 5) -> tuple[int, str, str]:
        """Sends SIGINT to the group; returns (exit status, stdout, stderr) once the command has exited
        and its group is gone, which must be ``within`` seconds. Its pipes' end is waited for apart: a
        process the test runner forked meanwhile (not the command's) can hold them open."""
        sent = time.monotonic()
        os.killpg(self.process.pid, signal.SIGINT)
        status = self.process.wait(timeout=30 + within)
        exited = time.monotonic() - sent
        while _group(self.process.pid) and time.monotonic() - sent < within:  # Zombies are reaped by init.
            time.sleep(0.05)
        elapsed = time.monotonic() - sent
        left = _group(self.process.pid)
        for reader in self.readers:
            reader.join(timeout=10)
        assert not left, f"processes left in the group: {left}"
        assert elapsed < within, f"took {elapsed:.1f} s (the command exited at {exited:.1f} s)"
        return status, "".join(self.lines["out"]), "".join(self.err)


def _with_sigint(argv: list[str], disposition) -> list[str]:
    """``argv``, run with SIGINT's disposition set first. Inherited, it would be the tests' own: ignored
    where the tests run in a background job (a non-interactive shell's ``pytest ... &``), so that every
    Ctrl-C of these tests was ignored until the command's first compile (the cause of the "~20 s" exits
    of a Ctrl-C while JAX was imported: they were runs that went on to finish)."""
    name = "SIG_IGN" if disposition is signal.SIG_IGN else "SIG_DFL"
    code = f"import os, signal, sys; signal.signal(signal.SIGINT, signal.{name}); os.execv(sys.argv[1], sys.argv[1:])"  # noqa: E501
    return [sys.executable, "-c", code, *argv]


def _group(pgid: int) -> list[int]:
    """The processes whose process group is ``pgid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                pids.append(int(entry))
    return pids


@pytest.mark.newest
def test_sigint_in_a_native_call_ends_the_block_workers_and_watchers_at_once(tmp_path):
    # The stand-in for a compile: a C call that never returns to Python, a spawned worker compiling (in
    # C, its stderr captured, with XLA's complaint about memory in it), and watchers in both. The worker's
    # watcher sees its process end as after a crash, yet must not say so (issue 41 item 3).
    script = tmp_path / "blocked.py"
    script.write_text(
        "import ctypes, multiprocessing, os, time\n"
        "from shardmem._interrupt import ends_on_interrupt\n"
        "from shardmem._quiet import native_stderr_silenced\n"
        "def compile_in_c():\n"
        "    with native_stderr_silenced(watch=True):\n"
        '        os.write(2, b"W hlo_rematerialization.cc] Can\'t reduce memory use below 1GiB\\n")\n'
        "        ctypes.CDLL(None).sleep(60)\n"
        "if __name__ == '__main__':\n"
        "    with ends_on_interrupt(lambda: print('done so far: 1 compile'), workers=True):\n"
        "        worker = multiprocessing.get_context('spawn').Process(target=compile_in_c)\n"
        "        worker.start()\n"
        "        with native_stderr_silenced(watch=True):\n"
        "            os.write(2, b'native noise\\n')\n"
        "            os.write(1, b'ready\\n')\n"
        "            ctypes.CDLL(None).sleep(60)\n"
    )
    started = Started([sys.executable, str(script)])
    started.wait_for_child(" -I -S -c ", count=2)  # Both watchers run: the blocks have begun.
    status, out, err = started.interrupt()
    assert status == 130
    assert out == "ready\ndone so far: 1 compile\n"
    assert err == "shardmem: interrupted\n", err


def _train(run_dir: Path, *overrides: str, sigint=signal.SIG_DFL) -> Started:
    sets = [arg for item in ("model.n_layers=2", "remat.layers={}", *overrides) for arg in ("--set", item)]
    return Started([sys.executable, "-m", "shardmem", "train", "configs/tiny.yaml", *sets,
                    "--run-dir", str(run_dir)], sigint=sigint)  # fmt: skip


def _assert_train_interrupted(started: Started, run_dir: Path) -> None:
    """Interrupts ``train`` and checks how it ended: before its first step at once, leaving no run
    directory; from its first step on, with the state saved at the step it stopped at."""
    saves = any("new run" in line for line in started.lines["out"])  # Then it saves first.
    status, out, err = started.interrupt(within=30 if saves else 5)
    assert status == 130, (status, out, err)  # Not 139 (a segmentation fault), nor 0 (the signal lost).
    assert "Traceback" not in err + out and "Exception ignored" not in err, err
    if "new run" not in out:
        assert (out, err) == ("", "shardmem: interrupted\n")
        assert not run_dir.exists(), sorted(p.name for p in run_dir.rglob("*"))
        return
    last = out.splitlines()[-1]
    assert last.startswith("interrupted at step ") and "checkpoint saved" in last, out
    step = last.removeprefix("interrupted at step ").split(";")[0]
    assert (run_dir / "checkpoints" / step).is_dir(), sorted(p.name for p in run_dir.rglob("*"))


@pytest.mark.newest  # jaxlib waits for a compile, and hears signals, its own way.
@pytest.mark.parametrize("moment", ["importing JAX", "compiling the step"])
def test_ctrl_c_while_train_starts_exits_130_at_once_and_leaves_nothing(moment, tmp_path):
    run_dir = tmp_path / "run"
    started = _train(run_dir)
    if moment == "importing JAX":  # python -m shardmem imports the package, and JAX, before __main__.
        started.wait_for_library("jaxlib")
    else:
        started.wait_for_child(" -I -S -c ")  # The compile's watcher.
    _assert_train_interrupted(started, run_dir)


def test_a_train_started_with_ctrl_c_ignored_ignores_it_throughout(tmp_path):
    # A shell starts a background job (`shardmem train ... &` in a script) with SIGINT ignored: Ctrl-C is
    # the foreground's. The imports ignored it, but the compile (exit 130) and the loop (a save) did not.
    run_dir = tmp_path / "run"
    started = _train(run_dir, "train.steps=30", "train.log_every=1", sigint=signal.SIG_IGN)
    started.wait_for_child(" -I -S -c ")  # The compile's watcher: inside the block that ends the process.
    os.killpg(started.process.pid, signal.SIGINT)
    started.wait_for_line("step 1 ", stream="out")  # The loop, which saves and stops on a SIGINT it hears.
    status, out, err = started.interrupt(within=120)
    assert status == 0, (status, out, err)
    assert out.splitlines()[-1].startswith("finished at step 30"), out
    assert "interrupted" not in out + err, (out, err)


@pytest.mark.slow
@pytest.mark.parametrize("seconds", [1, 2, 3, 5])
def test_ctrl_c_to_train_after_a_few_seconds(seconds, tmp_path):
    # Wherever it lands (imports, planning, compiling, or the first steps on a fast machine).
    run_dir = tmp_path / "run"
    started = _train(run_dir)
    time.sleep(seconds)
    _assert_train_interrupted(started, run_dir)


@pytest.mark.slow
def test_ctrl_c_in_the_training_loop_saves_then_exits_130(tmp_path):
    run_dir = tmp_path / "run"
    started = _train(run_dir, "train.steps=100000")
    started.wait_for_line("new run", stream="out")
    _assert_train_interrupted(started, run_dir)


def test_ctrl_c_while_export_writes_exits_130_and_leaves_no_file(tmp_path):
    import jax

    from shardmem.config import load_config
    from shardmem.parallel.mesh import build_mesh
    from shardmem.program import build_program
    from shardmem.run.checkpoint import Checkpointer

    config = load_config(ROOT / "configs" / "tiny.yaml")
    program = build_program(config, build_mesh(config.mesh.axes, jax.devices()))
    with Checkpointer(tmp_path / "run" / "checkpoints", every=1, keep=1) as checkpointer:
        checkpointer.save(1, program.init(), force=True)
    # The export, its writing slowed down after the first tensor: the moment to interrupt it.
    script = tmp_path / "slow_export.py"
    script.write_text(
        "import os, sys, time\n"
        "import shardmem.finetune.export as export\n"
        "tensors = export._hf_tensors\n"
        "def slowed(*args, **kwargs):\n"
        "    for i, (name, shape, make) in enumerate(tensors(*args, **kwargs)):\n"
        "        def later(make=make, i=i):\n"
        "            if i == 1:\n"
        "                os.write(2, b'writing\\n')\n"
        "                time.sleep(60)\n"
        "            return make()\n"
        "        yield name, shape, later\n"
        "export._hf_tensors = slowed\n"
        "from shardmem.cli import main\n"
        "raise SystemExit(main(sys.argv[1:]))\n"
    )
    out = tmp_path / "out"
    started = Started([sys.executable, str(script), "export", "configs/tiny.yaml", "--run-dir",
                       str(tmp_path / "run"), "--out", str(out)])  # fmt: skip
    started.wait_for_line("writing")
    status, _, err = started.interrupt()
    assert status == 130 and err.endswith("writing\nshardmem: interrupted\n") and "Traceback" not in err, err
    assert list(out.iterdir()) == [], "a half-written file stays"


@pytest.mark.newest
def test_ctrl_c_during_plan_exits_130_mid_compile():
    # The long-sequence config compiles for several seconds; the watcher runs only while it does.
    started = Started([sys.executable, "-m", "shardmem", "plan", "configs/llama-7b-long.yaml"])
    started.wait_for_child(" -I -S -c ")
    status, out, err = started.interrupt()
    assert (status, out, err) == (130, "", "shardmem: interrupted\n")


@pytest.mark.slow
def test_ctrl_c_during_tune_layout_prints_what_it_compiled():
    started = Started([sys.executable, "-m", "shardmem", "tune", "configs/tiny.yaml", "--search", "layout",
                       "--target", "cpu", "--jobs", "2"])  # fmt: skip
    started.wait_for_line("compiling ", count=3)  # The first batch of compiles is done.
    status, out, err = started.interrupt()
    assert status == 130
    head, *compiled = out.splitlines()
    assert head == f"interrupted after {len(compiled)} compiles; compiled so far:" and compiled, out
    assert all(line.startswith("  ") and "fit" in line for line in compiled), out
    assert err.endswith("\nshardmem: interrupted\n") and "Traceback" not in err
    assert all(line.startswith("  ") for line in err.splitlines()[:-1])  # Its progress lines only.


@pytest.mark.slow
def test_ctrl_c_during_sweep_ends_its_workers(tmp_path):
    started = Started([sys.executable, "-m", "shardmem", "sweep", "configs/tiny.yaml", "--target", "cpu",
                       "--grid", "remat.policy=none,full,minimal", "--jobs", "2", "--out",
                       str(tmp_path)])  # fmt: skip
    started.wait_for_line("sweep: 3 candidates")
    started.wait_for_child("multiprocessing")
    status, out, err = started.interrupt()
    assert (status, out) == (130, "")
    assert err == "sweep: 3 candidates; a line as each finishes\nshardmem: interrupted\n"


def test_what_an_interrupted_tune_prints_as_text_and_as_json(capsys):
    import json

    from shardmem.cli import _print_interrupted_tune
    from shardmem.explore.tune import Trial

    trials = [Trial("fsdp=8; none", ("mesh.axes={fsdp: 8}",), 2**20, 0, 0.0, True, "compiled", "fits, 80 ms"),
              Trial("tensor=8; none", (), None, None, None, False, "skipped", "no divisor")]  # fmt: skip
    _print_interrupted_tune(trials, json_output=False)
    out = capsys.readouterr().out
    assert out == "interrupted after 1 compiles; compiled so far:\n  fsdp=8; none: fits, 80 ms\n"
    _print_interrupted_tune(trials, json_output=True)
    data = json.loads(capsys.readouterr().out)  # Valid JSON where --json was asked.
    assert data["interrupted"] and data["compiles"] == 1 and len(data["trials"]) == 2
    _print_interrupted_tune([], json_output=False)
    assert capsys.readouterr().out == "interrupted after 0 compiles\n"
