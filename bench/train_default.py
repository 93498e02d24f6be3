"""The README's main command, timed: train the shipped default config from scratch on this machine.

    python bench/train_default.py                 # configs/tiny.yaml, its train.steps
    python bench/train_default.py configs/tiny.yaml --set train.steps=500

Runs ``shardmem train CONFIG`` in a fresh run directory exactly as a user would (a new process, so
start-up, planning and compilation count) and prints a markdown row: wall time, steps, the first
and last logged loss, and the median throughput.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardmem.run.metrics import read_metrics  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", nargs="?", default=str(ROOT / "configs" / "tiny.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    sets = [arg for item in args.overrides for arg in ("--set", item)]
    with tempfile.TemporaryDirectory(prefix="shardmem-bench-") as run_dir:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "shardmem", "train", args.config, *sets,
                               "--run-dir", run_dir], capture_output=True, text=True)  # fmt: skip
        seconds = time.perf_counter() - start
        if done.returncode:
            sys.exit(f"shardmem train failed ({done.returncode}):\n{done.stdout}{done.stderr}")
        records = read_metrics(Path(run_dir) / "metrics.jsonl")
    throughput = statistics.median(r["tokens_per_s"] for r in records if "tokens_per_s" in r)
    print("| command | steps | wall time | first loss | last loss | median tokens/s |")
    print("|---|---|---|---|---|---|")
    print(f"| `shardmem train {Path(args.config).name}{' ' if sets else ''}{' '.join(sets)}` | "
          f"{records[-1]['step']} | {seconds:.0f} s | {records[0]['loss']:.3f} | {records[-1]['loss']:.3f} | "
          f"{throughput:,.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
