"""Where a plan is compiled: simulated CPU devices, the attached accelerators, or a named NVIDIA GPU or
Cloud TPU slice compiled deviceless with XLA's GPU or TPU compiler.

    target = resolve_target("h100-sxm", n_devices=64, hosts=8)   # compile-only H100s, 8 per host
    target = resolve_target("v5p-64")                            # a v5p slice: 32 chips on 8 hosts
    target.devices, target.memory_bytes, target.peak_flops

Deviceless GPU compilation needs the ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` wheels at jaxlib's
version, deviceless TPU compilation the ``libtpu`` wheel that ``jax[tpu]`` pins (``pip install -e
".[tpu]"``); neither needs the accelerator.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re

import jax

from shardmem._quiet import native_stderr_silenced
from shardmem.errors import ConfigError, PlanError, did_you_mean, one_of

#: The share of a GPU's memory XLA's GPU compiler assumes its allocator holds when the compile names no
#: allocator limit (a deviceless compile): xla/service/gpu/gpu_hlo_schedule.cc, GetSchedulerMemoryLimit.
XLA_DEFAULT_MEMORY_PERCENT = 80
#: The share of device memory JAX's allocator takes in a run that sets nothing else: the default of
#: ``memory.usable_fraction``, which ``shardmem train`` passes it as ``XLA_PYTHON_CLIENT_MEM_FRACTION``.
DEFAULT_ALLOCATOR_FRACTION = 0.9


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """Published facts about one GPU model and the links of the server it usually comes in.

    Device facts are from XLA's GPU spec files and vendor datasheets (``shared/reference/gpu-targets.md``).
    ``peak_flops`` is the dense tensor-core rate per operand dtype ("f32" is TF32, which XLA uses for
    float32 matmuls at default precision, or the plain FP32 rate on GPUs without TF32), with FP32
    accumulation as XLA's matmuls accumulate; a dtype a GPU has no tensor cores for is absent (no "bf16"
    before Ampere: T4 and V100). Link rates are per direction, from the vendors' system
    datasheets: ``nvlink_bandwidth`` from one GPU to the other GPUs of its node, ``network_bandwidth``
    of one NIC to other nodes (the server has ``nics_per_node`` of them for its ``gpus_per_node`` GPUs),
    ``host_bandwidth`` to host memory (PCIe). ``nvls``: the server's NVSwitch reduces (NVLink SHARP);
    ``sharp``: its InfiniBand switches do (SHARP; off by default: it takes NCCL's CollNet plugin). A
    cluster's real figures override these (``interconnect`` in the config).
    ``threads_per_sm`` is the compute capability's resident-thread limit (1024 on 7.5, 1536 on 8.6 and
    8.9, 2048 on the others). ``gpu_link`` names the link ``nvlink_bandwidth`` is: NVLink, or PCIe for
    the cards that reach the other GPUs of their server over it.
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
    gpus_per_node: int = 8  # The server's GPUs (DGX/HGX: 8).
    nics_per_node: int = 8  # Its NICs to other nodes, of network_bandwidth each (DGX/HGX: one per GPU).
    nvls: bool = False  # NVSwitch with NVLink SHARP (third-generation NVSwitch: H100, H200, B200).
    sharp: bool = False  # InfiniBand SHARP in-network reductions (NCCL CollNet plugin).
    threads_per_sm: int = 2048
    gpu_link: str = "NVLink"  # What ``nvlink_bandwidth`` is, as the report names it.

    @property
    def has_bf16(self) -> bool:
        """Whether the GPU has bf16 tensor cores (compute capability 8.0 on); before that, XLA computes
        a bf16 matmul in float32."""
        return "bf16" in self.peak_flops

    @property
    def peak_bf16_flops(self) -> float:
        """The dense 16-bit peak MFU is quoted against: bf16, or fp16 on GPUs without bf16 (T4, V100)."""
        return self.peak_flops["bf16"] if self.has_bf16 else self.peak_flops["f16"]

    def target_config(self, allocator_bytes: int | None = None) -> str:
        """Returns the ``GpuTargetConfigProto`` text XLA's deviceless compiler takes.

        ``allocator_bytes``: what JAX's allocator will hold on the GPU the program runs on. XLA limits its
        scheduler and its rematerialization to that much (less the program's arguments and outputs,
        times ``xla_gpu_memory_limit_slop_factor``): JAX's compile passes an attached GPU's allocator
        limit as the module's ``device_memory_size``, and with none, as deviceless, XLA takes
        :data:`XLA_DEFAULT_MEMORY_PERCENT` of the device's memory (``GetSchedulerMemoryLimit``). So the
        description gives the device ``allocator_bytes`` over that share, and the deviceless compile
        works within the limit the run will have. None: the device's memory as it is."""
        major, minor = self.compute_capability
        memory = self.memory_bytes
        if allocator_bytes is not None:
            memory = allocator_bytes * 100 // XLA_DEFAULT_MEMORY_PERCENT
        return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_sm}
  threads_per_core_limit: {self.threads_per_sm}
  core_count: {self.sm_count}
  fpus_per_core: {self.fpus_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.memory_bandwidth)}
  l2_cache_size: {self.l2_cache_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {memory}
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
GiB = 1 << 30  # Memory sizes are binary: a "24 GB" card holds 24 GiB of memory chips.

# Dense tensor-core peaks with FP32 accumulation (NVIDIA datasheets and architecture whitepapers;
# sparsity figures halved). H100 SXM/H200, H100 PCIe, H100 NVL: the H100 and H200 datasheets. A100 and
# B200: theirs. Ada: the L4 and L40S datasheets; the RTX 4090 from the Ada architecture whitepaper
# (appendix, "with FP32 Accumulate": GeForce cards run it at half the FP16-accumulate rate). Ampere
# GA102: the RTX A6000 datasheet; the RTX 3090 from the GA102 whitepaper (FP32 accumulate, half rate);
# the A10G has no NVIDIA datasheet (an AWS part: 80 SMs at 1.71 GHz with GeForce-rate tensor cores, 512
# FLOP per SM per clock, 70 TFLOP/s as cloud providers quote it). Turing and Volta (T4, V100 SXM2
# datasheets) have fp16 tensor cores only: "f32" is the plain FP32 rate, and XLA runs bf16 matmuls in f32.
_HOPPER = {"bf16": 989.4e12, "f16": 989.4e12, "f32": 494.7e12, "f8": 1978.9e12}
_HOPPER_PCIE = {"bf16": 756e12, "f16": 756e12, "f32": 378e12, "f8": 1513e12}
_HOPPER_NVL = {"bf16": 835.5e12, "f16": 835.5e12, "f32": 417.5e12, "f8": 1670.5e12}
_AMPERE = {"bf16": 312e12, "f16": 312e12, "f32": 156e12}  # No FP8 units: f8 runs as bf16.
_BLACKWELL = {"bf16": 2250e12, "f16": 2250e12, "f32": 1100e12, "f8": 4500e12}
_RTX_4090 = {"bf16": 165.2e12, "f16": 165.2e12, "f32": 82.6e12, "f8": 330.3e12}
_L4 = {"bf16": 121e12, "f16": 121e12, "f32": 60e12, "f8": 242.5e12}
_L40S = {"bf16": 362.05e12, "f16": 362.05e12, "f32": 183e12, "f8": 733e12}
_RTX_3090 = {"bf16": 71e12, "f16": 71e12, "f32": 35.6e12}
_A10G = {"bf16": 70e12, "f16": 70e12, "f32": 35e12}
_RTX_A6000 = {"bf16": 154.8e12, "f16": 154.8e12, "f32": 77.4e12}
_T4 = {"f16": 65e12, "f32": 8.1e12}
_V100 = {"f16": 125e12, "f32": 15.7e12}

# Links each way. DGX/HGX H100 and H200: 8 GPUs, NVLink 4 at 900 GB/s both ways through third-generation
# NVSwitch (NVLink SHARP), eight 400 Gb/s NDR ConnectX-7 NICs per node (50 GB/s each), PCIe Gen5 x16
# (64 GB/s). DGX A100: NVLink 3 at 600 GB/s through NVSwitch (no NVLS), eight 200 Gb/s HDR NICs (25 GB/s),
# PCIe Gen4 x16 (32 GB/s). HGX B200: NVLink 5 at 1.8 TB/s, NVLS, eight 400 Gb/s NICs. An H100 PCIe card
# reaches the other GPUs of its server over PCIe Gen5 (its NVLink bridge pairs two cards only). (NVIDIA
# DGX H100/A100 and HGX B200 datasheets; shared/reference/step-time-and-tpu.md.)
# The RTX 3090 and RTX A6000 reach the other cards of their server over PCIe Gen4 (their NVLink bridges pair
# two cards), and so do the 4090, L4, L40S and A10G, which have no NVLink. DGX-1 V100: NVLink 2 at 300 GB/s
# both ways, four 100 Gb/s EDR NICs for eight GPUs, PCIe Gen3 x16 (16 GB/s), as the T4's. Servers of PCIe
# cards publish no NIC per GPU: one 100 Gb/s NIC per eight cards is assumed, as AWS's largest G4dn, G5 and
# G6 instances (8 x T4, A10G, L4) have; G6e (8 x L40S) has 400 Gb/s.
_NIC_100G = 100e9 / 8
_NIC_400G = 400e9 / 8

# Device facts: compute capability, SMs, FP32 units per SM, boost clock, memory, bandwidth, L2, shared
# memory per SM and per block. Where XLA ships a spec file (xla/backends/gpu/target_config/specs: H100,
# H200, A100, B200, RTX A6000, V100 16 GB) its figures are taken, memory as the driver reports it (about
# 1% under the chips' size); the other rows are datasheet figures, memory as the size of the chips, and
# shared memory and threads the compute capability's limits (CUDA programming guide, "Compute
# Capabilities").
GPU_TARGETS: dict[str, GpuSpec] = {
    "h100-sxm": GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 1.98, 84942979072,
                        3352320000000, 52428800, 233472, 232448, _HOPPER, 450 * GB, 50 * GB, 64 * GB,
                        nvls=True),
    # H100 SXM5 with 96 GB of HBM2e at 2.4 TB/s (Meta's Grand Teton servers: torchtitan's
    # benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md), otherwise the H100 SXM's row; its rates are
    # the 700 W datasheet's, and a power limit below that (Grand Teton's default is 500 W) clocks lower.
    "h100-sxm-96g": GpuSpec("NVIDIA H100 96GB HBM2e", (9, 0), 132, 128, 1.98, 96 * GiB, 2400 * GB,
                            52428800, 233472, 232448, _HOPPER, 450 * GB, 50 * GB, 64 * GB, nvls=True),
    "h100-pcie": GpuSpec("NVIDIA H100 PCIe", (9, 0), 114, 128, 1.755, 84942979072,
                         2039040000000, 52428800, 233472, 232448, _HOPPER_PCIE, 64 * GB, 50 * GB, 64 * GB,
                         gpu_link="PCIe"),
    "h100-nvl": GpuSpec("NVIDIA H100 NVL", (9, 0), 132, 128, 1.785, 94 * GiB,
                        3900 * GB, 52428800, 233472, 232448, _HOPPER_NVL, 64 * GB, 50 * GB, 64 * GB,
                        gpu_link="PCIe"),
    "h200": GpuSpec("NVIDIA H200 141GB HBM3e", (9, 0), 132, 128, 1.98, 151397597184,
                    4800000000000, 52428800, 233472, 232448, _HOPPER, 450 * GB, 50 * GB, 64 * GB, nvls=True),
    "a100-40g": GpuSpec("NVIDIA A100-SXM4-40GB", (8, 0), 108, 64, 1.41, 42331013120,
                        1555200000000, 41943040, 167936, 166912, _AMPERE, 300 * GB, 25 * GB, 32 * GB),
    "a100-80g": GpuSpec("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 1.41, 85100068864,
                        2039040000000, 41943040, 167936, 166912, _AMPERE, 300 * GB, 25 * GB, 32 * GB),
    "b200": GpuSpec("NVIDIA B200", (10, 0), 148, 128, 1.965, 191514411008,
                    7672320000000, 132644864, 233472, 232448, _BLACKWELL, 900 * GB, 50 * GB, 64 * GB,
                    nvls=True),
    "l40s": GpuSpec("NVIDIA L40S", (8, 9), 142, 128, 2.52, 48 * GiB, 864 * GB, 96 << 20, 102400,
                    101376, _L40S, 32 * GB, _NIC_400G, 32 * GB, nics_per_node=1, threads_per_sm=1536,
                    gpu_link="PCIe"),
    "l4": GpuSpec("NVIDIA L4", (8, 9), 58, 128, 2.04, 24 * GiB, 300 * GB, 48 << 20, 102400, 101376,
                  _L4, 32 * GB, _NIC_100G, 32 * GB, nics_per_node=1, threads_per_sm=1536, gpu_link="PCIe"),
    "rtx-4090": GpuSpec("NVIDIA GeForce RTX 4090", (8, 9), 128, 128, 2.52, 24 * GiB, 1008 * GB, 72 << 20,
                        102400, 101376, _RTX_4090, 32 * GB, _NIC_100G, 32 * GB,
                        nics_per_node=1, threads_per_sm=1536, gpu_link="PCIe"),
    "rtx-a6000": GpuSpec("NVIDIA RTX A6000", (8, 6), 84, 128, 1.8, 51041271808, 768096000000, 6 << 20,
                         102400, 101376, _RTX_A6000, 32 * GB, _NIC_100G, 32 * GB,
                         nics_per_node=1, threads_per_sm=1536, gpu_link="PCIe"),
    "rtx-3090": GpuSpec("NVIDIA GeForce RTX 3090", (8, 6), 82, 128, 1.695, 24 * GiB, 936 * GB, 6 << 20,
                        102400, 101376, _RTX_3090, 32 * GB, _NIC_100G, 32 * GB,
                        nics_per_node=1, threads_per_sm=1536, gpu_link="PCIe"),
    "a10g": GpuSpec("NVIDIA A10G", (8, 6), 80, 128, 1.71, 24 * GiB, 600 * GB, 6 << 20, 102400, 101376,
                    _A10G, 32 * GB, _NIC_100G, 32 * GB, nics_per_node=1, threads_per_sm=1536,
                    gpu_link="PCIe"),
    "v100-16g": GpuSpec("Tesla V100-SXM2-16GB", (7, 0), 80, 64, 1.53, 16935682048, 898048000000,
                        6 << 20, 98304, 98304, _V100, 150 * GB, _NIC_100G, 16 * GB, nics_per_node=4),
    "v100-32g": GpuSpec("Tesla V100-SXM2-32GB", (7, 0), 80, 64, 1.53, 32 * GiB, 898048000000,
                        6 << 20, 98304, 98304, _V100, 150 * GB, _NIC_100G, 16 * GB, nics_per_node=4),
    "t4": GpuSpec("Tesla T4", (7, 5), 40, 64, 1.59, 16 * GiB, 320 * GB, 4 << 20, 65536, 65536, _T4,
                  16 * GB, _NIC_100G, 16 * GB, nics_per_node=1, threads_per_sm=1024, gpu_link="PCIe"),
}  # fmt: skip

