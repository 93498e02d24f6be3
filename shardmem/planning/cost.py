"""The step-time model: seconds per training step, read from the same optimized HLO the memory report reads.

    hardware = Hardware.of(target, config.interconnect)
    estimate = estimate_step_time(hlo.parse_module(compiled.as_text()), hardware, hosts_of, ...)
    estimate.seconds, estimate.breakdown(), estimate.no_overlap_seconds, estimate.full_overlap_seconds

Every kernel of the compiled step is costed on the target by a roofline: matmuls (dots, cuBLAS calls,
Triton GEMM fusions, convolutions, fused-attention kernels) at the dense peak for their dtype times an
achievable efficiency, everything else at its bytes accessed over the HBM bandwidth, plus a launch gap.
On a GPU a GEMM's FLOPs run in whole waves of output tiles over its SMs (:func:`gemm_seconds`): a GEMM
of few rows, a short prompt's prefill, leaves SMs idle that the plain rate assumes busy.
On a GPU cluster each collective is costed as NCCL runs it (:mod:`shardmem.planning.collectives`: ring,
tree, NVLS or SHARP, in the fastest protocol for its size; NVLink inside a node, the node's NICs shared
by its GPUs between nodes); on TPUs and simulated CPUs as a ring: a latency plus its bytes times the
ring's factor (all-reduce moves 2(n-1)/n of them) over the fast link, or the slow one when its group
spans hosts or slices. Host-offload copies cost their bytes over PCIe. The schedule is then replayed:
XLA's asynchronous collectives and copies run on their own streams beside the compute between their
start and done, so only the wait at a ``done`` is exposed. Loops run their bodies once per known trip;
recomputation is simply more kernels.

The efficiencies are documented constants below, each with its source; BENCHMARKS.md compares the model
with measured H200 step times ("Step time").
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shardmem.planning import hlo
from shardmem.planning.collectives import Cluster, Group, collective_seconds
from shardmem.units import format_seconds

#: Fraction of the dense tensor-core peak a large matmul reaches: a lent H200 ran an 8192^3 bf16 matmul
#: at 790 of its 989 TFLOP/s (shared/reference/gpu-targets.md).
MATMUL_EFFICIENCY = 0.80
#: Fused flash-attention kernels reach less of the peak than plain matmuls: FlashAttention-2 runs at
#: 35-50% of an H100's bf16 peak, cuDNN's and FlashAttention-3's at 60-75% (Shah et al., FlashAttention-3,
#: 2024). The plan compiles JAX's Pallas (Triton) kernel, of FlashAttention-2's design.
ATTENTION_EFFICIENCY = 0.45
#: Fraction of the HBM bandwidth a streaming kernel reaches: the lent H200 copied device to device at
#: 4.3 of its 4.8 TB/s.
MEMORY_EFFICIENCY = 0.90
#: Fraction of a link's rate a plain ring reaches, for the targets without a GPU cluster (TPU ICI and DCN,
#: simulated CPUs) and for host copies over PCIe; GPU collectives use the NCCL model's own
#: (:mod:`shardmem.planning.collectives`). All-reduce bus bandwidth on 8 x H100 (NVLink 4, 450 GB/s each
#: way) is reported at 350-480 GB/s (shared/reference/step-time-and-tpu.md).
LINK_EFFICIENCY = {"nvlink": 0.80, "network": 0.85, "host": 0.80}
#: Fixed cost of one plain-ring collective (TPUs, CPUs): about 10 us on the fast link and 25 us across
#: (the defaults of XLA's analytical collective model are of this order).
COLLECTIVE_LATENCY = {"nvlink": 10e-6, "network": 25e-6}
#: Gap between two kernels on the GPU (launch and tail), about 2 us with XLA's command buffers.
KERNEL_GAP = 2e-6
#: Output tiles (rows x columns) of the thread blocks of CUTLASS's 16-bit tensor-core GEMMs for Ampere and
#: later (cutlass_library/generator.py, GenerateSM80_TensorOp_16816); cuBLAS and XLA's Triton GEMMs choose
#: among tiles of these sizes. A GEMM on a GPU runs one block per output tile (:func:`gemm_seconds`).
GEMM_TILES = ((256, 128), (128, 256), (256, 64), (64, 256), (128, 128), (128, 64), (64, 128), (64, 64))
#: Split-K factors: the contraction cut into this many slices, each block writing an f32 partial of its
#: tile that a second kernel sums (how XLA's GPU compiler splits K, and cuBLAS's parallel reduction).
SPLIT_K = (1, 2, 3, 4, 6, 8, 16)

#: The model's median |error| against the step times measured on a lent H200 (8 trials, worst 23%, all
#: predicted fast: BENCHMARKS.md, "Step time"; bench/step_time.py). The efficiencies were not fitted to them.
CALIBRATED_ERROR = 0.128
#: What every estimate leaves out, said in the report.
ASSUMPTIONS = ("roofline per kernel at documented efficiencies; collectives overlap compute only between "
               "their start and done; no contention between concurrent streams")  # fmt: skip

#: Instructions that run no kernel.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id", "replica-id",
         "after-all", "add-dependency", "recv", "opt-barrier", "domain", "get-dimension-size"}  # fmt: skip
_FREE_CUSTOM_CALLS = ("AllocateBuffer", "MoveToHost", "MoveToDevice", "Sharding", "SPMDFullToShardShape",
                      "SPMDShardToFullShape", "annotate_device_placement")  # fmt: skip
#: The factor of a collective's bytes that crosses each device's link, for a group of n (ring algorithms).
_ALGORITHM = {
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}
_DTYPE_CLASS = {"bf16": "bf16", "f16": "f16", "f32": "f32", "f64": "f32", "s8": "f8", "u8": "f8"}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What the time model reads of a target: peaks per dtype, HBM bandwidth, links per direction (bytes
    per second: ``network_bandwidth`` is one NIC's on a GPU cluster) and, for GPUs, the cluster's wiring
    that the NCCL model reads (None: collectives are costed as plain rings, as on TPUs and CPUs)."""

    name: str
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    nvlink_bandwidth: float
    network_bandwidth: float
    host_bandwidth: float
    cluster: Cluster | None = None
    sms: int | None = None  # A GPU's streaming multiprocessors: GEMMs are costed by their tiles' waves.

    @classmethod
    def of(cls, target, interconnect=None) -> Hardware | None:
        """The hardware of a :class:`~shardmem.planning.targets.Target` with a GPU or TPU spec (None
        without one), its links and cluster overridden by a config's ``interconnect`` section. A GPU
        target's nodes hold as many GPUs as its hosts do (the server's NICs scale with them)."""
        spec = getattr(target, "spec", None)
        if spec is None:
            return None
        links = {"nvlink": spec.nvlink_bandwidth, "network": spec.network_bandwidth,
                 "host": spec.host_bandwidth}  # fmt: skip
        for key in links:
            links[key] = getattr(interconnect, key, None) or links[key]
        cluster = None
        if hasattr(spec, "nics_per_node"):  # A GPU: NCCL on NVLink and NICs.
            hosts = [d.process_index for d in getattr(target, "devices", ())]
            per_node = max(hosts.count(h) for h in set(hosts)) if hosts else None
            cluster = Cluster.of(
                spec, per_node, nvlink_bandwidth=links["nvlink"], nic_bandwidth=links["network"],
                **{key: getattr(interconnect, key, None) for key in ("nics_per_node", "nvls", "sharp")},
            )  # fmt: skip
        return cls(target.name, dict(spec.peak_flops), float(spec.memory_bandwidth), links["nvlink"],
                   links["network"], links["host"], cluster, getattr(spec, "sm_count", None))  # fmt: skip

    @classmethod
    def host(cls, n_devices: int) -> Hardware:
        """This machine as ``n_devices`` simulated CPU devices: its matmul rate and copy bandwidth
        (:func:`host_rates`), shared by the devices, which run on the same cores. The estimate ranks CPU
        layouts; it is no GPU prediction."""
        flops, bandwidth = host_rates()
        per_device = {"bf16": flops / n_devices, "f32": flops / n_devices}
        rate = bandwidth / n_devices
        return cls(f"cpu (this machine's rates / {n_devices} devices)", per_device, rate, rate, rate, rate)

    def describe_links(self, nodes: int) -> dict[str, Any]:
        """The links and cluster the estimate reads, for the report: rates in bytes per second each way,
        and a line for people ("2 nodes x 8 GPUs; per node 8 x 400 Gb/s NICs ...")."""
        links: dict[str, Any] = {"nodes": nodes, "nvlink_bandwidth": self.nvlink_bandwidth,
                                 "network_bandwidth": self.network_bandwidth,
                                 "host_bandwidth": self.host_bandwidth}  # fmt: skip
        if self.cluster is not None:
            c = self.cluster
            links.update(gpus_per_node=c.gpus_per_node, nics_per_node=c.nics_per_node, nvls=c.nvls,
                         sharp=c.sharp, description=c.describe(nodes))  # fmt: skip
        else:
            links["description"] = (f"{nodes} host{'s' * (nodes > 1)}; fast link "
                                    f"{_gbs(self.nvlink_bandwidth)}, slow link "
                                    f"{_gbs(self.network_bandwidth)} each way")  # fmt: skip
        links["description"] += f"; host (PCIe) {_gbs(self.host_bandwidth)}"
        return links

    def peak(self, dtype: str) -> float:
        """The dense matmul rate for operands of ``dtype`` (an HLO type such as ``bf16``). A dtype the GPU
        has no tensor cores for runs as XLA lowers it: fp8 and int8 as the 16-bit type, bf16 before
        Ampere (T4, V100) in float32."""
        rates = self.peak_flops
        kind = _DTYPE_CLASS.get(dtype, "bf16")
        if kind in rates:
            return rates[kind]
        if kind == "f8":
            return rates.get("bf16", rates.get("f16", rates["f32"]))
        return rates["f32"]

    def mfu_peak(self) -> float:
        """The 16-bit peak MFU is quoted against: bf16, or fp16 where the GPU has no bf16."""
        return self.peak_flops.get("bf16") or self.peak_flops["f16"]

    def link(self, kind: str) -> float:
        return {"nvlink": self.nvlink_bandwidth, "network": self.network_bandwidth,
                "host": self.host_bandwidth}[kind] * LINK_EFFICIENCY[kind]  # fmt: skip


