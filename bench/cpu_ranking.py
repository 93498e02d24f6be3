"""Does the step-time model rank CPU layouts as measured steps do? (issue 19)

    python bench/cpu_ranking.py                 # 8 layouts of a small Llama on 8 simulated CPU devices
    python bench/cpu_ranking.py --steps 5

Each layout is planned for the `cpu` target (the step-time model with this machine's measured matmul
rate and copy bandwidth, shared by the simulated devices) and then runs real steps in a fresh process
(`shardmem sweep --measure`'s machinery). The absolute times are not comparable to a GPU's; the ranking
is what `tune --search layout` relies on. Prints both rankings and Spearman's rank correlation.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

BASE = ("model.d_model=256", "model.n_heads=8", "model.n_kv_heads=8", "model.d_ff=768", "model.seq_len=128",
        "model.vocab_size=2048", "train.global_batch=16", "remat.layers={}", "remat.policy=none",
        "precision.compute=float32", "rules={}")  # fmt: skip
LAYOUTS = {
    "data 8": ("mesh.axes={data: 8, fsdp: 1, tensor: 1}",),
    "fsdp 8": ("mesh.axes={data: 1, fsdp: 8, tensor: 1}",),
    "data 2 x fsdp 4": ("mesh.axes={data: 2, fsdp: 4, tensor: 1}",),
    "fsdp 4 x tensor 2": ("mesh.axes={data: 1, fsdp: 4, tensor: 2}",),
    "data 4 x tensor 2": ("mesh.axes={data: 4, fsdp: 1, tensor: 2}",),
    "data 2 x tensor 4": ("mesh.axes={data: 2, fsdp: 1, tensor: 4}",),
    "tensor 8": ("mesh.axes={data: 1, fsdp: 1, tensor: 8}",),
    "fsdp 8, full remat": ("mesh.axes={data: 1, fsdp: 8, tensor: 1}", "remat.policy=full"),
}


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(xs):
        order = sorted(range(len(xs)), key=xs.__getitem__)
        out = [0.0] * len(xs)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True)) / (n * (n * n - 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    from shardmem import load_config
    from shardmem.explore.sweep import plan_candidates

    config = load_config("configs/tiny.yaml", list(BASE))
    combos = list(LAYOUTS.values())
    rows = plan_candidates(config, combos, "cpu", measure=True, measure_steps=args.steps)
    table = []
    for name, row in zip(LAYOUTS, rows, strict=True):
        if row.error:
            print(f"{name}: {row.error}", file=sys.stderr)
            continue
        table.append((name, row.predicted("seconds"), row.step_seconds))
    print("| layout | predicted ms | measured ms | predicted rank | measured rank |")
    print("|---|---|---|---|---|")
    by_predicted = sorted(table, key=lambda r: r[1])
    by_measured = sorted(table, key=lambda r: r[2])
    for name, predicted, measured in table:
        p = next(i for i, r in enumerate(by_predicted, 1) if r[0] == name)
        m = next(i for i, r in enumerate(by_measured, 1) if r[0] == name)
        print(f"| {name} | {predicted * 1e3:.1f} | {measured * 1e3:.1f} | {p} | {m} |")
    rho = spearman([r[1] for r in table], [r[2] for r in table])
    print(f"\nSpearman rank correlation {rho:.2f} over {len(table)} layouts; "
          f"fastest predicted: {by_predicted[0][0]}, fastest measured: {by_measured[0][0]}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