# Multi-Instance GPU (MIG) slices: a GPU split into up to 7 instances, each with its own share of the SMs (in
# sevenths) and of the memory (in eighths; the L2 cache and the memory bandwidth come with the memory
# slices), from NVIDIA's Multi-Instance GPU User Guide, "Supported MIG Profiles" (docs.nvidia.com/datacenter/
# tesla/mig-user-guide/supported-mig-profiles.html): on A100, H100 and H200 the same six shapes, named by
# each product's memory. An instance has no NVLink and no peer-to-peer path to any other (the guide's
# "Application Considerations"): collectives between instances go through host memory, over the PCIe link
# the GPU's instances share. The SM counts the driver reports (nvidia-smi mig -lgip) can be a few below
# the guide's fraction of the whole GPU's.
#: (sevenths of the SMs, eighths of the memory, instances one GPU holds) of each MIG profile, in order.
_MIG_SHAPES = ((1, 1, 7), (1, 2, 4), (2, 2, 3), (3, 4, 2), (4, 4, 1), (7, 8, 1))
#: The whole-GPU target -> its MIG profiles' names, in the order of _MIG_SHAPES.
MIG_PROFILES = {
    "a100-40g": ("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
    "a100-80g": ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "h100-sxm": ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "h100-pcie": ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "h200": ("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
}


def mig_slice(gpu: GpuSpec, profile: str, sevenths: int, eighths: int, per_gpu: int) -> GpuSpec:
    """Returns the spec of one MIG instance of ``gpu``: ``sevenths`` of its SMs (and of its matmul rates),
    ``eighths`` of its memory, L2 cache and memory bandwidth; ``per_gpu`` such instances share the GPU's
    PCIe link, the only path between them (no NVLink, no NVLink SHARP), and a server holds ``per_gpu``
    times its GPUs of them."""
    sm_count = gpu.sm_count * sevenths // 7
    share = sm_count / gpu.sm_count
    pcie = gpu.host_bandwidth / per_gpu
    return dataclasses.replace(
        gpu, description=f"{gpu.description} MIG {profile}", sm_count=sm_count,
        memory_bytes=gpu.memory_bytes * eighths // 8, memory_bandwidth=gpu.memory_bandwidth * eighths // 8,
        l2_cache_bytes=gpu.l2_cache_bytes * eighths // 8,
        peak_flops={dtype: rate * share for dtype, rate in gpu.peak_flops.items()},
        nvlink_bandwidth=pcie, host_bandwidth=pcie, gpus_per_node=gpu.gpus_per_node * per_gpu, nvls=False,
        sharp=False, gpu_link="PCIe through host memory (MIG: no NVLink between instances)",
    )  # fmt: skip


#: MIG slices as targets, ``<gpu>-mig-<profile>`` (``h100-sxm-mig-3g.40gb``): one device is one instance.
MIG_TARGETS: dict[str, GpuSpec] = {
    f"{gpu}-mig-{profile}": mig_slice(GPU_TARGETS[gpu], profile, *shape)
    for gpu, profiles in MIG_PROFILES.items()
    for profile, shape in zip(profiles, _MIG_SHAPES, strict=True)
}
#: Every GPU row by target name: whole GPUs and MIG slices (what a target or a GPU's device_kind names).
GPU_ROWS: dict[str, GpuSpec] = {**GPU_TARGETS, **MIG_TARGETS}


@dataclasses.dataclass(frozen=True)
class TpuSpec:
    """Published facts about one Cloud TPU chip and the slices it comes in (Cloud TPU documentation,
    "System architecture" pages for v4, v5e, v5p and v6e; ``shared/reference/step-time-and-tpu.md``).

    Rates are per chip and per direction: ``ici_bandwidth`` is all of a chip's inter-chip links together
    (half the documented bidirectional figure), ``dcn_bandwidth`` its share of its host's data-centre
    NICs (between slices), ``host_bandwidth`` its PCIe link to host memory. ``interconnect.nvlink`` and
    ``interconnect.network`` in a config override ICI and DCN (the step-time model's fast and slow link).
    """

    description: str  # The chips' ``device_kind`` in JAX.
    generation: str  # libtpu's name for the chip in a topology ("v5e:2x2").
    memory_bytes: int
    memory_bandwidth: int
    peak_flops: dict[str, float]
    ici_bandwidth: float
    dcn_bandwidth: float
    host_bandwidth: float
    slice_shapes: dict[int, tuple[int, ...]]  # Chips -> the slice's chip grid (Cloud TPU's shapes).
    cores_per_chip: int  # TensorCores a chip has; v4 and v5p slice names count them (v5p-8 is 4 chips).
    hosts_of_one: int = 4  # Chips per host in multi-host slices; smaller slices are one host.

    @property
    def peak_bf16_flops(self) -> float:
        """The dense bf16 peak, the rate MFU is quoted against."""
        return self.peak_flops["bf16"]

    @property
    def nvlink_bandwidth(self) -> float:
        """The fast link, under the name the step-time model reads: ICI, inside a slice."""
        return self.ici_bandwidth

    @property
    def network_bandwidth(self) -> float:
        """The slow link, under the name the step-time model reads: DCN, between slices."""
        return self.dcn_bandwidth


# Standard slice shapes (Cloud TPU docs, "Supported configurations"): 3D tori for v4/v5p, 2D for v5e/v6e.
_SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
              256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16),
              4096: (16, 16, 16)}  # fmt: skip
_SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16),
              256: (16, 16)}  # fmt: skip
# TPU matmuls take f32 operands at bf16 rate (JAX's default precision is one bf16 pass); "f8" is the int8
# rate where the chip has one. ICI each way: v5e 1,600 Gb/s, v6e 3,584 Gb/s, v5p 4,800 Gb/s per chip (docs);
# v4 six links of 50 GB/s each way (Jouppi et al., ISCA 2023). DCN per chip: v5p 50 Gb/s (docs); v5e and
# v6e the pod's data-centre bandwidth over its 256 chips (6.4 and 25.6 Tb/s); v4 publishes none (v5p's
# figure assumed). Host links: v4 PCIe Gen3 x16 (16 GB/s); the others assumed PCIe Gen4 x16 (32 GB/s).
TPU_TARGETS: dict[str, TpuSpec] = {
    "tpu-v4": TpuSpec("TPU v4", "v4", 32 * GiB, 1200 * GB, {"bf16": 275e12, "f16": 275e12, "f32": 275e12,
                      "f8": 275e12}, 300 * GB, 6.25 * GB, 16 * GB, _SHAPES_3D, 2),
    "tpu-v5e": TpuSpec("TPU v5 lite", "v5e", 16 * GiB, 819 * GB, {"bf16": 197e12, "f16": 197e12,
                       "f32": 197e12, "f8": 393e12}, 200 * GB, 3.125 * GB, 32 * GB, _SHAPES_2D, 1),
    "tpu-v5p": TpuSpec("TPU v5", "v5p", 95 * GiB, 2765 * GB, {"bf16": 459e12, "f16": 459e12, "f32": 459e12,
                       "f8": 459e12}, 600 * GB, 6.25 * GB, 32 * GB, {**_SHAPES_3D, 6144: (16, 16, 24)}, 2),
    "tpu-v6e": TpuSpec("TPU v6 lite", "v6e", 32 * GiB, 1640 * GB, {"bf16": 918e12, "f16": 918e12,
                       "f32": 918e12, "f8": 1836e12}, 448 * GB, 12.5 * GB, 32 * GB, _SHAPES_2D, 1),
}  # fmt: skip
#: Cloud TPU's accelerator types: ``v5p-128`` (a count of TensorCores on v4/v5p, of chips on v5e/v6e),
#: ``v5litepod-16`` for v5e; ``tpu-`` in front is accepted, and ``2xv5p-128`` is two such slices joined
#: over DCN (multislice).
_SLICE = re.compile(r"^(?:(\d+)x)?(?:tpu-)?(v4|v5e|v5p|v6e|v5litepod)-(\d+)$")
#: Chips in all the slices of a target: more than the largest jobs run on Cloud TPU (tens of thousands of
#: chips), few enough that libtpu describes them in seconds (a million took 28 s, 100 million ran out of
#: memory before any check).
MAX_TPU_CHIPS = 65_536
#: The libtpu that ``jax[tpu]`` pins for the JAX versions shardmem is tested with.
LIBTPU_FOR_JAX = {"0.10.2": "0.0.42.*", "0.12.0.1": "0.0.50.*"}

