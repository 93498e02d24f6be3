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
    config = load_config(TINY)  # As shipped: remat.layers {"3": none} over minimal.
    # 8 compiles: 5 for the search (the config as written and one per other family), the winner's report.
    return config, tune(config, "cpu", search="layout", max_compiles=8, jobs=1)


def test_the_search_compiles_its_own_layout_first_and_ranks_by_predicted_step_time(searched):
    config, result = searched
    assert result.found and 2 <= result.compiles <= 8
    own = layout._own_layout(config, 8)
    assert result.trials[0].overrides == own.overrides(config) == ()  # the config as written, to beat
    seconds = [row["step_time"]["seconds"] for row in result.ranked]
    assert seconds == sorted(seconds)
    assert [row["describe"] for row in result.ranked if row["layout"]["own"]] == [own.describe()]
    baseline = next(t for t in result.trials if t.overrides == own.overrides(config))
    assert result.report.step_time.seconds <= baseline.step_time["seconds"] * 1.0001
    assert any(line.startswith("the config as written") for line in result.explanation)
    assert any(line.startswith("CPU step times use this machine's rates") for line in result.explanation)
    assert any("beats the runner-up" in line or "only compiled" in line for line in result.explanation)
    assert all(t.how in ("compiled", "skipped") for t in result.trials)


def test_the_last_line_says_what_each_compile_was_for(searched):
    # Issue 30: "N compiles in all (N-1 compiles; ...)" left the one compile apart unexplained.
    import re

    _, result = searched
    match = re.fullmatch(r"(\d+) compiles in all: (\d+) of layouts, 1 of the winner's full report"
                         r"(?:, (\d+) of its per-layer remat search)? \(\d+ compiled layouts did not fit; "
                         r"\d+ left to the estimates\)", result.explanation[-1])  # fmt: skip
    assert match, result.explanation[-1]
    total, layouts, remat = int(match[1]), int(match[2]), int(match[3] or 0)
    assert total == result.compiles == layouts + 1 + remat


def test_the_best_of_every_buildable_family_is_compiled_and_compared_with_the_winner(searched):
    """Issue 38: on llama-70b the estimates pruned every pipeline and sequence-parallel layout, so compiled
    plans never compared the families. Each family that can be built is compiled, whatever its estimate,
    and shown with where it loses to the winner and the estimate it was compiled on."""
    from rich.console import Console

    from shardmem.explore.tune import render_tune

    config, result = searched
    assert [row["family"] for row in result.families] == list(layout.FAMILIES)
    compiled = {t.overrides for t in result.trials if t.how == "compiled"}
    winner = result.ranked[0]
    for row in result.families:
        best = row["layout"]
        assert best is not None and row["reason"] is None, row
        chosen = layout.Layout(**{**best["layout"], "sizes": tuple(map(tuple, best["layout"]["sizes"]))})
        assert layout.family_of(chosen) == row["family"]
        assert tuple(best["overrides"]) in compiled and best["step_time"]["seconds"] > 0
        assert row["estimated_seconds"] > 0 and row["estimated_peak_bytes"] > 0
        if best["overrides"] == winner["overrides"]:
            assert row["behind"]["term"] == "the winner"
        elif best["fits"]:
            assert row["behind"]["seconds"] >= 0 and row["behind"]["term"] in (
                "compute", "memory bound", "launch", "exposed communication", "pipeline bubble")  # fmt: skip
    console = Console(width=200, record=True)
    console.print(render_tune(result))
    shown = console.export_text()
    assert "best of each family (each compiled)" in shown
    names = [layout.family_name(family, config) for family in layout.FAMILIES]
    assert names[2] == "pipeline (1F1B)" and all(name in shown for name in names)
    assert result.to_json()["families"] == result.families
    assert any(line.startswith("the best-looking layout of each family") for line in result.explanation)
    against = next(line for line in result.explanation if line.startswith("against each other family's best"))
    assert against.count("most in") == 3, against  # the three families that lose to the winner's