def _gbs(rate: float) -> str:
    return f"{rate / 1e9:.3g} GB/s"


#: Pins the host rates, ``FLOPS,BYTES`` per second (e.g. ``6e10,8e9``), instead of measuring them: CPU
#: plans that must agree from run to run. A search's parent process sets it for its workers.
HOST_RATES_ENV = "SHARDMEM_HOST_RATES"


def host_rates() -> tuple[float, float]:
    """(matmul FLOP/s, copy bytes/s) of one CPU device running this machine's cores, divided by the
    efficiencies so that the model's kernels reach them: from ``$SHARDMEM_HOST_RATES`` when set, else
    measured once per process (:func:`measure_host_rates`). A malformed value is a ConfigError."""
    import os

    pinned = os.environ.get(HOST_RATES_ENV)
    if not pinned:
        return measure_host_rates()
    try:
        flops, bandwidth = (float(part) for part in pinned.split(","))
    except ValueError:
        flops = bandwidth = 0.0
    if not (math.isfinite(flops) and math.isfinite(bandwidth) and flops > 0 and bandwidth > 0):
        from shardmem.errors import ConfigError

        raise ConfigError(f"{HOST_RATES_ENV}={pinned!r}: write two positive rates, FLOPS,BYTES per second "
                          f"(e.g. 6e10,8e9), or unset it to measure them")  # fmt: skip
    return flops, bandwidth


@functools.cache
def measure_host_rates() -> tuple[float, float]:
    """(matmul FLOP/s, copy bytes/s) measured on this machine, the best of 5 runs of each kernel. Other
    jobs on the cores move them (bench/host_rates.py: 1.5-2x between fresh processes at a load of 18-20;
    the best of 0.25 s of runs was no steadier), so a search shares one measurement with its workers."""
    import jax
    import jax.numpy as jnp

    from shardmem._quiet import native_stderr_silenced

    with native_stderr_silenced():  # It may start JAX's backends: a sweep's parent measures before planning.
        device = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((1024, 1024), jnp.float32), device)
    x = jax.device_put(jnp.ones((1 << 23,), jnp.float32), device)
    matmul, scale = jax.jit(lambda a: a @ a), jax.jit(lambda x: x * 2.0)

    def best(fn, arg) -> float:
        fn(arg).block_until_ready()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn(arg).block_until_ready()
            times.append(time.perf_counter() - start)
        return min(times)

    flops = 2 * 1024**3 / best(matmul, a) / MATMUL_EFFICIENCY
    bandwidth = 2 * x.nbytes / best(scale, x) / MEMORY_EFFICIENCY
    return flops, bandwidth


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """The collectives of one kind over one kind of group: how many run per step, their bytes per device,
    and the seconds they take on their stream (before overlap)."""

    kind: str
    group_size: int
    link: str  # "nvlink" or "network" (the group spans hosts)
    count: int
    bytes: int
    seconds: float
    algorithm: str = ""  # How NCCL runs it ("ring/Simple", "nvls/Simple", ...); "" for a plain ring.


@dataclasses.dataclass(frozen=True)
class LoopCost:
    """One loop of the step (a scan over layers, micro-batches, pipeline ticks): its trips and the
    seconds and exposed communication of one trip."""

    scope: str
    trips: int
    seconds_per_trip: float
    exposed_communication_per_trip: float


