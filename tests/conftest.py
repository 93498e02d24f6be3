"""Test setup: 8 simulated CPU devices, before JAX starts its backends."""

import subprocess

import jax
import pytest

import shardmem  # noqa: F401  Sets JAX_PLATFORMS=cpu on machines without a GPU driver.

jax.config.update("jax_num_cpu_devices", 8)


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
