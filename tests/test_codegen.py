"""shardmem.planning.codegen: deviceless GPU plans generate their kernels cheaply (a stand-in ptxas, LLVM
without optimization) and report exactly what XLA's own code generation gives."""

import subprocess
from pathlib import Path

import pytest

from shardmem import config_from_dict, plan
from shardmem.planning import codegen, kernel_cache, overlap
from shardmem.planning.memory import make_target

# On the newest JAX too (.ci/run): XLA's GPU code generation and the options it accepts.
pytestmark = pytest.mark.newest

TINY_GPU = {
    "model": {"preset": "tiny"},
    "mesh": {"axes": {"fsdp": -1}, "devices_per_host": 8},
    "train": {"global_batch": 8},
    "memory": {"target": "h100-sxm"},
}


@pytest.fixture
def fresh_stand_in():
    codegen.stand_in_cuda_dir.cache_clear()
    yield
    codegen.stand_in_cuda_dir.cache_clear()


def _wheel_cuda_dir() -> str:
    folder = codegen.wheel_cuda_dir()
    if folder is None:
        pytest.skip("no nvidia-cuda-nvcc-cu12 wheel: no real ptxas to compare the stand-in with")
    return folder


def test_the_stand_in_answers_its_version_and_writes_an_empty_cubin(fresh_stand_in, tmp_path):
    ptxas = Path(codegen.stand_in_cuda_dir()) / "bin" / "ptxas"
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True)
    assert codegen.VERSION in version.stdout
    (tmp_path / "kernel.ptx").write_text(".version 8.0")
    cubin = tmp_path / "kernel.cubin"
    subprocess.run(
        [ptxas, tmp_path / "kernel.ptx", "-o", cubin, "-arch=sm_90a", "--warn-on-spills"], check=True
    )
    assert cubin.read_bytes() == b""


def test_a_deviceless_plan_runs_the_stand_in_and_reports_what_real_code_generation_does(
    fresh_stand_in, monkeypatch, tmp_path
):
    monkeypatch.setenv(kernel_cache.ENV, "off")  # Every kernel is generated, none read from a cache.
    calls = tmp_path / "calls"  # The stand-in, logging its arguments.
    monkeypatch.setattr(
        codegen, "SCRIPT", codegen.SCRIPT.replace("\ncase", f'\necho "$@" >> {calls}\ncase', 1)
    )
    config = config_from_dict(TINY_GPU)
    cheap = plan(config)
    assembled = calls.read_text().splitlines()
    calls.unlink()
    assert "--version" in assembled and sum(" -o " in line for line in assembled) >= 5  # One per kernel.
    real = {codegen.CUDA_DIR: _wheel_cuda_dir(), **codegen.OPTIMIZED}
    default = plan(config, compiler_options=real)  # The user's options win: XLA's own ptxas and LLVM -O2.
    assert not calls.exists(), "a user's xla_gpu_cuda_data_dir is used, not the stand-in"
    ours, theirs = cheap.to_json(), default.to_json()
    for report in (ours, theirs):
        report.pop("compile_seconds")
        report.pop("compiler_options")
    assert ours == theirs
    # The stand-in is shardmem's business, not the report's; the overlap options are train's too.
    assert cheap.compiler_options == overlap.gpu_options()


def test_only_deviceless_gpu_compiles_get_cheap_code_and_never_over_the_users_options(fresh_stand_in):
    config = config_from_dict(TINY_GPU)
    h100 = make_target(config)
    ours = codegen.deviceless_options(h100, {})
    assert (
        ours[codegen.CUDA_DIR] == codegen.stand_in_cuda_dir() and ours["xla_backend_optimization_level"] == 0
    )
    mine = codegen.deviceless_options(
        h100, {codegen.CUDA_DIR: "/usr/local/cuda", "xla_backend_optimization_level": 3}
    )
    assert mine == {"xla_llvm_disable_expensive_passes": True}
    assert codegen.deviceless_options(make_target(config, "cpu"), {}) == {}  # Its kernels run.


def test_where_the_stand_in_cannot_run_xla_uses_its_own_ptxas(fresh_stand_in, monkeypatch):
    def noexec(*args, **kwargs):  # /tmp mounted noexec: "Permission denied".
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(subprocess, "run", noexec)
    assert codegen.stand_in_cuda_dir() is None
    assert codegen.CUDA_DIR not in codegen.deviceless_options(make_target(config_from_dict(TINY_GPU)), {})