@dataclasses.dataclass(frozen=True)
class StepTime:
    """The predicted seconds of one training step on the target, and what they are made of.

    ``compute`` (matmul kernels), ``memory_bound`` (the other kernels) and ``launch`` run on the compute
    stream one after the other; ``exposed_communication`` and ``exposed_host_transfers`` are the waits the
    replayed schedule found at collectives' and offload copies' ``done``; ``bubble`` is the share of the
    pipelined loop that idle stages spend (inside the other terms: it is work on placeholders).
    ``communication`` and ``host_transfers`` are the streams' whole busy time, overlapped or not."""

    seconds: float
    compute: float
    memory_bound: float
    launch: float
    communication: float
    exposed_communication: float
    host_transfers: float
    exposed_host_transfers: float
    bubble: float
    host_transfer_bytes: int  # Bytes copied between device and host memory per step (offload).
    kernels: int  # kernel launches per step
    kernel_flops: float  # FLOPs per device the replayed kernels do (the HLO's matmuls, every trip counted).
    collectives: tuple[CollectiveCost, ...]
    loops: tuple[LoopCost, ...]
    hardware: str
    tokens_per_step: int | None = None
    model_flops: float | None = None  # All devices, without recomputation or the bubble's idle work.
    hardware_flops: float | None = None  # All devices, recomputation included.
    devices: int = 1
    peak_flops: float | None = None  # 16-bit dense peak per device (bf16; fp16 without it), for MFU and HFU.
    uncertainty: float | None = None  # Relative error the calibration measured (median), see BENCHMARKS.
    # Collectives whose replica groups were written in a form the model cannot read (costed as one group
    # of every device, the worst case); a plan warns when there are any.
    unread_groups: tuple[str, ...] = ()
    # The link rates (bytes/s each way) and cluster shape the estimate used: see Hardware.describe_links.
    links: Mapping[str, Any] | None = None

    @property
    def no_overlap_seconds(self) -> float:
        """The bound where nothing overlaps: every stream's time one after another."""
        return self.compute + self.memory_bound + self.launch + self.communication + self.host_transfers

    @property
    def full_overlap_seconds(self) -> float:
        """The bound where communication and host copies hide entirely behind the kernels (or the kernels
        behind the busiest stream)."""
        return max(self.compute + self.memory_bound + self.launch, self.communication, self.host_transfers)

    @property
    def tokens_per_second(self) -> float | None:
        return self.tokens_per_step / self.seconds if self.tokens_per_step and self.seconds else None

    def _utilization(self, flops: float | None) -> float | None:
        if not flops or not self.peak_flops or not self.seconds:
            return None
        return flops / (self.devices * self.peak_flops * self.seconds)

    @property
    def mfu(self) -> float | None:
        """Model FLOP utilisation: the model's matmul FLOPs (no recomputation) per second over the peak."""
        return self._utilization(self.model_flops)

    @property
    def hfu(self) -> float | None:
        """Hardware FLOP utilisation: recomputation counted."""
        return self._utilization(self.hardware_flops)

    def breakdown(self) -> dict[str, float]:
        """Seconds by where they go, adding up to ``seconds``: compute, memory-bound, launch gaps, exposed
        communication and exposed host transfers (the bubble is a share of these, shown apart)."""
        return {"compute": self.compute, "memory_bound": self.memory_bound, "launch": self.launch,
                "exposed_communication": self.exposed_communication,
                "exposed_host_transfers": self.exposed_host_transfers}  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "breakdown": self.breakdown(),
            "bubble_seconds": self.bubble,
            "communication_seconds": self.communication,
            "host_transfer_seconds": self.host_transfers,
            "host_transfer_bytes": self.host_transfer_bytes,
            "bounds": {"no_overlap": self.no_overlap_seconds, "full_overlap": self.full_overlap_seconds},
            "tokens_per_second": self.tokens_per_second,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "kernels": self.kernels,
            "kernel_flops": self.kernel_flops,
            "collectives": [dataclasses.asdict(c) for c in self.collectives],
            "loops": [dataclasses.asdict(loop) for loop in self.loops],
            "hardware": self.hardware,
            "uncertainty": self.uncertainty,
            "unread_groups": list(self.unread_groups),
            "links": dict(self.links) if self.links else None,
        }

    def summary(self) -> str:
        """One line for people: "1.23 s (compute 0.9 s, ...), 53,000 tokens/s, MFU 41%"."""
        parts = [f"{name.replace('_', ' ')} {format_seconds(value)}"
                 for name, value in self.breakdown().items() if value >= 0.005 * self.seconds]  # fmt: skip
        line = f"{format_seconds(self.seconds)} ({', '.join(parts)})"
        if self.tokens_per_second:
            line += f", {self.tokens_per_second:,.0f} tokens/s"
        if self.mfu is not None:
            line += f", MFU {self.mfu:.1%}, HFU {self.hfu:.1%}"
        return line


# --- Costing one kernel ----------------------------------------------------------------------------


def _dims(shape: str) -> list[int]:
    match = hlo._ARRAY.search(shape)
    return [int(d) for d in match.group(2).split(",") if d] if match else []


def _dtype(shape: str) -> str:
    match = hlo._ARRAY.search(shape)
    return match.group(1) if match else "f32"


def _attr_dims(attributes: str, key: str) -> list[int]:
    match = re.search(key + r"=\{([\d,]*)\}", attributes)
    return [int(d) for d in match.group(1).split(",") if d] if match else []


def _json_dims(attributes: str, key: str) -> list[int]:
    """A list of dimensions in a backend config (a cuBLAS call's ``"lhs_batch_dimensions":["0"]``)."""
    match = re.search(f'"{key}":\\[([^\\]]*)\\]', attributes)
    return [int(d) for d in re.findall(r"\d+", match.group(1))] if match else []