TARGET_NAMES = ("cpu", "local", *GPU_TARGETS, *TPU_TARGETS)


def is_target_name(name: str) -> bool:
    """Whether ``name`` is a target: one of :data:`TARGET_NAMES`, a MIG slice (:data:`MIG_TARGETS`) or a
    TPU slice such as ``v5p-64``."""
    return name in TARGET_NAMES or name in MIG_TARGETS or bool(_SLICE.match(name))


def tpu_slice(name: str) -> tuple[str, int, int] | None:
    """Returns (the key of :data:`TPU_TARGETS`, chips per slice, slices) of a slice name such as
    ``v5p-8`` (4 chips, 1 slice) or ``2xv5e-16`` (16 chips, 2 slices), or None when ``name`` is none."""
    match = _SLICE.match(name)
    if not match:
        return None
    slices, generation, count = match.groups()
    if slices is not None and int(slices) < 1:
        raise ConfigError(f"target {name!r}: join 1 or more slices, e.g. 2x{generation}-{count}")
    key = "tpu-v5e" if generation == "v5litepod" else f"tpu-{generation}"
    cores = TPU_TARGETS[key].cores_per_chip
    if int(count) % cores:
        raise ConfigError(
            f"target {name!r}: {generation} slice names count TensorCores, {cores} per chip, so the "
            f"number must be even; e.g. {generation}-8 is 4 chips"
        )
    chips, slices = int(count) // cores, int(slices or 1)
    if slices > 1 and chips * slices > MAX_TPU_CHIPS:  # One slice too large is no slice shape (later).
        most = MAX_TPU_CHIPS // chips if chips <= MAX_TPU_CHIPS else 0
        fix = f"join at most {most:,} such slices ({most}x{generation}-{count})" if most else "smaller slices"
        raise ConfigError(
            f"target {name!r}: {slices:,} slices of {chips:,} chips make {chips * slices:,} chips, more than "
            f"the {MAX_TPU_CHIPS:,} shardmem plans for; {fix}"
        )
    return key, chips, slices


