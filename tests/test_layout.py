"""tune --search layout: the enumeration's arithmetic, and a search that compiles and ranks for real."""

import dataclasses
import math

import pytest

from shardmem.cli import main
from shardmem.config import load_config
from shardmem.explore import layout
from shardmem.explore.tune import tune

TINY = "configs/tiny.yaml"


def test_layouts_keep_tensor_inside_a_host_and_divide_what_they_split():
    config = load_config(TINY, ["train.global_batch=16"])  # 4 heads, 2 kv heads, seq 64, 4 layers
    layouts = layout.enumerate_layouts(config, 16, 4, ["none", "full"])
    assert layouts and all(math.prod(lay.axes.values()) == 16 for lay in layouts)
    assert {lay.axes["tensor"] for lay in layouts} == {1, 2}  # divides the 2 kv heads and the 4 per host
    assert all(lay.axes["stage"] <= 4 and lay.axes["expert"] == 1 for lay in layouts)  # 4 layers, dense
    for lay in layouts:
        axes = lay.axes
        assert 64 % (2 * axes["context"]) == 0
        assert (16 // lay.micro_batches) % (axes["data"] * axes["fsdp"]) == 0
        if axes["stage"] > 1:
            assert lay.micro_batches >= axes["stage"]
    zero = [lay for lay in layouts if lay.zero1]
    assert zero and all(lay.axes["data"] > 1 for lay in zero)


def test_outer_axes_span_hosts_and_tensor_stays_inside_one():
    spans = layout._spans_hosts({"stage": 2, "data": 1, "fsdp": 2, "context": 1, "expert": 1, "tensor": 2}, 4)
    assert spans == {"stage": True, "data": False, "fsdp": False, "context": False, "expert": False,
                     "tensor": False}  # fmt: skip
    assert layout._spans_hosts({"stage": 1, "data": 1, "fsdp": 8, "context": 1, "expert": 1, "tensor": 2},
                               8)["fsdp"]  # fmt: skip


@pytest.fixture(scope="module")
def searched():  # Compiles: the tests that use it are marked slow.
    config = load_config(TINY, ["remat.layers={}", "remat.policy=full"])
    return config, tune(config, "cpu", search="layout", max_compiles=4, jobs=1)


@pytest.mark.slow
def test_the_search_compiles_its_own_layout_first_and_ranks_by_predicted_step_time(searched):
    config, result = searched
    assert result.found and 2 <= result.compiles <= 4
    own = layout._own_layout(config, 8)
    assert result.trials[0].overrides == own.overrides(config)  # the baseline to beat
    seconds = [row["step_time"]["seconds"] for row in result.ranked]
    assert seconds == sorted(seconds)
    baseline = next(t for t in result.trials if t.overrides == own.overrides(config))
    assert result.report.step_time.seconds <= baseline.step_time["seconds"] * 1.0001
    assert any("beats the runner-up" in line or "only compiled" in line for line in result.explanation)
    assert all(t.how in ("compiled", "skipped") for t in result.trials)


@pytest.mark.slow
def test_cli_tune_layout_writes_a_config_plan_accepts(tmp_path, capsys):
    out = tmp_path / "layout.yaml"
    args = ["tune", TINY, "--target", "cpu", "--search", "layout", "--max-compiles", "2", "--jobs", "1"]
    assert main([*args, "--out", str(out), "--set", "remat.layers={}"]) == 0
    printed = capsys.readouterr().out
    assert "fastest layouts that fit" in printed and "chose" in printed
    assert out.read_text().startswith("# shardmem tune --search layout")
    assert main(["plan", str(out), "--target", "cpu"]) == 0
    with pytest.raises(SystemExit) as exit_:
        main(["tune", TINY, "--search", "layout", "--objective", "fastest"])
    assert exit_.value.code == 2


@pytest.mark.slow
def test_throughput_grows_the_top_layouts_batches_and_ranks_by_tokens_per_second():
    config = load_config(TINY, ["remat.layers={}", "remat.policy=full"])
    result = tune(config, "cpu", search="layout", objective="throughput", max_compiles=6, jobs=1)
    assert result.found and result.compiles <= 6
    rates = [row["step_time"]["tokens_per_second"] for row in result.ranked]
    assert rates == sorted(rates, reverse=True)
    grown = [row for row in result.ranked if row["layout"]["global_batch"]]
    assert grown and all(row["layout"]["global_batch"] > 16 for row in grown)


def test_the_layout_estimate_charges_collectives_at_the_rings_nccl_runs():
    """An FSDP group over 8 nodes x 8 GPUs shares the node's 8 NICs (NVLink bounds it); one GPU per node
    (tensor inside, fsdp across) has its own NIC; a tensor group inside a node never uses the network."""
    from shardmem.explore.layout import _link
    from shardmem.planning import collectives, cost
    from shardmem.planning.collectives import Cluster
    from shardmem.planning.targets import GPU_TARGETS

    spec = GPU_TARGETS["h100-sxm"]
    hardware = cost.Hardware("h100-sxm", spec.peak_flops, spec.memory_bandwidth, 450e9, 50e9, 64e9,
                             Cluster.of(spec))  # fmt: skip
    axes = dict.fromkeys(("stage", "data", "fsdp", "context", "expert", "tensor"), 1)
    nic = 50e9 * collectives.NIC_EFFICIENCY
    assert _link(hardware, {**axes, "fsdp": 64}, 8, "fsdp") == pytest.approx(450e9 * 0.80)
    assert _link(hardware, {**axes, "fsdp": 8, "tensor": 8}, 8, "fsdp") == pytest.approx(nic)
    assert _link(hardware, {**axes, "fsdp": 8, "tensor": 8}, 8, "tensor") == pytest.approx(450e9 * 0.80)
    plain = dataclasses.replace(hardware, cluster=None)  # TPUs, CPUs: the slow link across hosts
    assert _link(plain, {**axes, "fsdp": 64}, 8, "fsdp") == plain.link("network")


def test_the_estimate_reduce_scatters_fsdp_gradients_per_micro_batch_as_the_program_does():
    """shardmem.accumulation reduces data-parallel gradients once per step but reduce-scatters FSDP
    gradients per micro-batch unless train.fsdp_reduce_once: the estimate charges what the program sends."""
    from shardmem.explore.layout import _link
    from shardmem.planning import cost
    from shardmem.planning.collectives import Cluster
    from shardmem.planning.targets import GPU_TARGETS

    spec = GPU_TARGETS["h100-sxm"]
    hardware = cost.Hardware("h100-sxm", spec.peak_flops, spec.memory_bandwidth, 450e9, 50e9, 64e9,
                             Cluster.of(spec))  # fmt: skip
    policies = dict.fromkeys(("full",), 0.0)  # No FLOPs and no residuals: the estimate is all traffic.
    sizes = tuple((a, 64 if a == "fsdp" else 1) for a in layout.AXES)
    scatter = None
    for once in (False, True):
        config = load_config("configs/llama-70b.yaml", [f"train.fsdp_reduce_once={str(once).lower()}"])
        estimator = layout.Estimator(config, hardware, 8, policies, policies)
        one, four = (estimator(layout.Layout(sizes, m, "full")).seconds for m in (1, 4))
        gather = 3 * config.model.param_count() * 2 * 63 / 64 / _link(hardware, dict(sizes), 8, "fsdp")
        scatter = config.model.param_count() * 4 * 63 / 64 / _link(hardware, dict(sizes), 8, "fsdp")
        assert one == pytest.approx(gather + scatter)
        assert four == pytest.approx(4 * gather + (1 if once else 4) * scatter)


def test_a_layout_that_holds_only_part_of_the_batch_is_compared_at_the_full_batch_with_accumulation(
    monkeypatch,
):
    """Compiles stand-ins (no XLA): every layout at 1 micro-batch is over the budget, at 2 or more it
    fits. The search must then compare the layouts at the config's global batch of 16 with accumulation,
    and the table must say the batch and micro-batches each row ran."""
    from rich.console import Console

    from shardmem.explore import sweep
    from shardmem.explore.tune import TuneResult, _render_layout, ranked_rows
    from shardmem.planning.memory import budget as budget_of
    from shardmem.planning.memory import make_target

    config = load_config(TINY, ["remat.layers={}", "remat.policy=full"])
    resolved = make_target(config, "cpu")
    budget = budget_of(config.memory, resolved.memory_bytes, resolved.allocator_limit)

    def compiled(config, combos, target, *, jobs=None, pool=None):
        return _plans(combos, budget, lambda micro, policy: (1.5 if micro == 1 else 0.5, 1.0 + 0.1 * micro))

    monkeypatch.setattr(sweep, "plan_candidates", compiled)
    monkeypatch.setattr(layout, "_other_policies", lambda *args: [])  # Only the accumulation here.
    fits, _, _ = layout.search_layouts(config, "cpu", resolved, max_compiles=8, jobs=1, objective="step_time",
                                       allow_offload=False, progress=lambda message: None,
                                       note=lambda *args, **kwargs: None)  # fmt: skip
    assert fits and all(r.layout.batch(config) == 16 and r.layout.micro_batches >= 2 for r in fits)
    assert fits[0].layout.micro_batches == 2  # the fewest micro-batches that fit: the fastest here
    rows = ranked_rows(fits, config)
    assert {(row["global_batch"], row["micro_batches"]) for row in rows} >= {(16, 2)}
    result = TuneResult("layout", config, None, None, [], 8, budget, resolved.label, ["budget"], rows)
    console = Console(width=200, record=True)
    console.print(_render_layout(result))
    table = console.export_text()
    header = next(line for line in table.splitlines() if "layout" in line and "step" in line)
    assert "batch" in header and "micro" in header
    first = next(line for line in table.splitlines() if line.lstrip().startswith("1 "))
    assert first.split("│")[2].strip() == "16" and first.split("│")[3].strip() == "2"


@pytest.mark.parametrize("policy", ["full", "offload"])
def test_the_winners_per_layer_remat_mixes_in_offload_only_where_the_winner_offloads(monkeypatch, policy):
    """The remat search ranks by recomputed FLOPs and counts host copies as free: on a GPU target it
    would make offload the base of every mix, whose PCIe time the layout ranking had already weighed."""
    import types

    from shardmem.explore import tune as tune_module
    from shardmem.explore.layout import Layout, Ranked

    config = load_config(TINY, ["remat.layers={}"])
    winner = Layout(tuple((a, 8 if a == "fsdp" else 1) for a in layout.AXES), 1, policy)
    step = {"seconds": 1.0, "breakdown": {"compute": 1.0}, "bubble_seconds": 0.0, "tokens_per_second": 1e3}

    def searched(config, target, resolved, *, note, **kwargs):
        note(winner.describe(), winner.overrides(config), 1, 0, 0.0, True, "compiled", "fits", step_time=step)
        return [Ranked(winner, winner.overrides(config), 1, 1, True, step)], 1, ["1 compile"]

    report = types.SimpleNamespace(step_time=types.SimpleNamespace(seconds=1.0), per_device={"peak": 1},
                                   margin_bytes=1)  # fmt: skip
    asked = {}

    def per_layer(config, target, *, search, allow_offload, max_compiles):
        asked.update(search=search, allow_offload=allow_offload)
        return types.SimpleNamespace(compiles=0, found=False)

    search = tune_module.tune
    monkeypatch.setattr(layout, "search_layouts", searched)
    monkeypatch.setattr(tune_module, "plan", lambda *args, **kwargs: report)
    monkeypatch.setattr(tune_module, "tune", per_layer)
    result = search(config, "h100-sxm", search="layout", max_compiles=12)  # offload allowed on GPUs
    assert result.found and asked == {"search": "remat", "allow_offload": policy == "offload"}


def _plans(combos, budget: int, figures) -> list:
    """Stand-ins for compiled plans: ``figures(micro_batches, policy)`` gives (peak / budget, seconds)."""
    from shardmem.explore import sweep

    rows = []
    for overrides in combos:
        settings = dict(o.split("=", 1) for o in overrides)
        share, seconds = figures(int(settings["train.micro_batches"]), settings["remat.policy"])
        peak = int(budget * share)
        terms = {"compute": seconds, "memory_bound": 0.0, "launch": 0.0, "exposed_communication": 0.0,
                 "exposed_host_transfers": 0.0}  # fmt: skip
        step = {"seconds": seconds, "breakdown": terms, "bubble_seconds": 0.0, "mfu": None,
                "tokens_per_second": 16 * 64 / seconds}  # fmt: skip
        rows.append(sweep.SweepRow(overrides, peak_bytes=peak, budget_bytes=budget, fits=peak <= budget,
                                   margin_bytes=budget - peak, host_bytes=0, step_time=step))  # fmt: skip
    return rows


def test_the_best_mesh_is_compiled_with_its_other_remat_policies(monkeypatch):
    """One variant of each mesh is compiled, the one estimated fastest (the least recomputation here);
    whether a policy's recomputation hides the mesh's collectives only a compile says. Stand-ins in which
    full remat is the fastest on every mesh: the winner must be the best mesh with full remat."""
    from shardmem.explore import sweep
    from shardmem.planning.memory import budget as budget_of
    from shardmem.planning.memory import make_target

    config = load_config(TINY, ["remat.layers={}", "remat.policy=minimal"])
    resolved = make_target(config, "cpu")
    budget = budget_of(config.memory, resolved.memory_bytes, resolved.allocator_limit)
    asked = []

    def compiled(config, combos, target, *, jobs=None, pool=None):
        asked.extend(combos)
        return _plans(combos, budget, lambda micro, policy: (0.5, 1.0 if policy == "full" else 2.0))

    monkeypatch.setattr(sweep, "plan_candidates", compiled)
    fits, compiles, notes = layout.search_layouts(config, "cpu", resolved, max_compiles=8, jobs=1,
                                                  objective="step_time", allow_offload=False,
                                                  progress=lambda message: None,
                                                  note=lambda *args, **kwargs: None)  # fmt: skip
    assert compiles == len(asked) <= 8
    assert fits[0].layout.policy == "full" and fits[0].seconds == 1.0
    assert any("other remat policies" in line for line in notes)
    assert {r.layout.policy for r in fits if r.layout.sizes == fits[0].layout.sizes} >= {"full", "none"}
    assert sum(r.layout.policy == "full" for r in fits) == 1  # no other mesh was compiled with full
