"""The GPU overlap options: one set, which plans for GPUs and training both compile with."""

import dataclasses

import jax
import pytest

from shardmem.config import load_config
from shardmem.parallel.mesh import build_mesh
from shardmem.planning import overlap
from shardmem.planning.memory import plan
from shardmem.program import build_program
from shardmem.run.training import compiled_step

LHS = "xla_gpu_enable_latency_hiding_scheduler"


@pytest.mark.newest
def test_every_overlap_option_has_a_spelling_this_xla_accepts():
    options = overlap.gpu_options()
    assert len(options) == len(overlap.GPU_OVERLAP)  # One per option, none dropped as unknown.
    assert options[LHS] is True
    assert not overlap.supported("xla_gpu_no_such_option", True)


@pytest.fixture(scope="module")
def gpu_plan():
    config = load_config("configs/tiny.yaml", [f"memory.compiler_options={{{LHS}: false}}"])
    return config, plan(config, "h100-sxm")


@pytest.mark.newest
def test_gpu_plans_compile_with_the_overlap_options_and_the_users_win(gpu_plan):
    _, report = gpu_plan
    want = {**overlap.gpu_options(), LHS: False}
    assert {k: report.compiler_options[k] for k in want} == want


def test_cpu_plans_take_no_gpu_options():
    report = plan(load_config("configs/tiny.yaml", ["model.n_layers=1", "remat.layers={}"]), "cpu")
    assert not set(report.compiler_options) & set(overlap.gpu_options())


@pytest.mark.newest
def test_training_compiles_its_step_with_the_plans_options(gpu_plan):
    config, report = gpu_plan
    program = build_program(config, build_mesh(config.mesh.axes, jax.devices()))
    assert compiled_step(program, dataclasses.replace(report, compiler_options={LHS: True})) is not None
    with pytest.raises(Exception, match="xla_gpu_no_such_option"):  # The options reach XLA.
        compiled_step(program, dataclasses.replace(report, compiler_options={"xla_gpu_no_such_option": 1}))


def test_sequence_parallel_accumulation_runs_each_micro_batchs_forward_once():
    # With pipelined all-gather XLA moved the next micro-batch's sequence gathers into the accumulation
    # loop and cloned the forward layer loop feeding them: 1.4x the program's matmul FLOPs here.
    overrides = ["precision.compute=bfloat16", "mesh.axes={data: 4, fsdp: 1, tensor: 2}", "rules.batch=data",
                 "rules.embed=null", "rules.residual_seq=tensor", "train.micro_batches=2",
                 "remat.layers={}"]  # fmt: skip
    report = plan(load_config("configs/tiny.yaml", overrides), "h100-sxm")
    assert report.step_time.kernel_flops == pytest.approx(report.flops_per_step / report.devices, rel=1e-6)
    off = overlap.gpu_options(off=["pipelined all-gather", "loop double buffering"])
    assert {k: report.compiler_options[k] for k in off} == off != overlap.gpu_options()


DOUBLE_BUFFERING = "xla_gpu_enable_while_loop_double_buffering"


@pytest.mark.newest
def test_accumulation_without_fsdp_compiles_its_loops_without_double_buffering():
    # Unrolled by two, the micro-batch loop let one micro-batch's forward stacks be made while the last
    # one's were live: 29% more temporaries here, for 0.5% of the step; 7.9 GiB on Llama 3.1 8B at
    # context 2 x data 4, where over XLA's memory limit it cost 2.4 s of remat (BENCHMARKS.md).
    small_8b = ["model.d_model=1024", "model.d_ff=3584", "model.n_layers=8", "model.vocab_size=4096",
                "train.micro_batches=4", "train.global_batch=16"]  # fmt: skip
    config = load_config("bench/schedules/llama3-8b-context.yaml", small_8b)
    ours = plan(config, "h100-sxm")
    assert ours.compiler_options[DOUBLE_BUFFERING] is False
    forced = f"memory.compiler_options={{{DOUBLE_BUFFERING}: true}}"
    doubled = plan(load_config("bench/schedules/llama3-8b-context.yaml", [*small_8b, forced]), "h100-sxm")
    assert ours.per_device["temp"] < 0.85 * doubled.per_device["temp"]
    # With FSDP it prefetches the next layer's weights (MPT-70B on 64 A100s: 146 s with it, 151 without).
    fsdp = plan(load_config("configs/tiny.yaml", ["train.micro_batches=2"]), "h100-sxm")
    assert fsdp.compiler_options[DOUBLE_BUFFERING] is True