def test_interleaved_pipelines_are_the_pipeline_family_where_the_config_runs_layer_chunks():
    config = load_config(
        TINY, ["remat.layers={}", "pipeline.repeats=2", "mesh.axes={stage: 2, fsdp: -1}", "rules={}"]
    )
    layouts = layout.enumerate_layouts(config, 8, 8, ["full"])
    pipelines = {lay.schedule for lay in layouts if layout.family_of(lay) == "pipeline"}
    assert pipelines == {"interleaved"}  # circular is ranked, in no family
    assert layout.family_name("pipeline", config) == "pipeline (interleaved 1F1B)"
    plain = [lay for lay in layouts if lay.axes["tensor"] > 1 and not lay.sequence and lay.axes["stage"] == 1]
    assert plain and {layout.family_of(lay) for lay in plain} <= {None, "context"}


def test_a_family_that_cannot_be_built_is_named_with_the_reason():
    """One layer leaves no pipeline; one device per host no tensor axis; a 6-token sequence no context
    chunks, nor do experts; a batch of 4 no data x fsdp mesh of 8 devices: each named, with the key and
    the value."""
    from rich.console import Console

    from shardmem.explore.tune import _render_families, family_rows

    def reasons(per_host: int, *overrides: str) -> dict[str, str]:
        config = load_config(TINY, ["remat.layers={}", *overrides])
        layouts = layout.enumerate_layouts(config, 8, per_host, ["full"])
        return layout.unbuildable_families(config, 8, per_host, layouts)

    one_layer = "mesh.axes.stage=2 is more stages than model.n_layers=1"
    assert reasons(8, "model.n_layers=1") == {"pipeline": one_layer}
    assert reasons(1)["tensor"] == "mesh.axes.tensor=2 does not divide the 1 devices of a host"
    assert reasons(8) == {}
    short = reasons(8, "model.seq_len=6", "train.global_batch=4")
    assert short["context"] == "mesh.axes.context=2 does not split model.seq_len=6 into 2 x 2 chunks"
    assert short["fsdp"].startswith("train.global_batch=4 does not split over the batch shards")
    gemma3 = reasons(8, "model.sliding_window=8", "model.sliding_layers=[0]", "model.local_rope_theta=100.0")
    assert gemma3["pipeline"].startswith("mesh.axes.stage=2 with model.sliding_window=8 on 1 of the model's")
    experts = reasons(8, "model.n_experts=4", "model.experts_per_token=2")
    assert experts == {"context": "mesh.axes.context=2: context parallelism is for dense models "
                                  "(model.n_experts is set)"}  # fmt: skip
    config = load_config(TINY, ["model.n_layers=1", "remat.layers={}"])
    rows = family_rows(layout._family_bests({}, {"pipeline": one_layer}, {}), None, config)
    assert rows[2]["reason"] == f"not buildable: {one_layer}"
    assert rows[0]["reason"] == "not compiled: compile budget spent (--max-compiles)"
    console = Console(width=200, record=True)
    console.print(_render_families(rows))
    assert f"not buildable: {one_layer}" in console.export_text()


@pytest.mark.slow
def test_cli_tune_layout_writes_a_config_plan_accepts(tmp_path, capsys):
    out = tmp_path / "layout.yaml"
    args = ["tune", TINY, "--target", "cpu", "--search", "layout", "--max-compiles", "3", "--jobs", "1"]
    assert main([*args, "--out", str(out), "--set", "remat.layers={}"]) == 0
    printed = capsys.readouterr().out
    assert "fastest layouts that fit" in printed and "chose" in printed
    # Families count against --max-compiles: 2 for the search, the config as written (FSDP) and one more.
    flat = " ".join(printed.split())  # The line against the other families, unwrapped.
    assert flat.count(": not compiled: compile budget spent (--max-compiles)") == 2, printed
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
    # The families' bests lose per 1,000 tokens: the winner may run a grown batch.
    losing = [row for row in result.families if row["behind"] and "term_seconds" in row["behind"]]
    assert losing and all(row["behind"]["per_1000_tokens"] for row in losing)


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


