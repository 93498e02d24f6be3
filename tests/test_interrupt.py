"""Ctrl-C (SIGINT to the process group, as a terminal sends it) ends planning commands at once (issue 30).

Each test starts its command in a process group of its own, interrupts the group at a moment it can
see (a line, a child process), and checks: exit 130 within 5 s, one line on stderr after what the
command had printed, no traceback, and no process of the group left.
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
    """A command in its own process group, its stderr read line by line as it comes."""

    def __init__(self, argv, cwd=ROOT):
        self.process = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, start_new_session=True)  # fmt: skip
        self.err: list[str] = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stderr:
            with self.changed:
                self.err.append(line)
                self.changed.notify_all()

    def wait_for_line(self, text: str, count: int = 1, timeout: float = 240) -> None:
        with self.changed:
            found = self.changed.wait_for(lambda: sum(text in line for line in self.err) >= count, timeout)
        assert found, f"no {count}x {text!r} on stderr in {timeout} s: {''.join(self.err)}"

    def wait_for_child(self, argv_part: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for pid in _group(self.process.pid):
                try:
                    if argv_part in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "):
                        return
                except OSError:
                    pass
            assert self.process.poll() is None, "".join(self.err)
            time.sleep(0.02)
        raise AssertionError(f"no child process with {argv_part!r} in {timeout} s")

    def interrupt(self) -> tuple[int, str, str]:
        """Sends SIGINT to the group; returns (exit status, stdout, stderr) once the group is gone."""
        sent = time.monotonic()
        os.killpg(self.process.pid, signal.SIGINT)
        out = self.process.stdout.read()
        status = self.process.wait(timeout=30)
        self.reader.join(timeout=10)
        while _group(self.process.pid) and time.monotonic() - sent < 5:  # Zombies are reaped by init.
            time.sleep(0.05)
        elapsed = time.monotonic() - sent
        left = _group(self.process.pid)
        assert not left, f"processes left in the group: {left}"
        assert elapsed < 5, f"took {elapsed:.1f} s"
        return status, out, "".join(self.err)


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
def test_sigint_in_a_native_call_ends_the_block_workers_and_watcher_at_once(tmp_path):
    # The stand-in for a compile: a C call that never returns to Python, a spawned worker, a watcher.
    script = tmp_path / "blocked.py"
    script.write_text(
        "import ctypes, multiprocessing, os, time\n"
        "from shardmem._interrupt import ends_on_interrupt\n"
        "from shardmem._quiet import native_stderr_silenced\n"
        "if __name__ == '__main__':\n"
        "    with ends_on_interrupt(lambda: print('done so far: 1 compile'), workers=True):\n"
        "        worker = multiprocessing.get_context('spawn').Process(target=time.sleep, args=(60,))\n"
        "        worker.start()\n"
        "        with native_stderr_silenced(watch=True):\n"
        "            os.write(2, b'native noise\\n')\n"
        "            os.write(1, b'ready\\n')\n"
        "            ctypes.CDLL(None).sleep(60)\n"
    )
    started = Started([sys.executable, str(script)])
    started.wait_for_child(" -I -S -c ")  # The watcher runs: the block has begun.
    started.wait_for_child("multiprocessing")  # The worker has started too.
    status, out, err = started.interrupt()
    assert status == 130
    assert out == "ready\ndone so far: 1 compile\n"
    assert err == "shardmem: interrupted\n", err


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