@functools.lru_cache(maxsize=1024)
def _valid_taps(
    n_in: int, n_out: int, window: int, stride: int, pad: int, lhs_dilate: int, rhs_dilate: int
) -> int:
    """The (output position, window tap) pairs of one spatial dimension whose input position is a real
    input element: inside the (dilated) input, not in its padding nor between dilated elements. Output
    ``o`` and tap ``w`` read position ``o * stride + w * rhs_dilate - pad``; counted per tap, in closed
    form."""
    last = (n_in - 1) * lhs_dilate
    g = math.gcd(stride, lhs_dilate)
    period = lhs_dilate // g
    inverse = pow(stride // g, -1, period) if period > 1 else 0
    pairs = 0
    for w in range(window):
        offset = w * rhs_dilate - pad
        first = max(0, -(offset // stride))  # ceil(-offset / stride)
        final = min(n_out - 1, (last - offset) // stride)
        if final < first or (-offset) % g:
            continue
        o0 = ((-offset) // g * inverse) % period if period > 1 else 0  # o * stride = -offset (mod dilate)
        pairs += (final - o0) // period - (first - 1 - o0) // period
    return pairs


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One matrix multiplication as a GPU library tiles it: ``batch`` independent products of an
    ``m`` x ``k`` and a ``k`` x ``n`` matrix (HLO's batch, free and contracting dimensions, each group
    flattened)."""

    batch: int
    m: int
    n: int
    k: int

    @classmethod
    def of(cls, lhs: Sequence[int], rhs: Sequence[int], lhs_batch: Sequence[int],
           lhs_contracting: Sequence[int], rhs_batch: Sequence[int],
           rhs_contracting: Sequence[int]) -> Gemm | None:  # fmt: skip
        """The GEMM of a dot of operands shaped ``lhs`` and ``rhs`` with these dimension numbers; None
        when they do not index the shapes."""
        if any(d >= len(lhs) for d in (*lhs_batch, *lhs_contracting)) or any(
            d >= len(rhs) for d in (*rhs_batch, *rhs_contracting)
        ):
            return None
        batch = math.prod(lhs[d] for d in lhs_batch)
        k = math.prod(lhs[d] for d in lhs_contracting)
        if not batch or not k or math.prod(rhs[d] for d in (*rhs_batch, *rhs_contracting)) != batch * k:
            return None
        return cls(batch, math.prod(lhs) // (batch * k), math.prod(rhs) // (batch * k), k)


@functools.lru_cache(maxsize=4096)  # Every layer of a model runs the same few GEMMs.
def gemm_seconds(gemm: Gemm, bytes_moved: float, rate: float, bandwidth: float, sms: int) -> float:
    """Seconds of one GEMM on a GPU of ``sms`` SMs that multiply at ``rate`` FLOP/s in all (the achievable
    rate of a large GEMM) and stream ``bandwidth`` bytes/s, moving ``bytes_moved`` (operands and result):
    the best over the tile catalogue (:data:`GEMM_TILES`) and split-K (:data:`SPLIT_K`).

    Each output tile of each K slice is one thread block and every block does a whole tile's work (a
    tile over the matrix's edge computes padding). Blocks spread evenly over the SMs, each SM at
    ``rate / sms``, so the GEMM lasts as long as its busiest SM: ``ceil(blocks / sms)`` blocks (whole
    waves). Split K runs more, shorter blocks and pays for them in memory: each slice writes an f32
    partial of the output and a second kernel reads them back. A GEMM of few rows (a short prompt's
    prefill) has few tiles for the SMs, so it reaches less than ``rate`` even when it is compute-bound:
    at M=128 rows, an A100's 108 SMs run 64 tiles of 128 x 128 for N=8192 in one wave with 44 SMs idle.
    The memory side stays a roofline: bytes at ``bandwidth``."""
    best = math.inf
    for (rows, columns), split in ((tile, split) for tile in GEMM_TILES for split in SPLIT_K):
        slice_k = -(-gemm.k // split)
        blocks = gemm.batch * -(-gemm.m // rows) * -(-gemm.n // columns) * split
        compute = -(-blocks // sms) * 2.0 * rows * columns * slice_k / (rate / sms)
        partials = 2 * 4 * split * gemm.batch * gemm.m * gemm.n if split > 1 else 0
        seconds = max(compute, (bytes_moved + partials) / bandwidth) + (KERNEL_GAP if split > 1 else 0.0)
        best = min(best, seconds)
    return best


class _Kernels:
    """Costs the kernels of one module on one piece of hardware (each distinct kernel once)."""

    def __init__(self, module: hlo.HloModule, hardware: Hardware, attention: Mapping[str, hlo.FusedKernel]):
        self.module, self.hardware, self.attention = module, hardware, attention
        self.users: dict[str, dict[str, list[hlo.Instruction]]] = {}

    def shape(self, name: str) -> str:
        ins = self.module.by_name.get(name)
        return ins.shape if ins else ""

    def dot_flops(self, ins: hlo.Instruction) -> tuple[float, str]:
        lhs = self.shape(ins.operands[0]) if ins.operands else ""
        contracting = _attr_dims(ins.attributes, "lhs_contracting_dims")
        k = math.prod(_dims(lhs)[d] for d in contracting if d < len(_dims(lhs)))
        return 2.0 * math.prod(_dims(ins.shape)) * k, _dtype(lhs)

    def conv_flops(self, ins: hlo.Instruction) -> tuple[float, str]:
        """FLOPs of a convolution: each output element sums the kernel's input features over the window
        taps that land on real input, not on padding or between dilated inputs. XLA's TPU compiler writes
        dot products as such convolutions (a head dimension as a padded window, a batch as a dilation), so
        counting every tap overstates them by the window size."""
        labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attributes)
        if not labels or len(ins.operands) < 2:
            return 0.0, _dtype(ins.shape)
        lhs_labels, rhs_labels, out_labels = labels.groups()
        lhs, rhs = _dims(self.shape(ins.operands[0])), _dims(self.shape(ins.operands[1]))
        out = _dims(ins.shape)
        if "i" not in rhs_labels or len(rhs) != len(rhs_labels) or len(out) != len(out_labels):
            return 0.0, _dtype(ins.shape)
        window = re.search(r"window=\{([^}]*)\}", ins.attributes)
        fields = dict(f.split("=", 1) for f in window.group(1).split()) if window else {}
        spatial = [c for c in out_labels if c.isdigit()]

        def per_dim(key: str, default: int) -> list[int]:
            values = fields.get(key)
            return [int(v) for v in values.split("x")] if values else [default] * len(spatial)

        size, stride = per_dim("size", 1), per_dim("stride", 1)
        lhs_dilate, rhs_dilate = per_dim("lhs_dilate", 1), per_dim("rhs_dilate", 1)
        pads = [int(p.split("_")[0]) for p in fields.get("pad", "").split("x") if p] or [0] * len(size)
        taps = 1.0  # Valid (output position, window tap) pairs per output position, over the spatial dims.
        for k, label in enumerate(sorted(spatial)):
            n_in, n_out = lhs[lhs_labels.index(label)], out[out_labels.index(label)]
            pairs = _valid_taps(n_in, n_out, size[k], stride[k], pads[k], lhs_dilate[k], rhs_dilate[k])
            taps *= pairs / max(n_out, 1)
        features = rhs[rhs_labels.index("i")]
        return 2.0 * math.prod(out) * features * taps, _dtype(self.shape(ins.operands[0]))

    def flops(self, ins: hlo.Instruction) -> tuple[float, str, bool]:
        """(FLOPs, operand dtype, whether a fused-attention kernel) of one kernel."""
        if ins.opcode == "dot":
            return (*self.dot_flops(ins), False)
        if ins.opcode == "convolution":
            return (*self.conv_flops(ins), False)
        if ins.opcode == "custom-call":
            return self.custom_call_flops(ins)
        if ins.opcode in ("fusion", "fusion-start") and ins.called:
            total, dtype = 0.0, "bf16"
            for inner in self.module.computations.get(ins.called[0], ()):
                if inner.opcode in ("dot", "convolution", "custom-call"):
                    flops, dtype, _ = self.flops(inner)
                    total += flops
            return total, dtype, False
        return 0.0, "f32", False

    def custom_call_flops(self, ins: hlo.Instruction) -> tuple[float, str, bool]:
        target = re.search(r'custom_call_target="([^"]*)"', ins.attributes)
        target = target.group(1) if target else ""
        if target.startswith("__cublas"):
            lhs = self.shape(ins.operands[0]) if ins.operands else ""
            dims = _json_dims(ins.attributes, "lhs_contracting_dimensions")
            out = ins.shape if not ins.shape.startswith("(") else hlo._tuple_element(ins.shape, "0")
            k = math.prod(_dims(lhs)[d] for d in dims if d < len(_dims(lhs)))
            return 2.0 * math.prod(_dims(out)) * k, _dtype(lhs), False
        kernel = self.attention_kernel(ins, target)
        if kernel is None or len(ins.operands) < 2:
            return 0.0, "f32", False
        matmuls, causal = kernel.matmuls, kernel.causal
        q, k = _dims(self.shape(ins.operands[0])), _dims(self.shape(ins.operands[1]))
        if kernel.decode and len(q) == 4 and len(k) == 5:  # [B, G, R, K] against [layers, B, T, G, K].
            return hlo.decode_flops(kernel, q, k), _dtype(self.shape(ins.operands[0])), True
        if len(q) != 4 or len(k) != 4:
            return 0.0, "f32", False
        pairs = q[0] * q[2] * q[1] * k[1] * q[3]  # [batch, length, heads, head_dim]
        return matmuls * 2.0 * pairs * (0.5 if causal else 1.0), _dtype(self.shape(ins.operands[0])), True

    def attention_kernel(self, ins: hlo.Instruction, target: str) -> hlo.FusedKernel | None:
        if target.startswith("__cudnn$fmha"):
            causal = "CAUSAL" in ins.attributes
            return hlo.FusedKernel(5 if "Backward" in target else 2, causal)
        return hlo.attention_kernel(ins.op_name, self.attention)

    def decode_attention_bytes(self, ins: hlo.Instruction) -> int | None:
        """Bytes the decode kernel moves (:mod:`shardmem.models.decode_attention`), or None for any other
        custom call: its operands but the stacked keys and values (and an int8 cache's scales), of which
        it reads one layer's, each sequence's positions up to the whole cache (the compiled step's
        context) or its window; and its outputs, the parts' partial results."""
        if ins.opcode != "custom-call" or len(ins.operands) < 3:
            return None
        kernel = hlo.attention_kernel(ins.op_name, self.attention)
        keys = _dims(self.shape(ins.operands[1]))
        if kernel is None or not kernel.decode or len(keys) != 5:
            return None
        _, batch, max_len, kv_heads, head_dim = keys
        read = batch * hlo.decode_positions(kernel, max_len) * kv_heads * head_dim
        stacked = [o for o in ins.operands[1:] if _dims(self.shape(o))[:4] == keys[:4]]  # By layer.
        layer = sum(read * hlo.shape_bytes(self.shape(o)) // math.prod(keys) for o in stacked)
        others = [o for o in ins.operands if o not in stacked]
        return hlo.shape_bytes(ins.shape) + layer + sum(hlo.shape_bytes(self.shape(o)) for o in others)

    def bytes(self, ins: hlo.Instruction) -> int:
        """Bytes a kernel reads and writes in HBM: a fusion reads only the slices it takes of an operand
        and writes only the update of an in-place dynamic-update-slice (a scan's stacked residuals)."""
        if ins.opcode in ("fusion", "fusion-start") and ins.called:
            return self._fusion_bytes(ins)
        if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
            return 2 * hlo.shape_bytes(self.shape(ins.operands[1]))
        if ins.opcode == "scatter" and len(ins.operands) > 2:  # In place: the updates and their indices.
            indices, updates = (hlo.shape_bytes(self.shape(o)) for o in ins.operands[1:3])
            return 2 * updates + indices
        if ins.opcode in ("dynamic-slice", "slice", "gather"):
            return 2 * hlo.shape_bytes(ins.shape)
        decode = self.decode_attention_bytes(ins)
        if decode is not None:
            return decode
        return hlo.shape_bytes(ins.shape) + sum(hlo.shape_bytes(self.shape(o)) for o in ins.operands)

    def _fusion_bytes(self, ins: hlo.Instruction) -> int:
        computation = ins.called[0]
        inner = self.module.computations.get(computation, ())
        users = self.users.get(computation)
        if users is None:
            users = {}
            for i in inner:
                for operand in i.operands:
                    users.setdefault(operand, []).append(i)
            self.users[computation] = users
        total = 0
        for i in inner:
            if i.opcode != "parameter":
                continue
            index = int(i.arguments) if i.arguments.strip().isdigit() else -1
            full = hlo.shape_bytes(self.shape(ins.operands[index])) if 0 <= index < len(ins.operands) else 0
            total += min(full, self._read_bytes(i, users, full))
        root = inner[-1] if inner else None
        outputs = [root] if root is not None and root.opcode != "tuple" else [
            self.module.by_name.get(o) for o in (root.operands if root is not None else ())]  # fmt: skip
        for out in outputs:
            if out is None:
                continue
            if out.opcode == "dynamic-update-slice" and len(out.operands) > 1:
                total += hlo.shape_bytes(self.shape(out.operands[1]))
            elif out.opcode == "scatter" and len(out.operands) > 2:  # A KV cache's decode-step write.
                total += hlo.shape_bytes(self.shape(out.operands[2]))
            else:
                total += hlo.shape_bytes(out.shape)
        return total

    def _read_bytes(self, param: hlo.Instruction, users, full: int) -> int:
        reads, stack = 0, [param]
        while stack:
            value = stack.pop()
            for user in users.get(value.name, ()):
                if user.opcode == "bitcast":
                    stack.append(user)
                elif user.opcode in ("dynamic-slice", "slice", "gather") and user.operands[0] == value.name:
                    reads += hlo.shape_bytes(user.shape)
                elif user.opcode in ("dynamic-update-slice", "scatter") and user.operands[0] == value.name:
                    continue  # Updated in place: only the update is written.
                else:
                    return full
        return reads

    def seconds(self, ins: hlo.Instruction) -> tuple[float, str, float]:
        """(seconds, "compute" or "memory_bound", FLOPs) of one kernel, by the roofline; on a GPU a GEMM by
        the waves of its tiles over the SMs (:func:`gemm_seconds`)."""
        flops, dtype, attention = self.flops(ins)
        memory = self.bytes(ins) / (self.hardware.memory_bandwidth * MEMORY_EFFICIENCY)
        if not flops:
            return memory, "memory_bound", 0.0
        if attention:
            return max(flops / (self.hardware.peak(dtype) * ATTENTION_EFFICIENCY), memory), "compute", flops
        gemm = self.gemm(ins) if self.hardware.sms else None
        if gemm is not None:
            rate = self.hardware.peak(dtype) * MATMUL_EFFICIENCY
            bandwidth = self.hardware.memory_bandwidth * MEMORY_EFFICIENCY
            return gemm_seconds(gemm, self.bytes(ins), rate, bandwidth, self.hardware.sms), "compute", flops
        return max(flops / (self.hardware.peak(dtype) * MATMUL_EFFICIENCY), memory), "compute", flops

    def gemm(self, ins: hlo.Instruction) -> Gemm | None:
        """The GEMM a kernel runs: a dot, a cuBLAS call, or a fusion around one dot (XLA's Triton GEMMs);
        None for anything else (convolutions, fusions of several dots), which the roofline costs."""
        if ins.opcode in ("fusion", "fusion-start") and ins.called:
            inner = self.module.computations.get(ins.called[0], ())
            dots = [i for i in inner if i.opcode in ("dot", "custom-call", "convolution")]
            return self.gemm(dots[0]) if len(dots) == 1 else None
        if len(ins.operands) < 2:
            return None
        lhs, rhs = (_dims(self.shape(o)) for o in ins.operands[:2])
        if ins.opcode == "dot":
            numbers = [_attr_dims(ins.attributes, f"{side}_{kind}_dims")
                       for side in ("lhs", "rhs") for kind in ("batch", "contracting")]  # fmt: skip
        elif ins.opcode == "custom-call" and '"__cublas' in ins.attributes:
            numbers = [_json_dims(ins.attributes, f"{side}_{kind}_dimensions")
                       for side in ("lhs", "rhs") for kind in ("batch", "contracting")]  # fmt: skip
        else:
            return None
        lhs_batch, lhs_contracting, rhs_batch, rhs_contracting = numbers
        return Gemm.of(lhs, rhs, lhs_batch, lhs_contracting, rhs_batch, rhs_contracting)


# --- Collectives -----------------------------------------------------------------------------------


class UnreadGroups(ValueError):
    """A collective's device groups are written in a form :func:`replica_groups` cannot read."""


#: ``[4,2]<=[2,4]T(1,0)``: an iota tile (XLA's ``IotaReplicaGroupList``/``TileAssignment``).
_IOTA = r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?"
#: ``mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}`` or ``mesh[a=4,b=2] {a:(1)2}`` (Shardy's
#: ``MeshAxesReplicaGroupList``: axis names quoted in XLA 0.10-0.12, bare in later XLA; the device ids
#: as an iota tile or a list, absent when they are 0..n-1; a sub-axis ``a:(pre)size``).
_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[\d,]+)\))?\s*\{([^}]*)\}"
)
_MESH_AXIS = re.compile(r"'?([\w.\-]+)'?=(\d+)")
_GROUP_AXIS = re.compile(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?")


def _iota(shape: str, dims: str, perm: str | None) -> np.ndarray:
    ids = np.arange(math.prod(int(d) for d in dims.split(","))).reshape([int(d) for d in dims.split(",")])
    if perm:
        ids = ids.transpose([int(d) for d in perm.split(",")])
    return ids.reshape([int(d) for d in shape.split(",")])


def _mesh_groups(mesh: str, device_ids: str | None, axes: str) -> list[list[int]]:
    """The groups of a mesh form: the mesh's device array, with the named (sub-)axes varying in a group.
    A sub-axis ``a:(pre)size`` splits axis ``a`` into [pre, size, rest] and varies the middle, as XLA's
    ``MeshAxesReplicaGroupList::flattened_replica_groups`` does."""
    named = _MESH_AXIS.findall(mesh)
    names, sizes = [a for a, _ in named], [int(s) for _, s in named]
    total = math.prod(sizes)
    if not device_ids:
        devices = np.arange(total)
    elif iota := re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", device_ids):
        devices = _iota(",".join(map(str, sizes)), iota.group(1), iota.group(2))
    else:
        devices = np.array([int(d) for d in device_ids.split(",")])
    if devices.size != total:
        raise UnreadGroups(f"device_ids=({device_ids}) do not fill mesh[{mesh}]")
    chosen = [(a, (int(pre), int(size)) if pre else None) for a, pre, size in _GROUP_AXIS.findall(axes) if a]
    pieces, index = [], {}  # The mesh's axes split at the sub-axes; (axis, sub-axis) -> its piece.
    for name, size in zip(names, sizes, strict=True):
        if (name, None) in chosen:
            index[(name, None)] = len(pieces)
            pieces.append(size)
            continue
        covered = 1
        for pre, sub in sorted(s for a, s in chosen if a == name):
            if pre > covered:
                pieces.append(pre // covered)
                covered = pre
            index[(name, (pre, sub))] = len(pieces)
            pieces.append(sub)
            covered *= sub
        if covered < size:
            pieces.append(size // covered)
    missing = [a for a in chosen if a not in index]
    if missing or math.prod(pieces) != total:
        raise UnreadGroups(f"group axes {{{axes}}} do not fit mesh[{mesh}]")
    varying = [index[a] for a in chosen]
    rest = [i for i in range(len(pieces)) if i not in varying]
    group_size = math.prod(pieces[i] for i in varying)
    return devices.reshape(pieces).transpose(rest + varying).reshape(-1, group_size).tolist()


def replica_groups(ins: hlo.Instruction, devices: int) -> list[list[int]]:
    """The device groups of a collective, from every form XLA 0.10-0.12 writes: ``{{0,1},{2,3}}``, the iota
    form ``[2,2]<=[4]`` (with ``T(...)`` transposes), the mesh form ``mesh['a'=2,'b'=2] {'a'}`` (with
    ``device_ids=(...)`` and sub-axes), and a collective-permute's ``source_target_pairs`` (one group per
    pair). No ``replica_groups`` at all, or ``{}``, is XLA's "every device": one group of all ``devices``.
    Raises :class:`UnreadGroups` for any other form rather than guess."""
    text = ins.attributes
    pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", text)
    if pairs:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
    if "replica_groups=" not in text:
        return [list(range(devices))]
    iota = re.search("replica_groups=" + _IOTA, text)
    if iota:
        return _iota(iota.group(1), iota.group(2), iota.group(3)).tolist()
    mesh = _MESH.search(text)
    if mesh:
        return _mesh_groups(*mesh.groups())
    maximal = re.search(r"replica_groups=maximal_mesh\[device_id=(\d+)\]", text)
    if maximal:
        return [[int(maximal.group(1))]]
    explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}(?=[,\s]|$)", text)
    if explicit:
        groups = [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))]
        return groups or [list(range(devices))]
    shown = re.search(r"replica_groups=(\S{0,80})", text)
    raise UnreadGroups(f"cannot read the device groups of {ins.name}: replica_groups={shown.group(1)}")


def _collective_cost(ins, kind: str, hardware: Hardware, hosts_of: Sequence[int],
                     unread: list[str]) -> tuple[float, CollectiveCost]:  # fmt: skip
    """The seconds of one collective and its cost entry. Groups it cannot read are costed as one group of
    every device, and its name is appended to ``unread`` (the step time says so: never silently)."""
    moved = hlo.collective_result_bytes(ins)
    if hlo.is_megascale(ins):
        # Between TPU slices: each chip exchanges its data with its peers in the other slices, over DCN.
        n, link = len(set(hosts_of)), "network"
        if kind == "all-gather":
            moved *= n  # It sends its piece; the ring's factor is of the gathered result.
    else:
        try:
            groups = replica_groups(ins, len(hosts_of))
        except UnreadGroups:
            unread.append(ins.name)
            groups = [list(range(len(hosts_of)))]
        n = max(len(g) for g in groups) if groups else 1
        spans = any(len({hosts_of[d] for d in g if d < len(hosts_of)}) > 1 for g in groups)
        link = "network" if spans else "nvlink"
        if kind == "reduce-scatter":
            moved *= n  # The ring moves (n-1)/n of the operand, n times the result.
        if hardware.cluster is not None and groups:
            # Every group runs at once; the slowest (the one over most nodes) sets the time.
            widest = max((Group.of([d for d in g if d < len(hosts_of)], hosts_of) for g in groups),
                         key=lambda group: (group.nodes, group.gpus))  # fmt: skip
            if kind == "collective-permute":
                widest = Group(2, 2 if spans else 1, 1 if spans else 2)
            seconds, algorithm = collective_seconds(kind, moved, widest, hardware.cluster)
            cost = CollectiveCost(kind, n, link, 1, hlo.collective_result_bytes(ins), seconds, algorithm)
            return seconds, cost
    if n <= 1 and kind != "collective-permute":
        return 0.0, CollectiveCost(kind, n, link, 1, moved, 0.0)
    seconds = COLLECTIVE_LATENCY[link] + _ALGORITHM[kind](n) * moved / hardware.link(link)
    return seconds, CollectiveCost(kind, n, link, 1, hlo.collective_result_bytes(ins), seconds)


#: Host memory in a layout: ``{1,0:S(5)}`` on GPUs, after the tiles on TPUs (``{1,0:T(8,128)S(5)}``).
_HOST_SPACE = re.compile(r"[:)]S\(5\)")


def _host_copy(ins: hlo.Instruction, module: hlo.HloModule) -> int | None:
    """Bytes an asynchronous copy moves between device and host memory (layout memory space S(5)), or
    None when it is not one."""
    touched = [ins.shape] + [module.by_name[o].shape for o in ins.operands if o in module.by_name]
    for name in ins.called:
        touched += [i.shape for i in module.computations.get(name, ())]
    if not any(_HOST_SPACE.search(shape) for shape in touched):
        return None
    for name in ins.called:
        inner = module.computations.get(name, ())
        if inner and inner[-1].opcode == "dynamic-update-slice" and len(inner[-1].operands) > 1:
            update = module.by_name.get(inner[-1].operands[1])
            return hlo.shape_bytes(update.shape) if update else 0
        if inner and inner[-1].opcode in ("dynamic-slice", "slice"):
            return hlo.shape_bytes(inner[-1].shape)
    shape = ins.shape
    if ins.opcode.endswith("-start") and shape.startswith("("):
        shape = hlo._tuple_element(shape, "1")
    return hlo.shape_bytes(shape)


# --- Replaying the schedule ------------------------------------------------------------------------


@dataclasses.dataclass
class _Totals:
    seconds: float = 0.0
    compute: float = 0.0
    memory_bound: float = 0.0
    launch: float = 0.0
    communication: float = 0.0
    exposed_communication: float = 0.0
    host_transfers: float = 0.0
    exposed_host_transfers: float = 0.0
    host_bytes: float = 0.0
    kernels: int = 0
    flops: float = 0.0

    def add(self, other: _Totals, times: float = 1.0) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + times * getattr(other, field.name))


class _Replay:
    def __init__(self, module, hardware, hosts_of, attention, tick_ops=()):
        self.module, self.hardware, self.hosts_of = module, hardware, hosts_of
        self.kernels = _Kernels(module, hardware, attention)
        self.memo: dict[str, _Totals] = {}
        self.collectives: dict[tuple[str, int, str, str], list] = {}
        self.unread: list[str] = []  # Collectives whose device groups were in a form not read.
        self.loops: list[tuple[str, int, _Totals]] = []
        self.multiplier = 1
        self.tick_ops = tick_ops  # The ops some stage runs at each 1F1B tick (estimate_step_time).
        # Per computation, its groups of alternatives in order: (the op charged, {op: its tally}).
        self.one_of: dict[str, list[tuple[int, dict[int, tuple[_Totals, dict]]]]] = {}

    def computation(self, name: str) -> _Totals:
        if name in self.memo:
            return self.memo[name]
        totals = _Totals()
        clock, streams = 0.0, {"comm": 0.0, "host": 0.0}
        pending: dict[str, tuple[str, float]] = {}  # start -> (stream, finish time)
        instructions = self.module.computations.get(name, ())
        one_of = hlo.one_of_groups(instructions)  # Loops of which a device runs one: charged as a group.
        grouped = {loop.name for loops in one_of.values() for loop in loops}
        for ins in instructions:
            op = ins.opcode
            if ins.name in grouped:
                if ins.name in one_of:
                    loops = one_of[ins.name]
                    inner, charged, tallies = self._slowest([(loop, loop.called) for loop in loops], True)
                    ops = [hlo.one_of_index(loop) for loop in loops]
                    by_op = dict(zip(ops, tallies, strict=True))
                    self.one_of.setdefault(name, []).append((ops[charged], by_op))
                    totals.add(inner)
                    clock += inner.seconds
                continue
            if op in _FREE or (
                op == "custom-call" and any(f'"{t}"' in ins.attributes for t in _FREE_CUSTOM_CALLS)
            ):
                continue
            if op.endswith("-done"):
                stream, finish = pending.pop(ins.operands[0] if ins.operands else "", ("", clock))
                if finish > clock:
                    key = "exposed_communication" if stream == "comm" else "exposed_host_transfers"
                    setattr(totals, key, getattr(totals, key) + finish - clock)
                    clock = finish
                continue
            kind = hlo.collective_kind(ins) or self._wrapped_collective(ins)
            if kind:
                seconds = self._collective(ins, kind)
                totals.communication += seconds
                start = max(clock, streams["comm"])
                streams["comm"] = start + seconds
                if op.endswith("-start") or op == "send":  # A MegaScale send ends at its send-done.
                    pending[ins.name] = ("comm", streams["comm"])
                else:  # Synchronous: the compute stream waits for it.
                    totals.exposed_communication += streams["comm"] - clock
                    clock = streams["comm"]
                continue
            host = _host_copy(ins, self.module) if op.endswith("-start") or op == "copy" else None
            if host is not None:
                seconds = host / self.hardware.link("host")
                totals.host_transfers += seconds
                totals.host_bytes += host
                start = max(clock, streams["host"])
                streams["host"] = start + seconds
                if op.endswith("-start"):
                    pending[ins.name] = ("host", streams["host"])
                else:
                    totals.exposed_host_transfers += streams["host"] - clock
                    clock = streams["host"]
                continue
            if op in ("while", "call", "conditional", "async-start"):
                inner = self._control(ins)
                totals.add(inner)
                clock += inner.seconds
                if op == "async-start":
                    pending[ins.name] = ("compute", clock)
                continue
            seconds, category, flops = self.kernels.seconds(ins)
            setattr(totals, category, getattr(totals, category) + seconds)
            totals.flops += flops
            totals.launch += KERNEL_GAP
            totals.kernels += 1
            clock += seconds + KERNEL_GAP
        for stream, finish in pending.values():  # Still in flight at the end: the step waits.
            if finish > clock:
                key = "exposed_communication" if stream == "comm" else "exposed_host_transfers"
                setattr(totals, key, getattr(totals, key) + finish - clock)
                clock = finish
        totals.seconds = clock
        self.memo[name] = totals
        return totals

    def _control(self, ins: hlo.Instruction) -> _Totals:
        totals = _Totals()
        if ins.opcode == "while":
            trips = ins.trip_count or 1
            body = re.search(r"body=%?([\w.\-]+)", ins.attributes)
            condition = re.search(r"condition=%?([\w.\-]+)", ins.attributes)
            saved, self.multiplier = self.multiplier, self.multiplier * trips
            if body:
                per_trip = self.computation(body.group(1))
                totals.add(per_trip, trips)
                if self.tick_ops and body.group(1) in self.one_of:
                    totals.add(self._by_tick(self.one_of[body.group(1)], trips))
                self.loops.append(
                    (hlo.readable_scope(ins.op_name) if ins.op_name else ins.name, trips, per_trip)
                )
            if condition:
                totals.add(self.computation(condition.group(1)), trips + 1)
            self.multiplier = saved
        elif ins.opcode == "conditional":
            totals.add(self._slowest([(ins, (name,)) for name in ins.called]))
        else:
            for name in ins.called:
                totals.add(self.computation(name))
        return totals

    def _slowest(self, alternatives: Sequence[tuple[hlo.Instruction, Sequence[str]]], tallied=False):
        """Of alternatives a device runs one of (a conditional's branches; a 1F1B tick's ops, each a
        loop run once or never: ``(instruction, the computations it runs)``), the slowest's totals; the
        collectives are counted as that one's alone. ``tallied``: also which one, and each one's totals
        and collectives (their counts per run: :meth:`_by_tick`)."""
        before, tallies = self.collectives, []
        for ins, names in alternatives:
            self.collectives = {key: list(entry) for key, entry in before.items()}
            totals = _Totals()
            if ins.opcode == "while":  # Run once: its body and its condition twice.
                totals.add(self._control(ins))
            else:
                for name in names:
                    totals.add(self.computation(name))
            added = {key: [(entry[i] - before.get(key, (0, 0, 0.0))[i]) / self.multiplier for i in range(3)]
                     for key, entry in self.collectives.items()}  # fmt: skip
            tallies.append((totals, self.collectives, added))
        self.collectives = before
        if not tallies:
            return (_Totals(), -1, []) if tallied else _Totals()
        charged = max(range(len(tallies)), key=lambda i: tallies[i][0].seconds)
        slowest, self.collectives, _ = tallies[charged]
        return (slowest, charged, [(t, added) for t, _, added in tallies]) if tallied else slowest

    def _by_tick(self, groups, trips: int) -> _Totals:
        """The correction to a loop of 1F1B ticks charged its slowest op every tick (:meth:`_slowest`):
        each tick is as long as the slowest op some stage runs at it (``tick_ops``), its collectives
        that op's. ``groups``: the loop body's groups of ops, one per tick it runs (XLA may unroll it)."""
        correction = _Totals()
        peeled = len(self.tick_ops) - trips * len(groups)  # Ticks XLA ran before the loop it unrolled.
        if not 0 <= peeled < len(groups):
            return correction  # Not the table's loop.
        once = self.multiplier / trips  # Each tick runs once per run of the loop.
        for tick, ops in enumerate(self.tick_ops[peeled:]):
            charged, tallies = groups[tick % len(groups)]
            ran = [tallies[op] for op in ops if op in tallies]
            chosen = max(ran, key=lambda tally: tally[0].seconds) if ran else (_Totals(), {})
            for (totals, added), sign in ((chosen, 1), (tallies[charged], -1)):
                correction.add(totals, sign)
                for key, counts in added.items():
                    entry = self.collectives.setdefault(key, [0, 0, 0.0])
                    for i, value in enumerate(counts):
                        entry[i] += sign * value * once
        return correction

    def _wrapped_collective(self, ins: hlo.Instruction) -> str | None:
        if ins.opcode != "async-start":
            return None
        for name in ins.called:
            for inner in self.module.computations.get(name, ()):
                kind = hlo.collective_kind(inner)
                if kind:
                    return kind
        return None

    def _collective(self, ins: hlo.Instruction, kind: str) -> float:
        target = ins
        if ins.opcode == "async-start":  # The collective is the wrapped computation's.
            target = next(i for name in ins.called for i in self.module.computations.get(name, ())
                          if hlo.collective_kind(i))  # fmt: skip
        seconds, cost = _collective_cost(target, kind, self.hardware, self.hosts_of, self.unread)
        key = (kind, cost.group_size, cost.link, cost.algorithm)
        entry = self.collectives.setdefault(key, [0, 0, 0.0])
        entry[0] += self.multiplier
        entry[1] += cost.bytes * self.multiplier
        entry[2] += seconds * self.multiplier
        return seconds


def estimate_step_time(
    module: hlo.HloModule,
    hardware: Hardware,
    hosts_of: Sequence[int],
    *,
    attention: Mapping[str, hlo.FusedKernel] | None = None,
    bubble_fraction: float = 0.0,
    tokens_per_step: int | None = None,
    model_flops: float | None = None,
    hardware_flops: float | None = None,
    tick_ops: Sequence[frozenset[int]] = (),
) -> StepTime:
    """Predicts one step of an optimized, scheduled HLO module on ``hardware``.

    ``hosts_of[i]`` is the host of the program's device ``i`` (its partition id: the mesh's devices in
    order); ``attention`` maps fused-attention kernel names to their ``hlo.FusedKernel``, as
    :func:`shardmem.planning.hlo.fused_attention_kernels` reads them from the jaxpr; ``bubble_fraction``
    is the pipeline schedule's idle share of its loops of ticks. ``tick_ops``: for a 1F1B schedule, the
    ops some stage runs at each tick (the table's): each tick is as long as the slowest of those (a
    stage waits for its neighbours' hand-offs), where without it every tick is charged the slowest op
    of all, the last stage's head, say, that runs once a micro-batch."""
    replay = _Replay(module, hardware, hosts_of, attention or {}, tuple(tick_ops))
    totals = replay.computation(module.entry)
    bubble = 0.0
    if bubble_fraction:
        # The pipeline's ticks are its outermost loops (GPipe's forward and backward; 1F1B's one loop,
        # inside its shard_map), whose idle stages wait too: every schedule idles that share of them.
        ticks = {(scope, trips): trips * t.seconds for scope, trips, t in replay.loops
                 if re.fullmatch(r"(shard_map/)?pipeline[^/]*", scope)}  # fmt: skip
        bubble = bubble_fraction * (sum(ticks.values()) if ticks else totals.seconds)
    collectives = tuple(
        CollectiveCost(kind, size, link, round(count), round(moved), seconds, algorithm)
        for (kind, size, link, algorithm), (count, moved, seconds) in sorted(replay.collectives.items())
    )
    seen, loops = set(), []
    for scope, trips, per_trip in replay.loops:
        if (scope, trips) not in seen:
            seen.add((scope, trips))
            loops.append(LoopCost(scope, trips, per_trip.seconds, per_trip.exposed_communication))
    return StepTime(
        seconds=totals.seconds, compute=totals.compute, memory_bound=totals.memory_bound,
        launch=totals.launch, communication=totals.communication,
        exposed_communication=totals.exposed_communication, host_transfers=totals.host_transfers,
        exposed_host_transfers=totals.exposed_host_transfers, bubble=bubble,
        host_transfer_bytes=round(totals.host_bytes), kernels=round(totals.kernels),
        kernel_flops=totals.flops,
        collectives=collectives, loops=tuple(loops), hardware=hardware.name,
        tokens_per_step=tokens_per_step, model_flops=model_flops, hardware_flops=hardware_flops,
        devices=len(hosts_of), peak_flops=hardware.mfu_peak(), unread_groups=tuple(replay.unread),
        links=hardware.describe_links(len(set(hosts_of))),
    )  # fmt: skip