def test_layouts_offer_1f1b_and_sequence_parallelism_and_estimate_their_residuals():
    from shardmem.planning.cost import Hardware

    config = load_config(TINY, ["train.global_batch=64", "remat.layers={}"])
    layouts = layout.enumerate_layouts(config, 8, 8, ["full"])
    assert {lay.schedule for lay in layouts if lay.axes["stage"] > 1} == {"gpipe", "1f1b"}
    assert {lay.schedule for lay in layouts if lay.axes["stage"] == 1} == {None}
    assert {lay.sequence for lay in layouts if lay.axes["tensor"] > 1} == {False, True}
    assert not any(lay.sequence for lay in layouts if lay.axes["tensor"] == 1)
    estimator = layout.Estimator(config, Hardware.host(8), 8, {"full": 1e12}, {"full": 64e6})

    def candidate(schedule=None, sequence=False, stage=2, tensor=2):
        sizes = {"stage": stage, "data": 8 // (stage * tensor), "fsdp": 1, "context": 1, "expert": 1,
                 "tensor": tensor}  # fmt: skip
        return layout.Layout(tuple(sizes.items()), 32, "full", schedule=schedule, sequence=sequence)

    gpipe, one_f_one_b = candidate("gpipe"), candidate("1f1b")
    # GPipe keeps all 32 micro-batches' layer inputs, 1F1B 2 of them (one per stage, as Megatron-LM's);
    # sequence parallelism splits full remat's layer inputs over tensor=2.
    assert estimator(one_f_one_b).activations == pytest.approx(estimator(gpipe).activations * 2 / 32)
    tensor, sequence = candidate(stage=1), candidate(stage=1, sequence=True)
    assert estimator(sequence).activations == pytest.approx(estimator(tensor).activations / 2)
    overrides = candidate("1f1b", sequence=True).overrides(config)
    assert "pipeline.schedule=1f1b" in overrides and "rules={residual_seq: [context, tensor]}" in overrides
    chosen = config.replace(*overrides)
    assert chosen.pipeline.schedule == "1f1b" and chosen.rules["residual_seq"] == ["context", "tensor"]
    assert "1f1b, sequence parallel" in candidate("1f1b", sequence=True).describe()


def _ranked(batch: int | None, seconds: float, tokens_per_second: float, compute: float) -> layout.Ranked:
    breakdown = {"compute": compute, "memory_bound": 0.3 * compute, "exposed_communication": 0.01 * seconds,
                 "launch": 0.0, "exposed_host_transfers": 0.0}  # fmt: skip
    step_time = {"seconds": seconds, "tokens_per_second": tokens_per_second, "breakdown": breakdown,
                 "bubble_seconds": 0.0}  # fmt: skip
    sizes = tuple((a, {"fsdp": 4, "context": 2}.get(a, 1)) for a in layout.AXES)
    return layout.Ranked(layout.Layout(sizes, 1, "none", False, batch), (), 1, 1, True, step_time)


def test_the_winner_is_explained_in_what_the_objective_ranks():
    """Throughput ranks tokens/s: a winner that runs a 4x larger batch has the longer step, and the line
    says by how many tokens/s per device it wins, and where, per token (issue 30: "by -44.2 s (-299%)")."""
    big, small = _ranked(4096, 59.0, 35_560.0, 40.0), _ranked(1024, 14.8, 35_488.0, 10.3)
    line = layout.why_winner(big, small, "throughput", devices=8)
    assert "by 9.0 tokens/s per device (+0.2%)" in line and "per 1,000 tokens" in line, line
    assert "-" not in line.split("by ")[1], line  # Nothing it wins by is negative.
    fast, slow = _ranked(None, 1.0, 16_384.0, 0.6), _ranked(None, 1.25, 13_107.0, 0.8)
    assert "by 250 ms per step (20%), most of it in compute (200 ms less)" in layout.why_winner(fast, slow)


