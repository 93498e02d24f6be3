"""Test setup: 8 simulated CPU devices, before JAX starts its backends."""

import atexit
import os
import shutil
import subprocess
import tempfile

import jax
import numpy as np
import pytest

import shardmem  # noqa: F401  Sets JAX_PLATFORMS=cpu on machines without a GPU driver.

jax.config.update("jax_num_cpu_devices", 8)

# Deviceless GPU plans keep XLA's kernels (shardmem.planning.kernel_cache): in a folder of the test run's
# own (CLI tests' processes inherit it), never the user's ~/.cache; SHARDMEM_KERNEL_CACHE=off tests without.
if "SHARDMEM_KERNEL_CACHE" not in os.environ:
    os.environ["SHARDMEM_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="shardmem-test-kernels-")
    atexit.register(shutil.rmtree, os.environ["SHARDMEM_KERNEL_CACHE"], ignore_errors=True)


# Test modules that must share one pytest-xdist worker, in collection order: the site renders the notebooks
# tests/test_notebooks.py executed (building it alongside would execute them a second time, racing).
_SAME_WORKER = {"test_notebooks.py": "docs", "test_site.py": "docs"}


@pytest.hookimpl(tryfirst=True)  # Before xdist's own hook reads the groups.
def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n 2 --dist loadgroup`` (.ci/run), keeps each module's tests that share a module-scoped
    fixture on one worker, so the program it compiles is compiled once, and schedules every other test on
    its own, so that the two workers stay busy to the end."""
    if not config.pluginmanager.hasplugin("xdist") or config.getoption("dist", None) != "loadgroup":
        return
    for item in items:
        module = item.path.name
        if module in _SAME_WORKER or _uses_a_shared_fixture(item):
            item.add_marker(pytest.mark.xdist_group(_SAME_WORKER.get(module, module)))


def _uses_a_shared_fixture(item) -> bool:
    """Whether ``item`` uses (directly or through another fixture) a fixture of the test suite's own that
    outlives one test: pytest's built-in ones (``tmp_path_factory`` under ``tmp_path``) do not count."""
    return any(defs and defs[-1].baseid and defs[-1].scope != "function"
               for defs in item._fixtureinfo.name2fixturedefs.values())  # fmt: skip


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
