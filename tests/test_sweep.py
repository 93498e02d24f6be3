"""shardmem sweep: grid parsing, planning every candidate, outputs, measuring and the CLI."""

import csv
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from shardmem import load_config
from shardmem.cli import main
from shardmem.errors import ConfigError
from shardmem.explore import sweep as sweep_module
from shardmem.explore.plot import plot_sweep
from shardmem.explore.rows import COLUMNS, SweepRow, pareto_front
from shardmem.explore.sweep import (
    candidates,
    check_grid_and_sets,
    parse_grid,
    plan_candidate,
    render_sweep,
    sweep,
    write_outputs,
)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TINY = str(CONFIGS / "tiny.yaml")


def test_parse_grid_reads_yaml_values():
    grid = parse_grid(
        ["remat.policy=none,minimal", "train.global_batch=8, 16", 'remat.layers={"0-1": full},{}']
    )
    assert grid == {
        "remat.policy": ["none", "minimal"],
        "train.global_batch": [8, 16],
        "remat.layers": [{"0-1": "full"}, {}],
    }


@pytest.mark.parametrize("item", ["remat.policy", "=none", "remat.policy=", "a=[1,"])
def test_parse_grid_rejects_bad_syntax(item):
    with pytest.raises(ConfigError, match="--grid"):
        parse_grid([item])


def test_parse_grid_rejects_a_key_given_twice_and_no_grid():
    with pytest.raises(ConfigError, match="given twice"):
        parse_grid(["train.steps=1", "train.steps=2"])
    with pytest.raises(ConfigError, match="at least one --grid"):
        parse_grid([])


def test_candidates_are_the_product_in_grid_order():
    grid = {"remat.policy": ["none", "full"], "train.global_batch": [8, 16], "remat.layers": [{"3": "none"}]}
    assert candidates(grid) == [
        ("remat.policy=none", "train.global_batch=8", "remat.layers={'3': none}"),
        ("remat.policy=none", "train.global_batch=16", "remat.layers={'3': none}"),
        ("remat.policy=full", "train.global_batch=8", "remat.layers={'3': none}"),
        ("remat.policy=full", "train.global_batch=16", "remat.layers={'3': none}"),
    ]
    config = load_config(TINY).replace(*candidates(grid)[2])
    assert config.remat_plan().describe() == "0-2: full, 3: none"


def test_pareto_front():
    points = [(1.0, 5.0), (2.0, 3.0), (2.5, 4.0), (3.0, 1.0), (1.5, 6.0), (4.0, 1.0)]
    assert pareto_front(points) == [0, 1, 3]


@pytest.fixture(scope="module")
def tiny_rows():
    grid = {"remat.policy": ["none", "minimal", "full"], "train.global_batch": [8, 7]}
    return sweep(load_config(TINY), grid, "cpu", jobs=1)


def test_sweep_plans_every_candidate_and_reports_bad_ones(tiny_rows):
    assert len(tiny_rows) == 6
    bad = [r for r in tiny_rows if r.error]
    assert [r.overrides[1] for r in bad] == ["train.global_batch=7"] * 3
    assert all("multiple of 8" in r.error for r in bad)
    ok = {r.overrides[0].split("=")[1]: r for r in tiny_rows if not r.error}
    assert ok["full"].peak_bytes < ok["minimal"].peak_bytes < ok["none"].peak_bytes
    assert ok["none"].recompute_overhead == 0.0
    assert 0 < ok["minimal"].recompute_overhead < ok["full"].recompute_overhead
    assert ok["full"].flops_per_step > ok["none"].flops_per_step
    for row in ok.values():
        assert row.fits and row.margin_bytes == row.budget_bytes - row.peak_bytes
        assert row.collectives["all-gather"] > 0  # FSDP gathers the parameters.
        assert row.host_bytes == 0 and row.approximate
        assert row.optimizer_bytes > 0 and row.attention.startswith("chunked")