def test_estimates_refit_to_a_compile_keep_its_launch_gaps_for_pipelines():
    """A tiny model on GPUs is all kernel gaps: once a compile says so, the estimate of that layout is
    its compiled time, and a pipeline (more layer passes) is estimated slower, never in µs."""
    from shardmem.planning import cost

    config = load_config(TINY)
    hardware = cost.Hardware("gpu", {"bf16": 1e15, "f32": 5e14}, 3e12, 4e11, 5e10, 5e10)
    policies = ("none", "minimal", "full")
    estimator = layout.Estimator(
        config, hardware, 8, dict.fromkeys(policies, 1e9), dict.fromkeys(policies, 1e6)
    )
    own = layout._own_layout(config, 8)  # tiny: data 2, fsdp 4, remat 0-2: minimal, 3: none
    assert (
        own.own and own.overrides(config) == () and own.describe().startswith("as configured: data=2 fsdp=4")
    )
    breakdown = {"compute": 6e-6, "memory_bound": 5e-6, "launch": 2.6e-3, "exposed_communication": 5e-5,
                 "exposed_host_transfers": 0.0}  # fmt: skip
    estimator.refit(own, 2 << 20, 2.67e-3, breakdown)
    assert estimator(own).seconds == pytest.approx(2.67e-3, rel=0.05)
    sizes = tuple((a, {"stage": 4, "data": 2}.get(a, 1)) for a in layout.AXES)
    pipeline = layout.Layout(sizes, 8, "none")
    assert estimator(pipeline).seconds > 2.67e-3  # 11 layer passes per device against the own layout's 4


def test_a_refused_own_layout_is_a_compile_that_does_not_fit_and_is_shown(monkeypatch):
    """On TPU, libtpu refuses a program over the HBM (no report, only what it needed): the config as
    written is still compiled, counted and shown, as not fitting (issue 30: "0 compiled layouts did not
    fit" and no sign of it)."""
    from shardmem.explore import sweep
    from shardmem.planning.memory import make_target

    config = load_config(TINY)
    step_time = {"seconds": 0.01, "tokens_per_second": 2e5, "bubble_seconds": 0.0, "mfu": 0.1,
                 "breakdown": {"compute": 0.004, "memory_bound": 0.004, "launch": 0.001,
                               "exposed_communication": 0.001, "exposed_host_transfers": 0.0}}  # fmt: skip

    def planned(config, combos, target, **_):
        return [sweep.SweepRow(o, error="libtpu: over the HBM", fits=False, peak_bytes=64 << 30) if o == ()
                else sweep.SweepRow(o, peak_bytes=1 << 20, budget_bytes=1 << 30, fits=True,
                                    margin_bytes=(1 << 30) - (1 << 20), step_time=step_time, host_bytes=0)
                for o in combos]  # fmt: skip

    monkeypatch.setattr(sweep, "plan_candidates", planned)
    trials = []
    ranked, compiles, notes, _ = layout.search_layouts(
        config, "cpu", make_target(config, "cpu"), max_compiles=3, jobs=1, objective="step_time",
        allow_offload=False, progress=lambda m: None, note=lambda *a, **k: trials.append(a),
    )  # fmt: skip
    own = ranked[-1]
    assert own.layout.own and not own.fits and own.peak_bytes == 64 << 30 and own.margin_bytes < 0
    assert all(r.fits for r in ranked[:-1]) and len(ranked) == compiles == 3
    assert trials[0][6] == "compiled" and "libtpu refused it: 64.00 GiB needed" in trials[0][7]
    assert "1 compiled layouts did not fit" in notes[-1]


