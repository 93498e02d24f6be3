"""Rough edges a new user met (issue 12): each message or figure says what it means."""

import jax
import numpy as np
import pytest

import shardmem
from shardmem.config import load_config
from shardmem.errors import ConfigError
from shardmem.explore.sweep import SweepRow, progress_line
from shardmem.parallel.rules import rule_warnings
from shardmem.planning.report import render
from shardmem.run.metrics import StepRate
from shardmem.step import build_program

TINY = "configs/tiny.yaml"


def test_a_yaml_mapping_without_a_space_after_the_colon_says_so():
    with pytest.raises(ConfigError, match=r"put a space after the colon: --set 'mesh.axes=\{data: 3\}'"):
        load_config(TINY, ["mesh.axes={data:3}"])
    assert load_config(TINY, ["mesh.axes={data: 8}"]).mesh.axes["data"] == 8


def _warnings(config) -> list[str]:
    program = build_program(config, shardmem.build_mesh(config.mesh.axes, jax.devices()[:8]))
    return rule_warnings(program.sharding_table(), program.rules, program.mesh)


def test_replicated_parameter_warning_only_where_sharding_was_possible():
    small = ["model.vocab_size=32000", "model.d_model=256", "model.n_layers=4", "model.d_ff=512"]
    data_parallel = load_config(TINY, [*small, "mesh.axes={data: 8, fsdp: 1, tensor: 1}"])
    assert _warnings(data_parallel) == []  # Pure data parallelism replicates everything by design.
    fsdp = load_config(TINY, [*small, "mesh.axes={data: 1, fsdp: 8, tensor: 1}"])
    assert _warnings(fsdp) == []  # Norm scales stay replicated, and are too small to mention.
    unsharded = load_config(TINY, [*small, "mesh.axes={data: 1, fsdp: 8, tensor: 1}",
                                   'param_rules={"embedding": [null, null]}'])  # fmt: skip
    (warning,) = _warnings(unsharded)
    assert "embedding [32000, 256]" in warning and "layers" not in warning and "param_rules" in warning


def test_a_mesh_axis_no_rule_uses_is_warned_about():
    # `stages` (for stage) planned silently, its devices repeating the same work; so did a dense
    # model's expert axis with a batch rule that leaves it out (tiny.yaml's).
    (typo,) = _warnings(load_config(TINY, ["mesh.axes.stages=2"]))
    assert typo.startswith("mesh.axes.stages=2 (did you mean 'stage'?) shards nothing: no rule this model")
    (dense,) = _warnings(load_config(TINY, ["mesh.axes.expert=2"]))
    assert dense.startswith("mesh.axes.expert=2 shards nothing") and "rules.batch" in dense
    assert _warnings(load_config(TINY, ["mesh.axes.expert=2", "rules.batch=[data, fsdp, expert]"])) == []


def test_time_left_comes_from_the_steps_pace_not_the_compile():
    now = [0.0]
    rate = StepRate(total=100, clock=lambda: now[0])
    now[0] = 30.0  # compiled and ran the first 10 steps slowly
    rate.update(10)
    assert rate.seconds_left() is None
    now[0] = 31.0
    rate.update(20)  # 10 steps a second from here on
    assert rate.seconds_left() == pytest.approx(8.0)


def test_sweep_progress_lines_name_the_candidate_and_its_verdict():
    row = SweepRow(("remat.policy=full", "train.global_batch=8"), peak_bytes=3 * 2**30, fits=True)
    assert progress_line(3, 8, row, 41.2) == "[3/8 after 41 s] policy=full global_batch=8: 3.00 GiB, fits"
    failed = SweepRow(("remat.policy=bogus",), error="remat.policy='bogus' is not a remat policy\nmore")
    assert progress_line(1, 2, failed, 0).endswith(
        "policy=bogus: error: remat.policy='bogus' is not a remat policy"
    )


def test_cpu_report_says_what_its_budget_is(capsys):
    report = shardmem.plan(load_config(TINY), target="cpu", count_remat_overhead=False)
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render(report))
    text = console.export_text()
    assert "of device" not in text and "of its RAM share" in text
    assert "this machine's RAM / 8 simulated devices" in text and "not a GPU prediction" in text
    assert np.isclose(report.per_device["peak"] / report.device_memory_bytes, float(
        text.split("% of its RAM share")[0].split()[-1]) / 100, atol=1e-3)  # fmt: skip
