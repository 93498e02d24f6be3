"""shardmem's plan against MaxText's train_compile for the same model and layout, buffer by buffer.

    .venv-newest/bin/python bench/maxtext_compare.py bench/maxtext/llama2-7b-v5p-8.yaml \
        --target v5p-8 --maxtext-log mt.out --maxtext-dump mt_dump/ [--remat full]

Plans the config with shardmem (the figures ``shardmem plan CONFIG --target TARGET --json`` prints) and
reads what MaxText compiled: its log (the ``MEMORY_STATS_JSON`` line of bench/maxtext_train_compile.py)
and its XLA dump (``compile_xla_flags=--xla_dump_to=DIR``). Both programs' buffers are read by the same
code (:func:`shardmem.planning.hlo.buffer_schedule`), so the buffers live at each peak are compared on
equal terms, grouped by what they hold. bench/maxtext_tpu.sh runs the whole comparison.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

import jax

import shardmem
from shardmem.planning import hlo

GIB = 2**30
OTHER = "other activations and temporaries"


def _dims(shape: str) -> tuple[str, list[int]]:
    match = re.match(r"(\w+)\[([\d,]*)\]", shape)
    if not match:
        return "", []
    return match.group(1), [int(d) for d in match.group(2).split(",") if d]


def kind(buffer, n_layers: int, seq_len: int) -> str:
    """What a buffer holds, from its scope and shape alone (both programs name their arrays differently)."""
    dtype, dims = _dims(buffer.shape)
    if dtype == "bf16" and n_layers in dims[:2] and seq_len not in dims:
        return "bf16 copies of the layer weights (cast once, before the scan)"
    if buffer.scope.endswith("(argument)"):
        if "opt_state" in buffer.scope:
            return "optimizer state: Adam mu and nu (arguments)"
        if re.search(r"state/(params|model)/", buffer.scope):
            return "parameters, float32 (arguments)"
        return "other arguments (batch, step)"
    if dims.count(seq_len) >= 2:
        return "attention scores/probabilities, L x L per head"
    if dtype == "f32" and dims[:1] == [n_layers] and len(dims) >= 3:
        return "weight gradients, float32, stacked over the layers"
    if dtype == "bf16" and dims[:1] == [n_layers] and seq_len in dims:
        return "activations saved for the backward (bf16, stacked over the layers)"
    return OTHER


def at_peak(schedule, n_layers: int, seq_len: int) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for b in schedule.live_at(schedule.peak_position):
        group = groups[kind(b, n_layers, seq_len)]
        group[0] += b.bytes
        group[1] += 1
    return dict(groups)


def maxtext_stats(log: Path) -> dict[str, int]:
    for line in log.read_text().splitlines():
        if line.startswith("MEMORY_STATS_JSON "):
            return json.loads(line.removeprefix("MEMORY_STATS_JSON "))
    raise SystemExit(f"{log}: no MEMORY_STATS_JSON line; run MaxText through bench/maxtext_train_compile.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--target", default="v5p-8")
    parser.add_argument("--maxtext-log", type=Path, required=True)
    parser.add_argument("--maxtext-dump", type=Path, required=True)
    parser.add_argument("--set", action="append", default=[], help="shardmem config overrides")
    parser.add_argument("--json", type=Path, help="also write both sides' figures here")
    args = parser.parse_args()

    config = shardmem.load_config(args.config, overrides=args.set)
    report = shardmem.plan(config, target=args.target, top=0, count_remat_overhead=False)
    d = report.per_device
    ours = {
        "argument": report.cross_check["compiled_argument_bytes"], "output": d["outputs"],
        "alias": d["alias"], "temp": d["temp"], "peak": d["peak"], "live_peak": report.schedule.peak_bytes,
    }  # fmt: skip
    theirs_stats = maxtext_stats(args.maxtext_log)
    theirs_schedule = hlo.buffer_schedule(args.maxtext_dump)
    theirs = {
        "argument": theirs_stats["argument_size_in_bytes"], "output": theirs_stats["output_size_in_bytes"],
        "alias": theirs_stats["alias_size_in_bytes"], "temp": theirs_stats["temp_size_in_bytes"],
        "peak": theirs_stats["peak_memory_in_bytes"], "live_peak": theirs_schedule.peak_bytes,
    }  # fmt: skip
    for side in (ours, theirs):
        side["total"] = side["argument"] + side["output"] + side["temp"] - side["alias"]

    print(f"per chip, {report.target_label}; shardmem on jax {jax.__version__}")
    print(f"{'':34}{'shardmem':>18}{'MaxText':>18}{'MaxText - shardmem':>22}")
    rows = [("argument", "argument"), ("output", "output"), ("alias", "alias"), ("temp", "temp"),
            ("total", "arg + out + temp - alias"), ("peak", "XLA peak_memory_in_bytes"),
            ("live_peak", "peak of the buffer live ranges")]  # fmt: skip
    for key, label in rows:
        a, b = ours[key], theirs[key]
        print(
            f"{label:34}{a / GIB:14.3f} GiB{b / GIB:14.3f} GiB{(b - a) / GIB:+12.3f} GiB ({(b - a) / a:+.1%})"
        )

    model = config.model
    ours_groups = at_peak(report.schedule, model.n_layers, model.seq_len)
    theirs_groups = at_peak(theirs_schedule, model.n_layers, model.seq_len)
    print("\nlive at each program's peak (buffers, GiB):")
    print(f"{'':68}{'shardmem':>16}{'MaxText':>16}{'difference':>12}")
    for name in sorted(
        {*ours_groups, *theirs_groups},
        key=lambda n: -max(ours_groups.get(n, [0])[0], theirs_groups.get(n, [0])[0]),
    ):
        (a, na), (b, nb) = ours_groups.get(name, [0, 0]), theirs_groups.get(name, [0, 0])
        print(f"{name:68}{na:5} {a / GIB:9.3f}{nb:6} {b / GIB:9.3f}{(b - a) / GIB:+12.3f}")
    a, b = ours["live_peak"], theirs["live_peak"]
    print(f"{'sum':68}{a / GIB:15.3f}{b / GIB:16.3f}{(b - a) / GIB:+12.3f}")
    for side, schedule in (("shardmem", report.schedule), ("MaxText", theirs_schedule)):
        print(f"\n{side}: the largest of its other activations and temporaries at the peak")
        live = schedule.live_at(schedule.peak_position)
        others = [b for b in live if kind(b, model.n_layers, model.seq_len) == OTHER]
        for buffer in others[:8]:
            print(f"  {buffer.bytes / 2**20:9.1f} MiB  {buffer.shape:28} {buffer.scope[:90]}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "shardmem": ours,
                    "maxtext": theirs,
                    "shardmem_at_peak": ours_groups,
                    "maxtext_at_peak": theirs_groups,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
