"""Test setup: 8 simulated CPU devices, before JAX starts its backends."""

import jax

import shardmem  # noqa: F401  Sets JAX_PLATFORMS=cpu on machines without a GPU driver.

jax.config.update("jax_num_cpu_devices", 8)