def test_write_outputs(tiny_rows, tmp_path):
    paths = write_outputs(tiny_rows, tmp_path / "out", title="tiny")
    with paths["csv"].open() as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == list(COLUMNS) and len(table) == 6
    assert int(table[0]["peak_bytes"]) == tiny_rows[0].peak_bytes
    assert table[1]["error"] and not table[1]["peak_bytes"]
    data = json.loads(paths["json"].read_text())
    assert data[0]["collectives"]["all-gather"] == tiny_rows[0].collectives["all-gather"]
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_outputs_on_a_full_disk_writes_none_and_keeps_an_earlier_sweep(tiny_rows, small_disk):
    from test_files import _fill

    disk = small_disk("512k")
    first = write_outputs(tiny_rows[:1], disk, title="tiny")
    before = {name: path.read_bytes() for name, path in first.items()}
    _fill(disk, leave=4096)
    with pytest.raises(ConfigError, match=r"^--out .*: the disk is full; nothing was written"):
        write_outputs(tiny_rows, disk, title="tiny")
    assert {name: path.read_bytes() for name, path in first.items()} == before
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "sweep.csv", "sweep.json", "sweep.png"]


def test_plot_labels_keep_values_with_dots_and_spaces():
    rows = [
        SweepRow(("optimizer.learning_rate=3.0e-4", "remat.policy=full"), peak_bytes=2**30,
                 budget_bytes=2**32, fits=True, flops_per_step=1e12),
        SweepRow(("optimizer.learning_rate=1.0e-3", "remat.layers={0-1: dots}"), peak_bytes=2**31,
                 budget_bytes=2**32, fits=True, flops_per_step=2e12),
    ]  # fmt: skip
    labels = [text.get_text() for text in plot_sweep(rows).axes[0].texts]
    assert labels == ["learning_rate=3.0e-4 policy=full", "learning_rate=1.0e-3 layers={0-1: dots}"]


def _realistic_rows(measured: bool = False) -> list[SweepRow]:
    """Rows as llama-7b on an H100 gives them, long candidate names and all."""
    budget, moved = 64_981_312_716, {"all-gather": 26_424_950_000, "reduce-scatter": 1_685_783_000,
                                     "all-reduce": 1_069_548}  # fmt: skip
    rows = []
    for policy, batch, peak, flops in [("none", 16, 396_400_000_000, 3.03e15),
                                       ("minimal", 16, 47_127_000_000, 3.16e15)]:  # fmt: skip
        rows.append(SweepRow(
            (f"remat.policy={policy}", f"train.global_batch={batch}"), peak_bytes=peak, budget_bytes=budget,
            fits=peak <= budget, margin_bytes=budget - peak, flops_per_step=flops, recompute_overhead=0.047,
            host_bytes=0, collectives=moved, step_seconds=1.2345 if measured else None,
            measured_peak_bytes=peak if measured else None,
        ))  # fmt: skip
    return rows


_FIGURES = ["policy=none", "policy=minimal", "global_batch=16", "369.18 GiB", "-308.66 GiB",
            "+16.63 GiB", "43.89 GiB", "3.03 PFLOP", "3.16 PFLOP", "+4.7%", "24.61 GiB", "1.57 GiB",
            "1.02 MiB"]  # fmt: skip


def test_sweep_table_prints_every_figure_in_full_at_120_columns():
    out = Console(file=io.StringIO(), width=120)  # As a file or pipe gets it.
    out.print(render_sweep(_realistic_rows()))
    text = out.file.getvalue()
    assert "…" not in text
    for figure in _FIGURES:
        assert figure in text