def test_the_choice_is_compared_with_the_config_as_written_not_with_its_grown_batch():
    import dataclasses

    from shardmem.explore.tune import _against_own

    def own(batch, seconds, rate):
        row = _ranked(batch, seconds, rate, 1e-4)
        return dataclasses.replace(row, layout=dataclasses.replace(row.layout, own=True))

    grown, as_written = own(128, 1.3e-3, 6_316_739.0), own(None, 1.22e-3, 840_754.0)
    line = _against_own(grown, [grown, as_written], "throughput", 8)
    assert line == "the config as written: 105,094.2 tokens/s per device; the choice +651.3%", line
    assert _against_own(as_written, [as_written, grown], "step_time", 8).endswith("keep it")


def test_a_pipelines_compile_refits_pipelines_not_the_layouts_without_stages():
    """On llama-70b two pipeline compiles 1.6x slower than estimated scaled every estimate by as much, and
    the FSDP layout that wins (3.33 s against the config's 4.8 s) was never compiled: the search stopped."""
    from shardmem.planning import cost

    config = load_config(TINY)
    hardware = cost.Hardware("gpu", {"bf16": 1e15, "f32": 5e14}, 3e12, 4e11, 5e10, 5e10)
    policies = ("none", "minimal", "full")
    estimator = layout.Estimator(
        config, hardware, 8, dict.fromkeys(policies, 1e12), dict.fromkeys(policies, 1e6)
    )
    fsdp = layout.Layout(tuple((a, 8 if a == "fsdp" else 1) for a in layout.AXES), 1, "full")
    pipeline = layout.Layout(tuple((a, {"stage": 4, "data": 2}.get(a, 1)) for a in layout.AXES), 8, "full")
    before, raw = estimator(fsdp).seconds, estimator(pipeline).seconds
    breakdown = {"compute": 1.0, "memory_bound": 0.8, "launch": 0.0}  # The estimate's own memory share.
    estimator.refit(fsdp, 2 << 20, before, breakdown)  # As estimated (the search compiles its own first).
    for _ in range(2):
        estimator.refit(pipeline, 2 << 20, 3 * raw, breakdown)
    assert estimator(pipeline).seconds == pytest.approx(3 * raw)  # Its own family is refitted ...
    assert estimator(fsdp).seconds == pytest.approx(before)  # ... the others are not.


def test_the_estimate_counts_master_weights_and_their_float32_gradients():
    from shardmem.planning import cost

    hardware = cost.Hardware("gpu", {"bf16": 1e15, "f32": 5e14}, 3e12, 4e11, 5e10, 5e10)
    sizes = tuple((a, 64 if a == "fsdp" else 1) for a in layout.AXES)
    static = {}
    for master in ("null", "float32"):
        overrides = ["precision.params=bfloat16", f"precision.master={master}", "optimizer.mu_dtype=null"]
        config = load_config("configs/llama-70b.yaml", overrides)
        estimator = layout.Estimator(config, hardware, 8, {"full": 0.0}, {"full": 0.0})
        static[master] = estimator(layout.Layout(sizes, 1, "full")).static * 64 / config.model.param_count()
    # Bytes per parameter: bf16 weights, gradients and Adam's two moments; with master weights the
    # gradients summed in float32, the float32 copy and moments in float32.
    assert static == pytest.approx({"null": 2 + 2 + 2 * 2, "float32": 2 + 4 + 4 + 2 * 4})


