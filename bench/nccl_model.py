"""The collective model's bus bandwidth against published nccl-tests figures (issue 29).

    python bench/nccl_model.py            # the curves and the checks, tables for BENCHMARKS.md

Each row is one nccl-tests run that someone published (the source is in the row): the cluster, the
collective, the message size and the bus bandwidth (or the time, for small messages) it measured. The
model (shardmem/planning/collectives.py) is built from the links' datasheet rates and NCCL's own latency
constants; its efficiencies were read off the large-message figures of four of these rows (cited where
they are defined), nothing was fitted to the rest. The curves below show how busbw grows with size.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shardmem.planning.collectives import Cluster, Group, bus_bandwidth, collective_seconds  # noqa: E402
from shardmem.planning.targets import GPU_TARGETS  # noqa: E402

DGX_H100 = Cluster.of(GPU_TARGETS["h100-sxm"])
DGX_A100 = Cluster.of(GPU_TARGETS["a100-80g"])
#: Four 200 Gb/s NICs per 8-GPU node (NVIDIA/nccl-tests#252: 95 GB/s busbw, "~24 GB/s per NIC").
FOUR_HDR = dataclasses.replace(DGX_H100, nics_per_node=4, nic_bandwidth=25e9)
#: 8 x A100 80GB with two 200 Gb/s NICs per node (NVIDIA/nccl#837).
TWO_HDR_A100 = dataclasses.replace(DGX_A100, nics_per_node=2)

#: (what, cluster, nodes, collective, size in bytes, published busbw GB/s or None, published us or None,
#: source). "used" marks the rows an efficiency constant was read from.
PUBLISHED = [
    ("8 x H100, NVLS", DGX_H100, 1, "all-reduce", 8 << 30, 476, None,
     "NVIDIA/nccl-tests#290 (NVIDIA: 'in the expected range'); used: NVLS_EFFICIENCY"),
    ("8 x A100, NVLink 3", DGX_A100, 1, "all-reduce", 8 << 30, 235, None,
     "NCCL tuning.cc caps sm80 at 235; NVIDIA/nccl#1712 'close to 240'; used: NVLINK_EFFICIENCY"),
    ("2 x 8 H100, 8 x NDR per node, ring", DGX_H100, 2, "all-reduce", 8 << 30, 8 * 47, None,
     "NVIDIA/nccl-tests#290: 46-48 GB/s per NDR NIC; used: NIC_EFFICIENCY"),
    ("2 x 8 GPUs, 4 x 200 Gb/s per node, ring", FOUR_HDR, 2, "all-reduce", 8 << 30, 95, None,
     "NVIDIA/nccl-tests#252 (NCCL_ALGO=RING, 8 GiB)"),
    ("2 x 8 A100, 2 x 200 Gb/s per node", TWO_HDR_A100, 2, "all-reduce", 1 << 30, 55, None,
     "NVIDIA/nccl#837 (54-57 GB/s, NCCL 2.9-2.10: a 2-node tree beats the network bound)"),
    ("248 x 8 H200, 8 x NDR per node", DGX_H100, 248, "all-reduce", 512 << 20, 350, None,
     "NVIDIA/nccl-tests#283 ('typically around 350', default algorithm, 512 MB)"),
    ("8 x H20 (NVLink 4, NVSwitch), 8 B", DGX_H100, 1, "all-reduce", 8, None, 12.5,
     "deepseek-ai/DeepEP#303 (nccl-tests all_reduce_perf)"),
    ("16 x 8 H100, 8 B", DGX_H100, 16, "all-reduce", 8, None, 62.0, "NVIDIA/nccl#1469 (NCCL 2.20.5)"),
    ("16 x 8 H100, 4 KiB", DGX_H100, 16, "all-reduce", 4096, None, 76.6, "NVIDIA/nccl#1469 (NCCL 2.20.5)"),
]  # fmt: skip

CURVES = [
    ("8 x H100 (1 node)", DGX_H100, 1),
    ("8 x 8 H100 (8 nodes)", DGX_H100, 8),
    ("8 x A100 (1 node)", DGX_A100, 1),
    ("8 x 8 A100 (8 nodes)", DGX_A100, 8),
]
SIZES = [8, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 128 << 20, 1 << 30, 8 << 30]


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n // scale} {unit}"
    return f"{n} B"


def main() -> None:
    print("### Checks against published nccl-tests runs\n")
    print("| run | collective, size | published | model | model / published | algorithm | source |")
    print("|---|---|---|---|---|---|---|")
    for what, cluster, nodes, kind, size, busbw, micros, source in PUBLISHED:
        group = Group(8 * nodes, nodes, 8)
        seconds, algorithm = collective_seconds(kind, size, group, cluster)
        if busbw is not None:
            model = bus_bandwidth(kind, size, group, cluster) / 1e9
            shown, published = f"{model:.0f} GB/s busbw", f"{busbw:.0f} GB/s busbw"
            ratio = model / busbw
        else:
            shown, published, ratio = f"{seconds * 1e6:.1f} us", f"{micros:.1f} us", seconds * 1e6 / micros
        cells = (what, f"{kind}, {_size(size)}", published, shown, f"{ratio:.2f}", algorithm, source)
        print("| " + " | ".join(cells) + " |")
    for kind in ("all-reduce", "all-gather"):
        print(f"\n### Model bus bandwidth (GB/s) of {kind} against size, DGX nodes\n")
        print("| size | " + " | ".join(name for name, _, _ in CURVES) + " |")
        print("|---|" + "---|" * len(CURVES))
        for size in SIZES:
            cells = []
            for _, cluster, nodes in CURVES:
                group = Group(8 * nodes, nodes, 8)
                _, algorithm = collective_seconds(kind, size, group, cluster)
                cells.append(f"{bus_bandwidth(kind, size, group, cluster) / 1e9:.1f} ({algorithm})")
            print(f"| {_size(size)} | " + " | ".join(cells) + " |")
    # The yardstick: one FSDP all-gather over 8 x 8 H100s, NCCL's rings against a ring that sends
    # every GPU's whole share through its own NIC.
    size, group = 8 << 30, Group(64, 8, 8)
    seconds, _ = collective_seconds("all-gather", size, group, DGX_H100)
    naive = 63 / 64 * size / (DGX_H100.nic_bandwidth * 0.94)
    print(f"\nall-gather of {_size(size)} over 8 x 8 H100: {seconds * 1e3:.1f} ms as NCCL runs it, "
          f"{naive * 1e3:.1f} ms through each GPU's own NIC ({seconds / naive:.3f} of it)")  # fmt: skip


if __name__ == "__main__":
    main()
