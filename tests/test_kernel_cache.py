"""shardmem.planning.kernel_cache: where deviceless GPU plans keep XLA's kernels, and that keeping them
changes nothing in a plan, even when the file is damaged."""

from pathlib import Path

import pytest

from shardmem import config_from_dict, plan
from shardmem.planning import kernel_cache
from shardmem.planning.memory import make_target

# On the newest JAX too (.ci/run): XLA's GPU kernel cache option and file.
pytestmark = pytest.mark.newest

TINY_GPU = {
    "model": {"preset": "tiny"},
    "mesh": {"axes": {"fsdp": -1}, "devices_per_host": 8},
    "train": {"global_batch": 8},
    "memory": {"target": "h100-sxm"},
}


def _figures(report) -> dict:
    figures = report.to_json()
    figures.pop("compile_seconds")
    return figures


def test_the_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path / "kernels"))
    assert kernel_cache.cache_dir() == tmp_path / "kernels"
    for off in ("off", "0", ""):
        monkeypatch.setenv(kernel_cache.ENV, off)
        assert kernel_cache.cache_dir() is None
    monkeypatch.delenv(kernel_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel_cache.cache_dir() == tmp_path / "shardmem" / "xla-kernels"


def test_one_file_per_gpu_generation_and_none_for_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path))
    config = config_from_dict(TINY_GPU)
    h100, a100 = make_target(config, "h100-sxm"), make_target(config, "a100-80g")
    assert kernel_cache.cache_file(h100).parent == tmp_path
    assert kernel_cache.cache_file(h100) != kernel_cache.cache_file(a100)
    assert kernel_cache.cache_file(make_target(config, "cpu")) is None  # Its kernels run: never cached.
    monkeypatch.setenv(kernel_cache.ENV, "off")
    assert kernel_cache.cache_file(h100) is None


def test_the_private_copy_is_published_only_after_a_compile_that_succeeded(tmp_path):
    shared = tmp_path / "cache.pb"
    shared.write_bytes(b"old")
    with kernel_cache.private_copy(shared) as private:
        assert Path(private).read_bytes() == b"old" and Path(private) != shared
        Path(private).write_bytes(b"new")
    assert shared.read_bytes() == b"new"
    with pytest.raises(RuntimeError), kernel_cache.private_copy(shared) as private:
        Path(private).write_bytes(b"half")
        raise RuntimeError("the compile failed")
    assert shared.read_bytes() == b"new" and sorted(tmp_path.iterdir()) == [shared]  # No copy left over.
    blocked = tmp_path / "a-file" / "cache.pb"
    (tmp_path / "a-file").write_bytes(b"")  # A folder that cannot be made: no cache, no error.
    with kernel_cache.private_copy(blocked) as private:
        assert private is None


def test_a_second_deviceless_plan_reuses_the_kernels_and_reports_the_same(monkeypatch, tmp_path):
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path))
    config = config_from_dict(TINY_GPU)
    shared = kernel_cache.cache_file(make_target(config))
    first = plan(config)
    assert shared.is_file() and shared.stat().st_size > 0  # XLA kept the kernels it compiled.
    size = shared.stat().st_size
    second = plan(config)
    assert _figures(second) == _figures(first)
    # The second compile got the first one's kernels (a damaged file fails it: XLA reads the file) and
    # kept them: only the few kernels XLA compiles anew on every compile are added.
    assert size <= shared.stat().st_size < 1.1 * size
    assert [p.name for p in tmp_path.iterdir()] == [shared.name]  # The private copies are gone.
    # Without the cache the same plan: bench/plan_speed.py options --kernel-cache checks every config.


def test_a_damaged_cache_is_discarded_and_the_plan_goes_on(monkeypatch, tmp_path):
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path))
    config = config_from_dict(TINY_GPU)
    shared = kernel_cache.cache_file(make_target(config))
    shared.write_bytes(b"not a cache")  # XLA reads it as "Read less bytes than requested".
    damaged = plan(config)  # XLA refuses the file; compiled again without it, silently.
    assert not shared.exists() and sorted(tmp_path.iterdir()) == []  # The next plan starts afresh.
    assert damaged.per_device["peak"] > 0 and all("cache" not in w for w in damaged.warnings)