def test_the_estimate_reduce_scatters_fsdp_gradients_per_micro_batch_as_the_program_does():
    """shardmem.program.accumulation reduces data-parallel gradients once per step but reduce-scatters FSDP
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
    from shardmem.planning import cost
    from shardmem.planning.memory import budget as budget_of
    from shardmem.planning.memory import make_target

    # Which layouts the search compiles follows the estimate, which costs CPU layouts with this machine's
    # measured rates. Under load a low copy rate made pipelines at 8 micro-batches look fastest, and no
    # 2-micro-batch layout was compiled (CI, stop 52): pinned, the choice is the same on every machine.
    monkeypatch.setenv(cost.HOST_RATES_ENV, "6e10,8e9")

    config = load_config(TINY, ["remat.layers={}", "remat.policy=full"])
    resolved = make_target(config, "cpu")
    budget = budget_of(config.memory, resolved.memory_bytes, resolved.allocator_limit)

    def compiled(config, combos, target, *, jobs=None, pool=None):
        return _plans(
            combos,
            budget,
            lambda micro, policy: (1.5 if micro == 1 else 0.5, 1.0 + 0.1 * micro),
            own=(1, "full"),
        )

    monkeypatch.setattr(sweep, "plan_candidates", compiled)
    monkeypatch.setattr(layout, "_other_policies", lambda *args: [])  # Only the accumulation here.
    fits = layout.search_layouts(config, "cpu", resolved, max_compiles=8, jobs=1, objective="step_time",
                                 allow_offload=False, progress=lambda message: None,
                                 note=lambda *args, **kwargs: None)[0]  # fmt: skip
    # The config as written (one micro-batch, over the budget here) is shown last, as not fitting.
    assert fits[-1].layout.own and not fits[-1].fits
    fitting = [r for r in fits if r.fits]
    assert fitting and all(r.layout.batch(config) == 16 and r.layout.micro_batches >= 2 for r in fitting)
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


def _one_compiled_winner(policy: str):
    """A stand-in for ``layout.search_layouts`` whose search compiled one layout, FSDP 8 with ``policy``,
    and ranked it first."""
    from shardmem.explore.layout import Layout, Ranked

    winner = Layout(tuple((a, 8 if a == "fsdp" else 1) for a in layout.AXES), 1, policy)
    step = {"seconds": 1.0, "breakdown": {"compute": 1.0}, "bubble_seconds": 0.0, "tokens_per_second": 1e3}

    def searched(config, target, resolved, *, note, **kwargs):
        note(winner.describe(), winner.overrides(config), 1, 0, 0.0, True, "compiled", "fits", step_time=step)
        return [Ranked(winner, winner.overrides(config), 1, 1, True, step)], 1, ["1 compile"], []

    return searched


@pytest.mark.parametrize("policy", ["full", "offload"])
def test_the_winners_per_layer_remat_mixes_in_offload_only_where_the_winner_offloads(monkeypatch, policy):
    """The remat search ranks by recomputed FLOPs and counts host copies as free: on a GPU target it
    would make offload the base of every mix, whose PCIe time the layout ranking had already weighed."""
    import types

    from shardmem.explore import tune as tune_module

    config = load_config(TINY, ["remat.layers={}"])
    searched = _one_compiled_winner(policy)
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


def _plans(combos, budget: int, figures, own: tuple[int, str]) -> list:
    """Stand-ins for compiled plans: ``figures(micro_batches, policy)`` gives (peak / budget, seconds);
    ``own``: the micro-batches and policy of the config as written (compiled without overrides)."""
    from shardmem.explore import sweep

    rows = []
    for overrides in combos:
        settings = {"train.micro_batches": str(own[0]), "remat.policy": own[1]}
        settings |= dict(o.split("=", 1) for o in overrides)
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
        return _plans(
            combos, budget, lambda micro, policy: (0.5, 1.0 if policy == "full" else 2.0), own=(1, "minimal")
        )

    monkeypatch.setattr(sweep, "plan_candidates", compiled)
    fits, compiles, notes, _ = layout.search_layouts(config, "cpu", resolved, max_compiles=8, jobs=1,
                                                  objective="step_time", allow_offload=False,
                                                  progress=lambda message: None,
                                                  note=lambda *args, **kwargs: None)  # fmt: skip
    assert compiles == len(asked) <= 8
    assert fits[0].layout.policy == "full" and fits[0].seconds == 1.0
    assert any("other remat policies" in line for line in notes)
    assert {r.layout.policy for r in fits if r.layout.sizes == fits[0].layout.sizes} >= {"full", "none"}
    assert sum(r.layout.policy == "full" for r in fits) == 1  # no other mesh was compiled with full


def test_a_familys_pick_that_does_not_fit_is_followed_by_one_more(monkeypatch):
    """Stand-ins in which a pipeline fits only with full remat (the estimate, fastest first, picks less
    recomputation) and the config as written is twice as fast as anything else (so the search stops
    early, with compiles left): the pipeline family gets a second compile on the refitted estimates, no
    third, and its best is the one that fits, if any (else it is shown as not fitting)."""
    from shardmem.explore import sweep
    from shardmem.planning.memory import budget as budget_of
    from shardmem.planning.memory import make_target

    config = load_config(TINY, ["remat.layers={}", "remat.policy=full"])
    resolved = make_target(config, "cpu")
    budget = budget_of(config.memory, resolved.memory_bytes, resolved.allocator_limit)
    pipelines = []

    def compiled(config, combos, target, *, jobs=None, pool=None):
        rows = []
        for overrides in combos:
            pipeline = "pipeline.schedule=1f1b" in overrides

            def figures(micro, policy, pipeline=pipeline, own=not overrides):
                return (0.5 if policy == "full" or not pipeline else 1.5, 0.5 if own else 1.0)

            if pipeline:
                pipelines.append(overrides)
            rows += _plans([overrides], budget, figures, own=(1, "full"))
        return rows

    monkeypatch.setattr(sweep, "plan_candidates", compiled)
    fits, compiles, notes, families = layout.search_layouts(
        config, "cpu", resolved, max_compiles=12, jobs=1, objective="step_time", allow_offload=False,
        progress=lambda message: None, note=lambda *args, **kwargs: None)  # fmt: skip
    assert compiles <= 12 and any(line.startswith("stopped:") for line in notes)
    assert len(pipelines) == 2, pipelines  # the first did not fit: one more, no third
    assert "remat.policy=full" not in pipelines[0]
    pipeline = next(f for f in families if f.family == "pipeline")
    assert pipeline.best is not None and pipeline.estimate is not None
    assert pipeline.best.fits == ("remat.policy=full" in pipelines[1])


def test_the_chosen_line_names_the_per_layer_remat_that_refined_the_winner(monkeypatch):
    """Where the per-layer search beats the winner's uniform policy, the choice is the mix, and the line
    that names the choice says so beside the mix's figures (not the uniform policy's name)."""
    import types

    from shardmem.explore import tune as tune_module

    config = load_config(TINY, ["remat.layers={}"])
    searched = _one_compiled_winner("full")

    def report(seconds):
        step_time = types.SimpleNamespace(seconds=seconds, to_json=lambda: {"seconds": seconds})
        return types.SimpleNamespace(step_time=step_time, per_device={"peak": 1}, margin_bytes=1)

    mixed_config = load_config(TINY, ['remat.layers={"0-1": save_qkv, "2-3": minimal}'])
    mixed = types.SimpleNamespace(compiles=2, found=True, report=report(0.9), config=mixed_config,
                                  chosen=None, trials=[])  # fmt: skip
    search = tune_module.tune
    monkeypatch.setattr(layout, "search_layouts", searched)
    monkeypatch.setattr(tune_module, "plan", lambda *args, **kwargs: report(1.0))
    monkeypatch.setattr(tune_module, "tune", lambda *args, **kwargs: mixed)
    result = search(config, "h100-sxm", search="layout", max_compiles=12)
    chose = next(line for line in result.explanation if line.startswith("chose "))
    mix = "chose fsdp=8; 1 micro-batch; 0-1: save_qkv, 2-3: minimal: predicted 900 ms"
    assert chose.startswith(mix), chose
