"""Collectives as NCCL runs them: the seconds of one all-reduce, all-gather, reduce-scatter, all-to-all or
collective-permute over a group of GPUs that may span nodes, on a cluster described as data.

    cluster = Cluster.of(GPU_TARGETS["h100-sxm"])          # DGX H100: 8 GPUs, 8 x 400 Gb/s NICs, NVLS
    seconds, algorithm = collective_seconds("all-gather", 1 << 30, Group(gpus=64, nodes=8), cluster)
    bus_bandwidth("all-reduce", 1 << 30, Group(8, 1), cluster)   # nccl-tests' busbw, bytes/s

``size`` is the message as nccl-tests counts it: an all-reduce's buffer, an all-gather's gathered
result, a reduce-scatter's input, an all-to-all's buffer per GPU, the bytes a permute sends.

How NCCL runs them (NVIDIA/nccl, ``src/graph/tuning.cc`` at 5067397, and its algorithms' docs):

- **Ring** (every kind): a ring per channel through the node's GPUs over NVLink and from node to node
  through one NIC per channel, rail-aligned, so every NIC of a node carries a share. An all-reduce moves
  2(n-1)/n of the buffer through each GPU (all-gather, reduce-scatter (n-1)/n), and the node's
  boundary carries that once per ring: its bus bandwidth is the lesser of a GPU's NVLink and the
  group's share of its node's NICs (``nics_per_node`` x rate x g / ``gpus_per_node`` for g GPUs of
  the group on the node; the node's other GPUs run their own groups' collectives at the same time).
- **Tree** (all-reduce across nodes): a chain inside the node and a double binary tree between nodes:
  about the ring's bandwidth (NCCL's 0.92) at a latency that grows with log2(nodes), not nodes.
- **NVLS** (all-reduce in one node, NVSwitch with NVLink SHARP: H100, H200, B200): the switch reduces,
  so each GPU sends and receives its buffer once; **NVLSTree** across nodes adds a tree over the NICs.
- **CollNet / IB SHARP** (``sharp``, all-reduce across nodes): the InfiniBand switches reduce, so a node
  sends and receives its buffer once instead of twice.
- Each algorithm runs in the protocol (LL, LL128, Simple) that is fastest for the size: time = NCCL's
  base latency + steps x its per-step latency (NVLink or network) + size / bandwidth, so small messages
  are latency-bound and the bus bandwidth grows with the size.

Bandwidths are the links' rates (datasheets) times the fraction NCCL reaches of them, from published
nccl-tests figures: see :data:`NVLINK_EFFICIENCY`, :data:`NIC_EFFICIENCY`, :data:`NVLS_EFFICIENCY`;
``bench/nccl_model.py`` prints the model beside them (BENCHMARKS.md, "Collective model").
"""

from __future__ import annotations

import dataclasses
import math

#: Fraction of a GPU's NVLink rate (each way) a ring reaches: 8 x A100 all-reduce busbw is 235 GB/s of
#: 300 (NCCL caps its own model there, tuning.cc; NVIDIA's "close to 240 GB/s", NVIDIA/nccl#1712), 8 x
#: H100 rings 350-380 of 450 (shared/reference/step-time-and-tpu.md).
NVLINK_EFFICIENCY = 0.80
#: Fraction of a NIC's line rate a ring reaches: "for NDR at 400 Gbps you should see 46-48 GB/s per NIC"
#: (NVIDIA, NVIDIA/nccl-tests#290); four 200 Gb/s NICs per node gave 95 GB/s busbw, 24 per NIC
#: (NVIDIA/nccl-tests#252).
NIC_EFFICIENCY = 0.94
#: NVLS all-reduce: each GPU sends and receives its buffer once and the NVSwitch reduces; 8 x H100 reach
#: 476 GB/s busbw (NVIDIA/nccl-tests#290), an algorithm bandwidth of 476 x 8/14 = 272 GB/s: 0.60 of the
#: 450 GB/s NVLink each way.
NVLS_EFFICIENCY = 0.60