def link_domains(devices) -> list[int]:
    """Returns, for each device, the domain its fast link reaches: its host (process) for GPUs and CPUs,
    its slice for TPUs (every chip of a slice is on ICI, whichever host it hangs off). A collective
    whose group spans two domains runs over the slow link (the network, DCN)."""
    return [(getattr(d, "slice_index", 0) or 0) if d.platform == "tpu" else d.process_index for d in devices]


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
    spec: GpuSpec | TpuSpec | None = None  # The chip's published facts, where it is one shardmem knows.

    @property
    def platform(self) -> str:
        """JAX platform of the devices: "cpu", "cuda" (deviceless GPUs included), "gpu" or "tpu"."""
        return self.devices[0].platform


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


#: Simulated CPU devices a plan or run may ask for: starting 4096 takes seconds, 16384 many minutes.
MAX_CPU_DEVICES = 4096


def ensure_cpu_devices(n: int) -> None:
    """Asks JAX for at least ``n`` simulated CPU devices (never fewer than an earlier call asked for: a
    sweep planning its candidates in one process asks for the most any needs, then each candidate for
    its own); only possible before JAX's backends start. More than :data:`MAX_CPU_DEVICES` is a
    ConfigError (the mesh's)."""
    if n > MAX_CPU_DEVICES:
        raise ConfigError(
            f"mesh.axes make a mesh of {n:,} devices, more than the {MAX_CPU_DEVICES} simulated CPU devices "
            "JAX can start in reasonable time; plan it for a GPU target (e.g. --target h100-sxm) or use "
            "fewer devices"
        )
    try:
        jax.config.update("jax_num_cpu_devices", max(n, jax.config.jax_num_cpu_devices, 1))
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
    """Returns the deviceless target (a key of :data:`GPU_TARGETS` or :data:`MIG_TARGETS`) that models a
    GPU's ``device_kind``."""
    kind = device_kind.lower()
    for name, spec in GPU_ROWS.items():  # A MIG instance's device_kind names its profile, as these do.
        if spec.description.lower() == kind:
            return name
    if "a100" in kind:
        return "a100-40g" if "40gb" in kind else "a100-80g"
    if "v100" in kind:  # The PCIe V100s clock lower; the SXM2 row is the nearest there is.
        return "v100-32g" if "32gb" in kind else "v100-16g"
    markers = (("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100 nvl", "h100-nvl"), ("h100", "h100-sxm"),
               ("b200", "b200"), ("rtx 4090", "rtx-4090"), ("rtx 3090", "rtx-3090"), ("a6000", "rtx-a6000"),
               ("l40s", "l40s"), ("a10g", "a10g"), ("tesla t4", "t4"))  # fmt: skip
    for marker, name in markers:
        if marker in kind:
            return name
    return None


