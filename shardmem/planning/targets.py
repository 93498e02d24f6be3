"""Where a plan is compiled: simulated CPU devices, the attached accelerators, or a named NVIDIA GPU
compiled deviceless with XLA's GPU compiler.

    target = resolve_target("h100-sxm", n_devices=64, hosts=8)   # compile-only H100s, 8 per host
    target.devices, target.memory_bytes, target.peak_flops

Deviceless compilation needs the ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` wheels at jaxlib's
version, but no GPU and no CUDA libraries.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax

from shardmem._quiet import native_stderr_silenced
from shardmem.errors import ConfigError, PlanError, did_you_mean, one_of


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """Published facts about one GPU model and the links of the server it usually comes in.

    Device facts are from XLA's GPU spec files and vendor datasheets (``shared/reference/gpu-targets.md``).
    ``peak_flops`` is the dense tensor-core rate per operand dtype ("f32" is TF32, which XLA uses for
    float32 matmuls at default precision). Link rates are per GPU and per direction, from the vendors'
    system datasheets: ``nvlink_bandwidth`` to the other GPUs of its host, ``network_bandwidth`` to other
    hosts (one NIC per GPU, as DGX/HGX servers have), ``host_bandwidth`` to host memory (PCIe). A
    cluster's real figures override the links (``interconnect`` in the config).
    """

    description: str
    compute_capability: tuple[int, int]
    sm_count: int
    fpus_per_sm: int
    clock_ghz: float
    memory_bytes: int
    memory_bandwidth: int
    l2_cache_bytes: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    peak_flops: dict[str, float]
    nvlink_bandwidth: float
    network_bandwidth: float
    host_bandwidth: float

    @property
    def peak_bf16_flops(self) -> float:
        """The dense bf16 peak, the rate MFU is quoted against."""
        return self.peak_flops["bf16"]

    def target_config(self) -> str:
        """Returns the ``GpuTargetConfigProto`` text XLA's deviceless compiler takes."""
        major, minor = self.compute_capability
        return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {self.sm_count}
  fpus_per_core: {self.fpus_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth}
  l2_cache_size: {self.l2_cache_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{self.description}"
"""


GB = 1e9  # Link and memory rates are decimal: 900 GB/s is 900e9 bytes per second.

# Dense tensor-core peaks (NVIDIA H100, H200, A100 and B200 datasheets; sparsity figures halved).
_HOPPER = {"bf16": 989.4e12, "f16": 989.4e12, "f32": 494.7e12, "f8": 1978.9e12}
_HOPPER_PCIE = {"bf16": 756e12, "f16": 756e12, "f32": 378e12, "f8": 1513e12}
_AMPERE = {"bf16": 312e12, "f16": 312e12, "f32": 156e12}  # No FP8 units: f8 runs as bf16.
_BLACKWELL = {"bf16": 2250e12, "f16": 2250e12, "f32": 1100e12, "f8": 4500e12}

# Links per GPU, each way. DGX/HGX H100 and H200: NVLink 4 at 900 GB/s both ways through NVSwitch, eight
# 400 Gb/s NDR InfiniBand NICs per host (50 GB/s per GPU), PCIe Gen5 x16 (64 GB/s). DGX A100: NVLink 3 at
# 600 GB/s, eight 200 Gb/s HDR NICs (25 GB/s), PCIe Gen4 x16 (32 GB/s). HGX B200: NVLink 5 at 1.8 TB/s,
# eight 400 Gb/s NICs. An H100 PCIe card reaches the other GPUs of its server over PCIe Gen5 (its NVLink
# bridge pairs two cards only).
GPU_TARGETS: dict[str, GpuSpec] = {
    "h100-sxm": GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 1.98, 84942979072,
                        3352320000000, 52428800, 233472, 232448, _HOPPER, 450 * GB, 50 * GB, 64 * GB),
    "h100-pcie": GpuSpec("NVIDIA H100 PCIe", (9, 0), 114, 128, 1.755, 84942979072,
                         2039040000000, 52428800, 233472, 232448, _HOPPER_PCIE, 64 * GB, 50 * GB, 64 * GB),
    "h200": GpuSpec("NVIDIA H200 141GB HBM3e", (9, 0), 132, 128, 1.98, 151397597184,
                    4800000000000, 52428800, 233472, 232448, _HOPPER, 450 * GB, 50 * GB, 64 * GB),
    "a100-40g": GpuSpec("NVIDIA A100-SXM4-40GB", (8, 0), 108, 64, 1.41, 42331013120,
                        1555200000000, 41943040, 167936, 166912, _AMPERE, 300 * GB, 25 * GB, 32 * GB),
    "a100-80g": GpuSpec("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 1.41, 85100068864,
                        2039040000000, 41943040, 167936, 166912, _AMPERE, 300 * GB, 25 * GB, 32 * GB),
    "b200": GpuSpec("NVIDIA B200", (10, 0), 148, 128, 1.965, 191514411008,
                    7672320000000, 132644864, 233472, 232448, _BLACKWELL, 900 * GB, 50 * GB, 64 * GB),
}  # fmt: skip

TARGET_NAMES = ("cpu", "local", *GPU_TARGETS)


@dataclasses.dataclass(frozen=True)
class Target:
    """Devices to compile for, with what is known of their memory and speed."""

    name: str
    label: str
    devices: tuple
    memory_bytes: int
    peak_flops: float | None
    deviceless: bool
    approximate: bool
    allocator_limit: int | None = None  # What JAX's allocator may take on an attached GPU.
    spec: GpuSpec | None = None  # The GPU's published facts, where it is one shardmem knows.

    @property
    def platform(self) -> str:
        """JAX platform of the devices: "cpu", "cuda" (deviceless GPUs included) or "gpu"."""
        return self.devices[0].platform


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


#: Simulated CPU devices a plan or run may ask for: starting 4096 takes seconds, 16384 many minutes.
MAX_CPU_DEVICES = 4096


def ensure_cpu_devices(n: int) -> None:
    """Asks JAX for ``n`` simulated CPU devices; only possible before JAX's backends start. More than
    :data:`MAX_CPU_DEVICES` is a ConfigError (the mesh's)."""
    if n > MAX_CPU_DEVICES:
        raise ConfigError(
            f"mesh.axes make a mesh of {n:,} devices, more than the {MAX_CPU_DEVICES} simulated CPU devices "
            "JAX can start in reasonable time; plan it for a GPU target (e.g. --target h100-sxm) or use "
            "fewer devices"
        )
    try:
        jax.config.update("jax_num_cpu_devices", max(n, 1))
    except RuntimeError:
        pass  # Backends already up; resolve_target reports a shortfall clearly.


def configure_local_memory(config) -> None:
    """Lets JAX's GPU allocator take ``memory.usable_fraction`` of each device (``config`` is a
    :class:`~shardmem.Config`), unless ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is already set; call it
    before JAX's backends start, wherever a process plans or runs on target ``local``.

    Why: the budget of an attached GPU is the lower of device memory x ``usable_fraction`` and the
    allocator's limit (see :func:`shardmem.planning.memory.budget`), and that limit is JAX's default
    75% unless the variable says otherwise. ``shardmem train`` and ``shardmem plan --target local`` both call
    this, so that they budget alike and the plan's verdict is the one training is gated on.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{config.memory.usable_fraction:.6g}")


def target_for_device_kind(device_kind: str) -> str | None:
    """Returns the deviceless target (a key of :data:`GPU_TARGETS`) that models a GPU's ``device_kind``."""
    kind = device_kind.lower()
    for name, spec in GPU_TARGETS.items():
        if spec.description.lower() == kind:
            return name
    if "a100" in kind:
        return "a100-40g" if "40gb" in kind else "a100-80g"
    markers = (("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("b200", "b200"))
    for marker, name in markers:
        if marker in kind:
            return name
    return None


def peak_flops_for(device_kind: str) -> float | None:
    """Returns the dense bf16 peak of a GPU recognised from its ``device_kind``."""
    name = target_for_device_kind(device_kind)
    return GPU_TARGETS[name].peak_bf16_flops if name else None


@functools.cache
def _gpu_topology(name: str, hosts: int, per_host: int):
    from jax.experimental import topologies

    spec = GPU_TARGETS[name]
    try:
        with native_stderr_silenced():  # Loading the CUDA plugin without a driver complains in C++.
            topology = topologies.get_topology_desc(
                platform="cuda", target_config=spec.target_config(), topology=f"1x{hosts}x{per_host}"
            )
    except Exception as e:  # The plugin raises a variety of runtime errors when absent or broken.
        raise PlanError(
            f"cannot compile for target {name!r} without a GPU: {e}. Deviceless GPU planning needs "
            "jax-cuda12-plugin and jax-cuda12-pjrt at jaxlib's version (pip install -e . installs "
            "them on Linux x86-64); or use --target cpu"
        ) from None
    return tuple(topology.devices)


def resolve_target(name: str, *, n_devices: int, hosts: int = 1) -> Target:
    """Returns the devices (and their memory) to compile a mesh of ``n_devices`` for."""
    if name in GPU_TARGETS:
        if n_devices % hosts:
            raise ConfigError(
                f"mesh.hosts={hosts} does not divide the {n_devices} devices; every host needs "
                "the same number of devices"
            )
        spec = GPU_TARGETS[name]
        devices = _gpu_topology(name, hosts, n_devices // hosts)
        label = f"{n_devices} x {spec.description} ({hosts} host{'s' * (hosts > 1)}), deviceless"
        return Target(name, label, devices, spec.memory_bytes, spec.peak_bf16_flops, True, False, spec=spec)
    if name == "cpu":
        with native_stderr_silenced():
            devices = tuple(jax.devices("cpu"))
        if len(devices) < n_devices:
            raise PlanError(
                f"target 'cpu' needs {n_devices} simulated devices but JAX started with "
                f"{len(devices)}; the CLI sets this up itself, in Python call "
                f"shardmem.ensure_cpu_devices({n_devices}) before JAX is first used"
            )
        memory = host_memory_bytes() // n_devices
        label = f"{n_devices} simulated CPU devices (approximate: not a GPU prediction)"
        return Target("cpu", label, devices[:n_devices], memory, None, False, True)
    if name == "local":
        with native_stderr_silenced():
            devices = tuple(jax.devices())
        if len(devices) < n_devices:
            raise ConfigError(
                f"the mesh needs {n_devices} devices but {len(devices)} are attached; change "
                "mesh.axes (use -1 for the remaining devices) or run on more devices"
            )
        stats = jax.local_devices()[0].memory_stats() or {}  # Only this process's devices answer.
        kind = devices[0].device_kind
        known = target_for_device_kind(kind)
        # The budget takes a fraction of the whole device; JAX's allocator limit (itself a fraction,
        # XLA_PYTHON_CLIENT_MEM_FRACTION) caps it further, see MemoryReport.budget_bytes.
        memory = GPU_TARGETS[known].memory_bytes if known else int(stats.get("bytes_limit") or 0)
        memory = memory or host_memory_bytes() // len(devices)
        limit = int(stats["bytes_limit"]) if "bytes_limit" in stats else None
        approximate = devices[0].platform == "cpu"
        label = f"{len(devices)} x {kind} (attached)" + (", approximate" if approximate else "")
        return Target("local", label, devices[:n_devices], memory, peak_flops_for(kind), False,
                      approximate, allocator_limit=limit,
                      spec=GPU_TARGETS[known] if known else None)  # fmt: skip
    raise ConfigError(
        f"target {name!r} is not known{did_you_mean(name, TARGET_NAMES)}; use {one_of(TARGET_NAMES)}"
    )