def test_cli_sweep_widens_a_piped_table_rather_than_cut_its_figures(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sweep_module, "sweep", lambda *a, **k: _realistic_rows(measured=True))
    args = ["sweep", TINY, "--grid", "remat.policy=none,minimal", "--target", "cpu", "--measure"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "…" not in text
    for figure in [*_FIGURES, "1234.5 ms", "policy=minimal global_batch=16 │  43.89 GiB", "meas. peak"]:
        assert figure in text


def _fake_report():
    return SimpleNamespace(per_device={"peak": 100, "host": 0, "optimizer": 10}, budget_bytes=1000, fits=True,
                           tight=False, margin_bytes=900, flops_per_step=1e9, recompute_overhead=None,
                           collectives={}, compile_seconds=0.5, approximate=True, attention="xla",
                           pipeline={})  # fmt: skip


def test_an_unexpected_error_is_the_candidates_row_not_the_end_of_the_sweep(monkeypatch):
    def fake_plan(program, target, **kwargs):
        if program.config.remat.policy == "full":
            raise RuntimeError("XLA fell over")
        return _fake_report(), None

    monkeypatch.setattr("shardmem.planning.memory.plan_program", fake_plan)
    rows = sweep(load_config(TINY), {"remat.policy": ["none", "full", "minimal"]}, "cpu", jobs=1)
    assert [r.error for r in rows] == [None, "RuntimeError: XLA fell over", None]
    assert rows[2].peak_bytes == 100


@pytest.mark.parametrize(
    ("peaks", "tight", "code", "said"),
    [
        ((1500, 900), (False, False), 0, None),
        ((1500, 1100), (False, True), 5, ("smallest tight", "full", "1.07 KiB", "is tight")),
        # A tight candidate is named over a smaller peak that does not fit.
        ((1200, 1100), (True, False), 5, ("smallest tight", "none", "1.17 KiB", "is tight")),
        ((1500, 1200), (False, False), 3, ("smallest", "full", "1.17 KiB", "does not fit")),
    ],
)  # fmt: skip
def test_cli_sweep_exits_as_plan_does_when_no_candidate_fits(monkeypatch, tmp_path, capsys, peaks, tight,
                                                              code, said):  # fmt: skip
    def fake_plan(program, target, **kwargs):
        i = ["none", "full"].index(program.config.remat.policy)
        report = _fake_report()
        report.per_device = {**report.per_device, "peak": peaks[i]}
        report.fits, report.tight = peaks[i] <= 1000, tight[i]
        return report, None

    monkeypatch.setattr("shardmem.planning.memory.plan_program", fake_plan)
    args = ["sweep", TINY, "--grid", "remat.policy=none,full", "--target", "cpu", "--jobs", "1"]
    assert main([*args, "--out", str(tmp_path)]) == code
    err = capsys.readouterr().err
    if said is None:
        assert "no candidate fits" not in err
    else:
        which, policy, size, verdict = said
        assert (f"no candidate fits; the {which} peak, remat.policy={policy}'s {size} per device, "
                f"{verdict} in its budget of 1000 B") in err  # fmt: skip


def test_cli_exits_2_when_every_candidate_failed(monkeypatch, tmp_path, capsys):
    def fake_plan(program, target, **kwargs):
        raise ValueError("no")

    monkeypatch.setattr("shardmem.planning.memory.plan_program", fake_plan)
    args = ["sweep", TINY, "--grid", "remat.policy=none,full", "--target", "cpu", "--jobs", "1"]
    assert main([*args, "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "ValueError: no" in captured.out and "all 2 candidates failed" in captured.err
    assert (tmp_path / "sweep.csv").exists()


@pytest.mark.parametrize("target, cpu_only", [("cpu", True), ("h100-sxm", True), ("local", False)])
def test_planning_workers_stay_off_the_gpu_unless_they_plan_for_it(target, cpu_only, monkeypatch):
    started = []

    class FakePool:  # Records how workers would start; runs nothing.
        def __init__(self, jobs, *, mp_context, initializer, initargs):
            started.append(initargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            return False

        def submit(self, function, config, overrides, target):
            future = sweep_module.concurrent.futures.Future()
            future.set_result(SweepRow(overrides))
            return future

    monkeypatch.setattr(sweep_module.concurrent.futures, "ProcessPoolExecutor", FakePool)
    grid = {"remat.policy": ["none", "full"], "memory.usable_fraction": [0.5, 0.8]}
    sweep(load_config(TINY), grid, target, jobs=2)
    ((cpu_devices, cpu_only_flag, local_memory, host_rates),) = started
    assert cpu_only_flag is cpu_only
    assert (host_rates is not None) == (target == "cpu")  # The parent's rates, for every worker's plans.
    if target == "local":  # The allocator limit of the candidate with the largest usable fraction.
        assert local_memory.memory.usable_fraction == 0.8
    else:
        assert local_memory is None


def test_plan_candidate_measures_real_steps_of_the_step_it_compiled(monkeypatch):
    import shardmem.program

    built = []
    real = shardmem.program.build_program
    monkeypatch.setattr(shardmem.program, "build_program",
                        lambda *a, **k: built.append(real(*a, **k)) or built[-1])  # fmt: skip
    row = plan_candidate(load_config(TINY), ("train.global_batch=8",), "cpu", measure_steps=2)
    assert row.error is None and row.fits and 0 < row.step_seconds < 60
    assert row.measured_peak_bytes is None  # The CPU backend keeps no allocator statistics.
    if hasattr(built[0].step, "_cache_size"):  # Timed with the plan's executable, not compiled again.
        assert built[0].step._cache_size() == 0


def test_measure_refuses_deviceless_targets():
    with pytest.raises(ConfigError, match="deviceless"):
        sweep(load_config(TINY), {"remat.policy": ["none"]}, "h100-sxm", measure=True)


def test_cli_usage_errors_exit_2_and_leave_no_out_directory(capsys, tmp_path):
    out = tmp_path / "sweep"
    assert main(["sweep", TINY, "--grid", "remat.policy", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--grid 'remat.policy': write KEY=V1,V2" in err and "Traceback" not in err
    for args, message in [
        (["--target", "h100-sxm", "--measure"], "deviceless"),
        (["--measure", "--steps", "0"], "--steps 0: time at least 1 step"),
        (["--jobs", "0"], "--jobs 0: use 1 or more"),
    ]:
        assert main(["sweep", TINY, "--grid", "remat.policy=none", *args, "--out", str(out)]) == 2
        assert message in capsys.readouterr().err
        assert not out.exists()


@pytest.mark.slow
def test_cli_sweep_in_worker_processes_with_measure(tmp_path, capsys):
    out = tmp_path / "sweep"
    code = main(["sweep", TINY, "--grid", "remat.policy=none,full", "--set", "train.global_batch=8",
                 "--target", "cpu", "--jobs", "2", "--out", str(out)])  # fmt: skip
    assert code == 0
    assert "policy=full" in capsys.readouterr().out
    rows = json.loads((out / "sweep.json").read_text())
    assert [r["overrides"] for r in rows] == [["remat.policy=none"], ["remat.policy=full"]]
    assert rows[1]["peak_bytes"] < rows[0]["peak_bytes"]

    code = main(["sweep", TINY, "--grid", "remat.policy=full", "--set", "train.global_batch=8",
                 "--target", "cpu", "--measure", "--steps", "2", "--out", str(out), "--json"])  # fmt: skip
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["step_seconds"] > 0


def test_cli_sweep_checks_out_before_planning(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sweep_module, "sweep", lambda *a, **k: pytest.fail("planned before checking --out"))
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    args = ["sweep", TINY, "--grid", "remat.policy=none,full", "--target", "cpu", "--out", str(blocker / "x")]
    assert main(args) == 2
    assert "--out" in capsys.readouterr().err


def _issue_grid_rows() -> list[SweepRow]:
    """llama-7b on 8 x H100, remat.policy x train.global_batch as issue 12 swept it: one 393 GiB outlier."""
    budget = 64_981_312_716
    peaks = {
        ("none", 8): 200e9,
        ("minimal", 8): 30e9,
        ("offload", 8): 22e9,
        ("full", 8): 17e9,
        ("none", 16): 393 * 2**30,
        ("minimal", 16): 47e9,
        ("offload", 16): 33e9,
        ("full", 16): 28e9,
    }
    flops = {"none": 1.0, "minimal": 1.04, "offload": 1.04, "full": 1.33}
    return [SweepRow((f"remat.policy={p}", f"train.global_batch={b}"), peak_bytes=int(peak),
                     budget_bytes=budget, fits=peak <= budget, flops_per_step=flops[p] * b * 1.9e14)
            for (p, b), peak in peaks.items()]  # fmt: skip


def test_sweep_plot_is_readable_at_a_glance():
    rows = _issue_grid_rows()
    figure = plot_sweep(rows)
    ax = figure.axes[0]
    assert ax.get_yscale() == "log" and "GiB" in ax.get_ylabel() and "PFLOP" in ax.get_xlabel()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"fits", "does not fit"} <= set(legend) and any(t.startswith("budget") for t in legend)
    fronts = {line.get_label(): line for line in ax.get_lines() if line.get_label().startswith("Pareto")}
    assert set(fronts) == {"Pareto front, global_batch=8", "Pareto front, global_batch=16"}
    gib = 2**30
    fitting = {(round(r.flops_per_step / 1e15, 6), round(r.peak_bytes / gib, 6)) for r in rows if r.fits}
    for line in fronts.values():  # Only fitting points, and none of them at another batch size's FLOPs.
        points = {(round(x, 6), round(y, 6)) for x, y in zip(*line.get_data(), strict=True)}
        assert points <= fitting
    renderer = figure.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    assert len(boxes) == len(rows)
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])


def test_measured_sweep_plot_picks_units_for_small_figures():
    rows = [SweepRow((f"remat.policy={p}",), peak_bytes=peak, budget_bytes=2**31, fits=True,
                     flops_per_step=1.5e9, step_seconds=seconds)
            for p, peak, seconds in (("none", 6_900_000, 0.021), ("full", 3_200_000, 0.025))]  # fmt: skip
    ax = plot_sweep(rows).axes[0]
    assert "MiB" in ax.get_ylabel() and "(ms)" in ax.get_xlabel()
    (front,) = [line for line in ax.get_lines() if line.get_label().startswith("Pareto")]
    assert front.get_marker() == "o"  # Visible in the legend and on the chart even as a single point.
    assert min(front.get_ydata()) > 2  # 3.05 MiB, not 0.003 GiB


def test_cli_exits_2_when_a_grid_value_is_not_a_valid_config(monkeypatch, tmp_path, capsys):
    # Issue 20, item 12: `--grid model.attention=chunked,flash` exited 0, so scripts never noticed; issue 30:
    # it said so only after compiling the valid candidates, which now are not compiled at all.
    planned = []

    def fake_plan(program, target, **kwargs):
        planned.append(program.config.model.attention)
        if program.config.model.attention == "xla":
            raise RuntimeError("XLA fell over")  # Not the config's fault: the sweep still succeeds.
        return _fake_report(), None

    monkeypatch.setattr("shardmem.planning.memory.plan_program", fake_plan)
    out = tmp_path / "out"
    args = ["sweep", TINY, "--target", "cpu", "--jobs", "1", "--out", str(out)]
    assert main([*args, "--grid", "model.attention=chunked,flash,fleah"]) == 2
    err = capsys.readouterr().err
    assert err == ("shardmem: error: 2 of 3 candidates are not valid configs (nothing was compiled); first "
                   f"model.attention=flash: {err.split('model.attention=flash: ')[1]}")  # fmt: skip
    assert err.split("model.attention=flash: ")[1].startswith("model.attention='flash'")
    assert planned == [] and not out.exists()
    assert main([*args, "--grid", "model.attention=chunked,xla"]) == 0
    assert planned == ["chunked", "xla"]


def test_a_grid_value_given_twice_is_planned_once():
    grid = parse_grid(["remat.policy=none,full,none,'full'", "train.global_batch=8,8"])
    assert grid == {"remat.policy": ["none", "full"], "train.global_batch": [8]}


def test_a_sweep_in_one_process_plans_candidates_that_need_more_devices_than_the_first(tmp_path):
    # `sweep --jobs 1 --grid mesh.axes.data=2,16`: the first candidate's plan asked JAX for its own 8
    # devices, lowering the 16 the sweep had asked for, and the second failed with "target 'cpu' needs 16
    # simulated devices but JAX started with 8; ... call shardmem.ensure_cpu_devices(16)".
    import subprocess
    import sys

    out = tmp_path / "sweep"
    done = subprocess.run(
        [sys.executable, "-m", "shardmem", "sweep", TINY, "--grid", "mesh.axes.data=2,16", "--set",
         "model.n_layers=1", "--set", "remat.layers={}", "--target", "cpu", "--jobs", "1", "--out", str(out)],
        cwd=CONFIGS.parent, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((out / "sweep.json").read_text())
    assert [r["error"] for r in rows] == [None, None], rows


@pytest.mark.parametrize("sets, grid, refused", [
    ("remat.policy=full", "remat.policy=none,full", "remat.policy"),
    ("mesh.axes.data=8", "mesh.axes={data: 2},{data: 4}", "mesh.axes"),
    ("mesh.axes={data: 1}", "mesh.axes.data=2,4", None),  # The grid varies one axis of the mesh set.
])  # fmt: skip
def test_a_set_of_a_key_the_grid_varies_is_refused(tmp_path, capsys, sets, grid, refused):
    # `sweep --grid remat.policy=none,full --set remat.policy=offload` planned none and full: the grid's
    # value replaced the --set without a word.
    if refused is None:
        check_grid_and_sets(parse_grid([grid]), [sets])
        return
    out = tmp_path / "out"
    assert main(["sweep", TINY, "--grid", grid, "--set", sets, "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"shardmem: error: --set {sets!r} and --grid {refused}=...: every candidate takes {refused} from the "
        "grid, which would replace the --set; drop the --set, or list its value in the --grid\n"
    )
    assert not out.exists()