_PROTOCOLS = ("LL", "LL128", "Simple")
# Microseconds, (LL, LL128, Simple), NCCL's tuning.cc defaults at 5067397.
_BASE = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4)}
_NVLINK_STEP = {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": 25.0, "collnet": 2.8}
_NET_STEP = {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "nvls": 18.0, "nvls_tree": 20.9,
             "collnet": 30.0}  # fmt: skip
#: The most bus bandwidth NCCL's LL protocol reaches, on 1, 2 and 4+ nodes (tuning.cc's llMaxBws, GB/s),
#: by the GPU's compute capability major (Ampere, Hopper, Blackwell).
LL_MAX_BANDWIDTH = {8: (87.7e9, 22.5e9, 19.0e9), 9: (141e9, 45e9, 35e9), 10: (282e9, 90e9, 70e9)}
# Bandwidth of a protocol against Simple's (tuning.cc: ring LL x0.5, LL128 x0.92; tree LL x1/3.8,
# LL128 x120/128; the tree's own x0.92 for all-reduce).
_PROTOCOL_BANDWIDTH = {"ring": (0.5, 0.92, 1.0), "tree": (0.92 / 3.8, 0.92 * 120 / 128, 0.92)}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """How a plan's GPUs are wired: per node ``gpus_per_node`` GPUs on NVLink/NVSwitch
    (``nvlink_bandwidth`` per GPU each way) and ``nics_per_node`` NICs of ``nic_bandwidth`` each way
    (bytes per second); ``nvls``: NVSwitch with NVLink SHARP; ``sharp``: InfiniBand switches that reduce
    (SHARP, NCCL's CollNet)."""

    gpus_per_node: int
    nics_per_node: int
    nic_bandwidth: float
    nvlink_bandwidth: float
    nvls: bool = False
    sharp: bool = False
    ll_max_bandwidth: tuple[float, float, float] = LL_MAX_BANDWIDTH[9]  # LL's cap on 1, 2, 4+ nodes.
    link: str = "NVLink"  # What joins the GPUs of a node, as the report names it (GpuSpec.gpu_link).

    @classmethod
    def of(cls, spec, gpus_per_node: int | None = None, **overrides) -> Cluster:
        """The cluster a :class:`~shardmem.planning.targets.GpuSpec`'s server makes, with ``gpus_per_node``
        of them per node (the server's own by default; its NICs scale with them) and any field given in
        ``overrides`` (None keeps the spec's)."""
        gpus = gpus_per_node or spec.gpus_per_node
        fields = {
            "gpus_per_node": gpus,
            "nics_per_node": max(1, round(spec.nics_per_node * gpus / spec.gpus_per_node)),
            "nic_bandwidth": spec.network_bandwidth,
            "nvlink_bandwidth": spec.nvlink_bandwidth,
            "nvls": spec.nvls,
            "sharp": spec.sharp,
            "ll_max_bandwidth": LL_MAX_BANDWIDTH.get(spec.compute_capability[0], LL_MAX_BANDWIDTH[9]),
            "link": spec.gpu_link,
        }
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)

    def describe(self, nodes: int) -> str:
        """One line for the report: "8 nodes x 8 GPUs; per node 8 x 400 Gb/s NICs; NVLink 450 GB/s ..."."""
        special = [name for name, on in (("NVLS", self.nvls), ("IB SHARP", self.sharp)) if on]
        return (f"{nodes} node{'s' * (nodes > 1)} x {self.gpus_per_node} GPUs; per node "
                f"{self.nics_per_node} x {_rate(self.nic_bandwidth)} NICs (rail-aligned rings, one channel "
                f"per NIC); {self.link} "
                f"{self.nvlink_bandwidth / 1e9:.0f} GB/s per GPU each way"
                + (f"; {' and '.join(special)}" if special else ""))  # fmt: skip


def _rate(bytes_per_second: float) -> str:
    bits = bytes_per_second * 8
    return f"{bits / 1e12:g} Tb/s" if bits >= 1e12 else f"{bits / 1e9:g} Gb/s"