def peak_flops_for(device_kind: str) -> float | None:
    """Returns the dense bf16 peak of a GPU recognised from its ``device_kind``."""
    name = target_for_device_kind(device_kind)
    return GPU_ROWS[name].peak_bf16_flops if name else None


@functools.cache
def _gpu_topology(name: str, hosts: int, per_host: int, allocator_fraction: float):
    from jax.experimental import topologies

    spec = GPU_ROWS[name]
    described = spec.target_config(int(spec.memory_bytes * allocator_fraction))
    try:
        with native_stderr_silenced():  # Loading the CUDA plugin without a driver complains in C++.
            topology = topologies.get_topology_desc(
                platform="cuda", target_config=described, topology=f"1x{hosts}x{per_host}"
            )
    except Exception as e:  # The plugin raises a variety of runtime errors when absent or broken.
        raise PlanError(
            f"cannot compile for target {name!r} without a GPU: {e}. Deviceless GPU planning needs "
            "jax-cuda12-plugin and jax-cuda12-pjrt at jaxlib's version (pip install -e . installs "
            "them on Linux x86-64); or use --target cpu"
        ) from None
    return tuple(topology.devices)


def _libtpu_hint() -> str:
    pin = LIBTPU_FOR_JAX.get(jax.__version__)
    version = f"libtpu=={pin}, which jax[tpu] {jax.__version__} pins" if pin else "the libtpu jax[tpu] pins"
    return f'pip install -e ".[tpu]" (or pip install "jax[tpu]=={jax.__version__}") installs {version}'


