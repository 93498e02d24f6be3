"""Where the test suite's time goes (issue 41 item 1): wall and CPU seconds of every test module, and of
the whole run, on a machine other jobs may share.

    python bench/ci_time.py -- tests/test_hlo.py                       # serially, as pytest would
    python bench/ci_time.py -- -n 2 --dist loadfile                   # as .ci/run runs the main suite
    python bench/ci_time.py --python .venv-newest/bin/python -- -n 2 --dist loadfile -m newest
    python bench/ci_time.py --json times.json -- -m "not slow"        # the per-test records too

Runs pytest with the arguments after ``--`` in a child process, with this file as a plugin that records
each test's wall time and CPU time (user + system of the test's process and of every process it waited
for: the CLI tests' ``python -m shardmem``, XLA's ptxas), setup and teardown included, so a module-scoped
fixture's compile is charged to the first test that uses it. It prints, per module, the tests, wall and
CPU seconds (the costliest first), the sums over the ``slow`` and ``newest`` markers, and for the whole
run: wall, CPU (``os.wait4``: xdist's workers and everything they waited for), the cores it kept busy on
average, and the load average when it started and ended.

CPU seconds hardly change when other jobs share the machine; wall seconds do. On an idle machine with
``cores`` cores a run cannot take less than CPU / cores, nor less than its longest module when modules
are spread over workers: the two figures estimate what the run will take there.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_RECORDS = "SHARDMEM_CI_TIME_RECORDS"  # The folder the plugin writes into, one file per process.


def _cpu_seconds() -> float:
    """CPU seconds of this process and of the children it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report):
    """Keeps each test's outcome: failed if any phase failed, else skipped if one was, else passed."""
    if report.failed or (report.skipped and _outcomes.get(report.nodeid) != "failed"):
        _outcomes[report.nodeid] = report.outcome
    else:
        _outcomes.setdefault(report.nodeid, "passed")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Records one test's wall and CPU seconds (setup, call and teardown) where ``bench/ci_time.py`` reads."""
    folder = os.environ.get(_RECORDS)
    wall, cpu = time.perf_counter(), _cpu_seconds()
    yield
    if folder:
        record = {
            "test": item.nodeid,
            "module": item.path.name,
            "markers": sorted({mark.name for mark in item.iter_markers()} & {"slow", "newest"}),
            "wall_s": time.perf_counter() - wall,
            "cpu_s": _cpu_seconds() - cpu,
            "outcome": _outcomes.pop(item.nodeid, "passed"),
        }
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(Path(folder) / f"{worker}.jsonl", "a") as out:
            out.write(json.dumps(record) + "\n")


def _table(records: list[dict], key) -> list[tuple[str, int, float, float]]:
    """Rows of (name, tests, wall s, CPU s) grouped by ``key(record)``, the costliest in CPU first."""
    rows = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for record in records:
        for name in key(record):
            row = rows[name]
            row[0] += 1
            row[1] += record["wall_s"]
            row[2] += record["cpu_s"]
    return sorted(((name, *row) for name, row in rows.items()), key=lambda row: -row[3])


def _print_table(title: str, rows) -> None:
    print(f"\n{title:<34} {'tests':>6} {'wall s':>9} {'CPU s':>9}")
    for name, tests, wall, cpu in rows:
        print(f"{name:<34} {tests:>6} {wall:>9.1f} {cpu:>9.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="the interpreter whose pytest runs")
    parser.add_argument("--json", type=Path, help="also write every test's record to this file")
    parser.add_argument("pytest_args", nargs="*", help="pytest's arguments, after --")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="ci-time-") as folder:
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, _RECORDS: folder, "PYTHONPATH": path}
        command = [args.python, "-m", "pytest", "-q", "-p", "bench.ci_time", "-p", "no:cacheprovider",
                   *args.pytest_args]  # fmt: skip
        load_before = os.getloadavg()
        started = time.perf_counter()
        child = subprocess.Popen(command, cwd=ROOT, env=env)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - started
        load_after = os.getloadavg()
        records = [json.loads(line) for path in sorted(Path(folder).glob("*.jsonl"))
                   for line in path.read_text().splitlines()]  # fmt: skip

    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    _print_table("module", _table(records, lambda r: [r["module"]]))
    _print_table("marker", _table(records, lambda r: r["markers"] or ["(neither)"]))
    cpu = usage.ru_utime + usage.ru_stime
    longest = max((row[2] for row in _table(records, lambda r: [r["module"]])), default=0.0)
    print(f"\nwhole run: {len(records)} tests, wall {wall:.0f} s, CPU {cpu:.0f} s "
          f"({cpu / wall:.2f} cores busy on average), longest module {longest:.0f} s wall; "
          f"load average {load_before[0]:.1f} at the start, {load_after[0]:.1f} at the end "
          f"({os.cpu_count()} cores)")  # fmt: skip
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