@dataclasses.dataclass(frozen=True)
class Group:
    """A collective's GPUs: ``gpus`` of them on ``nodes`` nodes (at most ``gpus_per_node`` on one)."""

    gpus: int
    nodes: int = 1
    per_node: int | None = None  # GPUs of the group on its fullest node (gpus / nodes when even).

    @classmethod
    def of(cls, devices, hosts_of) -> Group:
        """The group of ``devices`` (partition ids) whose hosts ``hosts_of`` gives."""
        counts: dict[int, int] = {}
        for d in devices:
            counts[hosts_of[d]] = counts.get(hosts_of[d], 0) + 1
        return cls(len(devices), len(counts), max(counts.values())) if counts else cls(1)

    @property
    def gpus_on_a_node(self) -> int:
        return self.per_node or max(1, self.gpus // self.nodes)


def _busbw_factor(kind: str, n: int) -> float:
    return 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n


def _links(group: Group, cluster: Cluster) -> tuple[float, float]:
    """(NVLink, network) bandwidth a ring over ``group`` reaches, bytes/s: a GPU's NVLink, and the
    group's share of its node's NICs."""
    nvlink = cluster.nvlink_bandwidth * NVLINK_EFFICIENCY
    share = cluster.nics_per_node * group.gpus_on_a_node / cluster.gpus_per_node
    return nvlink, share * cluster.nic_bandwidth * NIC_EFFICIENCY


def ring_bandwidth(group: Group, cluster: Cluster) -> float:
    """The bus bandwidth a large ring collective over ``group`` reaches, bytes/s: the lesser of a GPU's
    NVLink and the group's share of its node's NICs (what a layout's estimate divides its bytes by)."""
    nvlink, network = _links(group, cluster)
    return min(nvlink if group.gpus_on_a_node > 1 else math.inf, network if group.nodes > 1 else math.inf)


def _candidates(kind: str, size: float, group: Group, cluster: Cluster):
    """(algorithm/protocol, seconds) of every way NCCL could run the collective."""
    n, nodes, g = group.gpus, group.nodes, group.gpus_on_a_node
    nvlink, network = _links(group, cluster)
    us = 1e-6
    ll_cap = cluster.ll_max_bandwidth[0 if nodes == 1 else 1 if nodes == 2 else 2]

    def capped(bandwidth: float, p: int) -> float:
        return min(bandwidth, ll_cap) if _PROTOCOLS[p] == "LL" else bandwidth

    if kind in ("all-reduce", "all-gather", "reduce-scatter"):
        ring = ring_bandwidth(group, cluster)
        steps = (2 if kind == "all-reduce" else 1) * (n - 1)
        inter = (2 if kind == "all-reduce" else 1) * (nodes - 1)
        for p, protocol in enumerate(_PROTOCOLS):
            latency = (
                _BASE["ring"][p] + (steps - inter) * _NVLINK_STEP["ring"][p] + inter * _NET_STEP["ring"][p]
            )
            bandwidth = capped(ring * _PROTOCOL_BANDWIDTH["ring"][p], p)
            yield f"ring/{protocol}", latency * us + _busbw_factor(kind, n) * size / bandwidth
    if kind != "all-reduce":
        return
    if nodes > 1:
        tree = min(nvlink if g > 1 else math.inf, network)
        for p, protocol in enumerate(_PROTOCOLS):
            hops = (g - 1) * _NVLINK_STEP["tree"][p] + math.log2(nodes) * _NET_STEP["tree"][p]
            latency = _BASE["tree"][p] + 2 * hops
            # A tree's node sends and receives the buffer twice (reduce up, broadcast down).
            yield (
                f"tree/{protocol}",
                latency * us + 2 * size / capped(tree * _PROTOCOL_BANDWIDTH["tree"][p], p),
            )
    nvls = cluster.nvlink_bandwidth * NVLS_EFFICIENCY if cluster.nvls and g > 1 else None
    if nvls and nodes == 1:
        yield "nvls/Simple", _NVLINK_STEP["nvls"] * us + size / nvls
    if nvls and nodes > 1:
        latency = _NVLINK_STEP["nvls"] + 2 * math.log2(nodes) * _NET_STEP["nvls_tree"]
        yield "nvls_tree/Simple", latency * us + size / min(nvls, network / 2)
    if cluster.sharp and nodes > 1:
        # The switches reduce: the node sends its buffer once and receives the sum once.
        inside = nvls or (nvlink / _busbw_factor(kind, g) if g > 1 else math.inf)
        latency = 2 * (g - 1) * _NVLINK_STEP["collnet"] + _NET_STEP["collnet"]
        yield "collnet/Simple", latency * us + size / min(inside, network)


def collective_seconds(kind: str, size: float, group: Group, cluster: Cluster) -> tuple[float, str]:
    """(seconds, "algorithm/protocol") of the fastest way NCCL runs one collective of ``size`` bytes
    (nccl-tests' count, see the module's docstring) over ``group`` on ``cluster``."""
    n, nodes = group.gpus, group.nodes
    if kind in ("all-reduce", "all-gather", "reduce-scatter") and n > 1:
        return min(((s, name) for name, s in _candidates(kind, size, group, cluster)), key=lambda c: c[0])
    nvlink, network = _links(group, cluster)
    latency = (_BASE["ring"][2] + (_NET_STEP["ring"][2] if nodes > 1 else _NVLINK_STEP["ring"][2])) * 1e-6
    if kind == "all-to-all" and n > 1:
        # Point to point: a GPU sends (g-1)/n of its buffer over NVLink and (n-g)/n through its node's NICs,
        # which its node's g GPUs of the group share.
        g = group.gpus_on_a_node
        inside = (g - 1) / n * size / nvlink
        across = g * (n - g) / n * size / network if nodes > 1 else 0.0
        return latency + max(inside, across), "p2p/Simple"
    if kind == "collective-permute":
        # Each GPU sends to one peer: over NVLink, or through its share of its node's NICs.
        per_gpu = cluster.nics_per_node / cluster.gpus_per_node * cluster.nic_bandwidth * NIC_EFFICIENCY
        return latency + size / (per_gpu if nodes > 1 else nvlink), "p2p/Simple"
    return 0.0, "none"


def bus_bandwidth(kind: str, size: float, group: Group, cluster: Cluster) -> float:
    """nccl-tests' bus bandwidth of the model's collective, bytes/s: size / seconds x its bus factor
    (2(n-1)/n for an all-reduce, (n-1)/n for the others)."""
    seconds, _ = collective_seconds(kind, size, group, cluster)
    return size / seconds * _busbw_factor(kind, group.gpus) if seconds else 0.0