@functools.cache
def _tpu_topology(key: str, shape: tuple[int, ...], slices: int):
    spec = TPU_TARGETS[key]
    if importlib.util.find_spec("libtpu") is None:
        raise PlanError(f"target {key!r} is compiled deviceless by libtpu, which is not installed: "
                        f"{_libtpu_hint()}")  # fmt: skip
    from jax.experimental import topologies

    chips = math.prod(shape)
    # Slices of up to 8 chips hang off one host (v5e/v6e-8 too); larger ones off hosts of 2x2 chips.
    per_host = shape if chips <= 8 and len(shape) == 2 else (2, 2) + (1,) * (len(shape) - 2)
    bounds = tuple(min(a, b) for a, b in zip(per_host, shape, strict=True)) + (1,) * (3 - len(shape))
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # No metadata server to ask on a machine without TPUs.
    # Compile-only: several processes (sweep's workers, parallel plans) may load libtpu at once; without
    # this the second one fails on libtpu's lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        with native_stderr_silenced():  # libtpu warns in C++ that it runs on no TPU VM; expected here.
            topology = topologies.get_topology_desc(
                topology_name=f"{spec.generation}:{'x'.join(map(str, shape))}", platform="tpu",
                chip_config_name="megacore" if spec.cores_per_chip > 1 else "default",
                chips_per_host_bounds=bounds, num_slices=slices,
            )  # fmt: skip
    except Exception as e:  # libtpu raises plain runtime errors for a version it does not match.
        raise PlanError(
            f"libtpu could not describe a {spec.generation} slice of {chips} chips: "
            f"{str(e).splitlines()[0][:200]}. Its version must match jaxlib's: {_libtpu_hint()}"
        ) from None
    return tuple(topology.devices)


def _resolve_tpu(name: str, n_devices: int | None) -> Target:
    named = tpu_slice(name)
    key, per_slice, slices = named if named else (name, n_devices, 1)
    spec = TPU_TARGETS[key]
    if per_slice is None:
        raise ConfigError(f"target {name!r} needs a chip count (n_devices), or name a slice such as "
                          f"{spec.generation}-{8 * spec.cores_per_chip}")  # fmt: skip
    if per_slice not in spec.slice_shapes:
        sizes = ", ".join(str(n * spec.cores_per_chip) for n in spec.slice_shapes)
        raise ConfigError(
            f"target {name!r}: {per_slice} chips per slice is no {spec.generation} slice shape; Cloud TPU "
            f"offers {spec.generation}-{{{sizes}}}"
            + (" (TensorCores, 2 per chip)" if spec.cores_per_chip > 1 else "")
        )
    shape = spec.slice_shapes[per_slice]
    devices = _tpu_topology(key, shape, slices)
    with native_stderr_silenced():  # JAX's own backends start now, not mid-plan: the CUDA plugin found
        jax.devices()  # no driver and absl says it logs to stderr, in C++, once per process.
    hosts = len({d.process_index for d in devices})  # One process per TPU VM, across all slices.
    grid = "x".join(map(str, shape))
    where = f"{slices} slices of {grid} over DCN" if slices > 1 else grid
    label = f"{len(devices)} x {spec.description} ({where}, {hosts} TPU VM{'s' * (hosts > 1)}), deviceless"
    return Target(key, label, devices, spec.memory_bytes, spec.peak_bf16_flops, True, False, spec=spec)


