"""How fast Ctrl-C ends a command, and how fast an absurd slice count is refused (issues 30, 41).

    python bench/interrupt_bench.py

Each interrupt case starts the command in a process group of its own (as a terminal runs it), waits for a
moment it can see (the compile's watcher process, a line on stderr) or a fixed time (``train`` 1, 2, 3 and
5 s after its start, issue 41), sends SIGINT to the group, and prints the seconds until the command
exited and until no process of its group was left, its exit status and its stderr's last line (or
stdout's, where stderr has none: ``train`` that saved first). The slice cases time ``shardmem plan
configs/tiny.yaml --target N`` to its exit. One markdown row each.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_interrupt import ROOT, Started, _group  # noqa: E402  The tests' own harness.


def interrupt(name: str, argv: list[str], wait) -> None:
    started = Started([sys.executable, "-m", "shardmem", *argv])
    wait(started)
    sent = time.monotonic()
    os.killpg(started.process.pid, signal.SIGINT)
    status = started.process.wait(timeout=60)
    exited = time.monotonic() - sent
    while _group(started.process.pid) and time.monotonic() - sent < 30:
        time.sleep(0.01)
    gone = time.monotonic() - sent
    for reader in started.readers:
        reader.join(timeout=10)
    said = "".join(started.err).strip() or "".join(started.lines["out"]).strip()
    last = said.splitlines()[-1] if said else ""
    print(f"| {name} | {exited:.2f} s | {gone:.2f} s | {status} | `{last}` |", flush=True)


def refused(target: str) -> None:
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "shardmem", "plan", "configs/tiny.yaml", "--target", target],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    seconds = time.monotonic() - began
    print(f"| plan --target {target} | {seconds:.1f} s | {done.returncode} | "
          f"{len(done.stderr.splitlines())} line(s) |", flush=True)  # fmt: skip


def main() -> None:
    print(f"load average at start: {os.getloadavg()[0]:.1f}\n")
    print("| Ctrl-C during | exited after | group gone after | exit | stderr's last line |")
    print("|---|---|---|---|---|")
    interrupt("plan configs/llama-7b-long.yaml (mid-compile)", ["plan", "configs/llama-7b-long.yaml"],
              lambda s: s.wait_for_child(" -I -S -c "))  # fmt: skip
    interrupt("tune configs/tiny.yaml --search layout --target cpu --jobs 2 (third compile)",
              ["tune", "configs/tiny.yaml", "--search", "layout", "--target", "cpu", "--jobs", "2"],
              lambda s: s.wait_for_line("compiling ", count=3))  # fmt: skip

    def sweeping(started: Started) -> None:
        started.wait_for_line("sweep: 3 candidates")
        started.wait_for_child("multiprocessing")  # Its workers have started.

    interrupt("sweep configs/tiny.yaml --target cpu --grid remat.policy=none,full,minimal --jobs 2",
              ["sweep", "configs/tiny.yaml", "--target", "cpu", "--grid", "remat.policy=none,full,minimal",
               "--jobs", "2", "--out", "/tmp/shardmem-interrupt-bench"], sweeping)  # fmt: skip
    for seconds in (1, 2, 3, 5):
        run_dir = f"/tmp/shardmem-interrupt-bench-train-{seconds}"
        shutil.rmtree(run_dir, ignore_errors=True)
        interrupt(f"train configs/tiny.yaml, {seconds} s after its start",
                  ["train", "configs/tiny.yaml", "--run-dir", run_dir],
                  lambda started, wait=seconds: time.sleep(wait))  # fmt: skip
    print("\n| command | to exit | exit | stderr |")
    print("|---|---|---|---|")
    for target in ("100000xv5e-256", "5000xv5e-256"):
        refused(target)


if __name__ == "__main__":
    main()
