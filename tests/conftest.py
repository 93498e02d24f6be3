"""Test setup: 8 simulated CPU devices and LLVM -O0 for the CPU programs, before JAX starts its backends."""

import atexit
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

# The processes the tests start (the CLI, launch's processes, notebook kernels) import this checkout's
# shardmem, as the tests do, not the one pip installed: a git worktree's tests then test the worktree.
_ROOT = str(Path(__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))

# The tests' CPU programs compile without LLVM's optimization, as deviceless GPU plans already do
# (shardmem.planning.codegen): XLA's HLO passes, buffers and schedules are the same, and a test's tiny
# program runs for less time than LLVM -O2 spends on it (tests/test_step.py: 142 -> 78 CPU s). Here, before
# XLA reads its flags, so that the CLI tests' processes and the notebooks' kernels inherit it.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import shardmem  # noqa: E402, F401  Sets JAX_PLATFORMS=cpu on machines without a GPU driver.

jax.config.update("jax_num_cpu_devices", 8)

# Deviceless GPU plans keep XLA's kernels (shardmem.planning.kernel_cache): in a folder of the test run's
# own (CLI tests' processes inherit it), never the user's ~/.cache; SHARDMEM_KERNEL_CACHE=off tests without.
if "SHARDMEM_KERNEL_CACHE" not in os.environ:
    os.environ["SHARDMEM_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="shardmem-test-kernels-")
    atexit.register(shutil.rmtree, os.environ["SHARDMEM_KERNEL_CACHE"], ignore_errors=True)


# Test modules that share one pytest-xdist worker, in collection order: the site renders the notebooks
# tests/test_notebooks.py executed (building it alongside would execute them a second time, racing).
_SAME_WORKER = {"test_notebooks.py": "docs", "test_site.py": "docs"}
# Started first, so that the rest of the suite runs beside them rather than after: they mostly wait (on
# SLURM jobs, notebook kernels, a browser) and are the longest (BENCHMARKS.md, issue 41 item 1).
_START_FIRST = ("tests/test_cluster.py", "docs")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``pytest -n 2 --dist loadfile`` (.ci/run): each test module runs on one worker, so the programs its
    module-scoped fixtures compile are compiled once; the notebooks and the site share one. (xdist's
    ``loadgroup`` would say so with marks, but it groups nothing under pytest 9.2: pytest-xdist#1386.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModuleScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid):
            module = super()._split_scope(nodeid)
            return _SAME_WORKER.get(module.rpartition("/")[2], module)

        def _assign_work_unit(self, node):
            for scope in reversed(_START_FIRST):  # The queue is built by then, largest module first.
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk("1m")`` mounts a tmpfs of that size (a disk that fills up) and returns its path;
    skips where mounting is not allowed (it needs root)."""
    mounted = []

    def mount(size: str):
        mount_point = tmp_path / f"disk-{len(mounted)}"
        mount_point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs to fill up (needs root): {done.stderr.strip()}")
        mounted.append(mount_point)
        return mount_point

    yield mount
    for mount_point in mounted:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


@pytest.fixture
def resumes_with_one_device(tmp_path):
    """``resumes_with_one_device(strategy, one, run_steps, path)`` saves the state a parallel strategy's
    fixture trained (``(program, report, compiled step, losses, state)``), restores it into the one-device
    program ``one``, checks the parameter at ``path`` lands on one device as ``one`` shards it, and that
    two more steps there give the losses two more steps of the strategy give (checkpoints do not depend
    on the mesh)."""
    from shardmem.run.checkpoint import Checkpointer

    def check(strategy, one, run_steps, path=("layers", "wq")):
        program, _, compiled, _, state = strategy
        with Checkpointer(tmp_path, every=1, keep=1) as checkpointer:
            checkpointer.save(3, state)
        with Checkpointer(tmp_path, every=1, keep=1) as checkpointer:
            restored = checkpointer.restore(one.abstract_state)
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), jax.device_get(state))
        leaf, sharding = restored["params"], one.state_shardings["params"]
        for key in path:
            leaf, sharding = leaf[key], sharding[key]
        assert leaf.sharding == sharding and len(leaf.sharding.device_set) == 1
        copy = jax.tree.map(lambda x: x.copy(), state)  # The compiled step donates its input.
        continued, _ = run_steps(compiled, program, copy, 2, first=3)
        resumed, _ = run_steps(one.step, one, restored, 2, first=3)
        np.testing.assert_allclose(resumed, continued, rtol=2e-5)

    return check