def resolve_target(
    name: str, *, n_devices: int | None = None, hosts: int = 1,
    allocator_fraction: float = DEFAULT_ALLOCATOR_FRACTION,
) -> Target:  # fmt: skip
    """Returns the devices (and their memory) to compile a mesh of ``n_devices`` for. A TPU slice name
    (``v5p-64``, ``2xv5p-64``) gives its own chips and hosts; ``tpu-v5p`` with ``n_devices`` takes the
    one slice of that many chips. A deviceless GPU's compiles work within the memory limit a run whose
    allocator takes ``allocator_fraction`` of each GPU will have (``memory.usable_fraction``, which
    ``shardmem train`` gives JAX's allocator: :meth:`GpuSpec.target_config`)."""
    if name in TPU_TARGETS or _SLICE.match(name):
        return _resolve_tpu(name, n_devices)
    if n_devices is None:
        raise ConfigError(f"target {name!r} needs n_devices, the number of devices to plan for")
    if name in GPU_ROWS:
        if n_devices % hosts:
            raise ConfigError(
                f"mesh.hosts={hosts} does not divide the {n_devices} devices; every host needs "
                "the same number of devices"
            )
        spec = GPU_ROWS[name]
        devices = _gpu_topology(name, hosts, n_devices // hosts, allocator_fraction)
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
        memory = GPU_ROWS[known].memory_bytes if known else int(stats.get("bytes_limit") or 0)
        memory = memory or host_memory_bytes() // len(devices)
        limit = int(stats["bytes_limit"]) if "bytes_limit" in stats else None
        approximate = devices[0].platform == "cpu"
        label = f"{len(devices)} x {kind} (attached)" + (", approximate" if approximate else "")
        return Target("local", label, devices[:n_devices], memory, peak_flops_for(kind), False,
                      approximate, allocator_limit=limit,
                      spec=GPU_ROWS[known] if known else None)  # fmt: skip
    raise ConfigError(
        f"target {name!r} is not known{did_you_mean(name, TARGET_NAMES)}; use {one_of(TARGET_NAMES)}"
    )


def precision_notes(target: Target, compute: str) -> list[str]:
    """What a plan for a GPU without bf16 (T4, V100) says of ``precision.compute=bfloat16`` (``compute``);
    empty for every other target and dtype."""
    spec = target.spec
    if compute != "bfloat16" or not isinstance(spec, GpuSpec) or spec.has_bf16:
        return []
    major, minor = spec.compute_capability
    f32, f16 = spec.peak_flops["f32"] / 1e12, spec.peak_flops["f16"] / 1e12
    return [
        f"precision.compute=bfloat16, but the {spec.description} (compute capability {major}.{minor}) has "
        f"no bf16 tensor cores: XLA computes its bf16 matmuls in float32, at {f32:g} TFLOP/s instead of "
        f"fp16's {f16:g}; set precision.compute=float16 (with a dynamic loss scale: precision.loss_scale)"
    ]


def tpu_notes(target: Target, memory, peak_bytes: int = 0) -> list[str]:
    """What a deviceless TPU plan cannot see, for the report (``memory`` is the config's
    :class:`~shardmem.config.MemoryConfig`, ``peak_bytes`` the plan's peak); empty for other targets."""
    if not isinstance(target.spec, TpuSpec) or not target.deviceless:
        return []
    reserve = memory.reserve / GiB
    notes = [
        f"TPU, deviceless: libtpu compiled the program the slice would run, but not the HBM its runtime "
        f"keeps for itself (memory.reserve={reserve:.2g} GiB budgets it), nor the host's input pipeline; "
        f"memory.deviceless_margin={memory.deviceless_margin:g} was measured for GPU autotuning and is "
        "applied unchanged (no TPU measurement backs it; 0 budgets the whole usable HBM)"
    ]
    if peak_bytes >= 0.99 * target.memory_bytes:
        notes.append(
            f"the peak is at the chip's HBM ({peak_bytes / target.memory_bytes:.1%}): XLA's TPU compiler "
            "rematerializes and reschedules on its own to fit the HBM it has, so this program may recompute "
            "more than remat.policy asks (the predicted step time replays it as compiled); a remat policy "
            "that fits the budget leaves it room"
        )
    return notes
