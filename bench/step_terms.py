"""A plan's predicted step, kernel by kernel: where the seconds go, to compare with first principles.

    python bench/step_terms.py bench/schedules/llama3-8b-context.yaml            # top 30 kernel groups
    python bench/step_terms.py bench/schedules/gpt3-175b.yaml --top 10           # and each 1F1B op's tally
    python bench/step_terms.py CONFIG --set train.micro_batches=8 --match 'mlp'  # the kernels of a scope

Plans the config as ``shardmem plan --json`` does and records every kernel the step-time model
(shardmem/planning/cost.py) costs, with the trips of the loops around it. Prints the step's breakdown,
then the kernels grouped by (compute or memory-bound, kernel kind, model scope) with seconds, launches,
FLOPs and bytes per step; the share of XLA's rematerialization clones (``.remat`` instructions, which XLA
adds when the program's temporaries exceed its memory limit); and for a 1F1B pipeline each op's time
(forward, backward, the head's), which the model charges per tick as the slowest op some stage runs,
and what the step spends outside the ops (the tick loop's hand-offs and queue copies, the step's end).

Kernels inside the alternatives of a conditional or a 1F1B tick are all listed (each at its loop's
trips), so for a pipeline the groups add up to more than the step: read the per-op tallies there.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shardmem import cli  # noqa: E402
from shardmem.planning import cost, hlo  # noqa: E402


def _kind(ins: hlo.Instruction) -> str:
    if ins.opcode == "fusion":
        match = re.search(r"kind=(\w+)", ins.attributes)
        return "fusion:" + (match.group(1) if match else "?")
    if ins.opcode == "custom-call":
        match = re.search(r'custom_call_target="([^"]*)"', ins.attributes)
        return "custom-call:" + (match.group(1)[:30] if match else "?")
    return ins.opcode


def _scope(ins: hlo.Instruction) -> str:
    return hlo.readable_scope(ins.op_name) if ins.op_name else "-"


def record_kernels(argv: list[str]) -> tuple[dict, list, object]:
    """Runs ``shardmem plan --json`` with ``argv``; returns its JSON, every kernel the step-time model
    costed as (instruction, seconds, category, FLOPs, bytes, runs per step), and the model's replay."""
    kernels, replays = [], []
    replay_init, kernel_seconds = cost._Replay.__init__, cost._Kernels.seconds

    def init(self, *args, **kwargs):
        replay_init(self, *args, **kwargs)
        replays.append(self)

    def seconds(self, ins):
        result = kernel_seconds(self, ins)
        kernels.append((ins, *result, self.bytes(ins), replays[-1].multiplier))
        return result

    cost._Replay.__init__, cost._Kernels.seconds = init, seconds
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            cli.main(["plan", *argv, "--json"])
    finally:
        cost._Replay.__init__, cost._Kernels.seconds = replay_init, kernel_seconds
    return json.loads(out.getvalue()), kernels, replays[-1] if replays else None


def outside_the_ops(replay) -> dict[str, float]:
    """What each part of a 1F1B step outside its ops adds to the predicted step, in seconds: the step
    replayed without that part (the tick loop's hand-offs, its other collectives, its kernels outside the
    ops; everything outside the tick loop). The rest of the step is the ticks' ops, by the table."""
    module = replay.module
    loops = [ins for ins in module.computations[module.entry] if ins.opcode == "while" and ins.trip_count]
    tick_loop = max(loops, key=lambda ins: ins.trip_count)
    body = re.search(r"body=%?([\w.\-]+)", tick_loop.attributes).group(1)
    grouped = {loop.name for loops in hlo.one_of_groups(module.computations[body]).values() for loop in loops}

    def step_without(computation: str, dropped) -> float:
        computations = dict(module.computations)
        computations[computation] = tuple(ins for ins in computations[computation] if not dropped(ins))
        without = dataclasses.replace(module, computations=computations)
        again = cost._Replay(
            without, replay.hardware, replay.hosts_of, replay.kernels.attention, replay.tick_ops
        )
        return again.computation(module.entry).seconds

    def collective(kind):
        return lambda ins: ins.opcode.startswith(kind)

    def kernel(ins):
        skipped = ins.name in grouped or hlo.collective_kind(ins) or ins.opcode in ("while", "parameter")
        return not (skipped or ins.opcode.endswith(("-start", "-done")))

    step = cost._Replay(module, replay.hardware, replay.hosts_of, replay.kernels.attention, replay.tick_ops)
    step = step.computation(module.entry).seconds
    parts = {
        "tick loop: hand-offs (collective-permutes)": step
        - step_without(body, collective("collective-permute")),
        "tick loop: other collectives": step
        - step_without(
            body,
            lambda ins: not ins.opcode.startswith("collective-permute") and bool(hlo.collective_kind(ins)),
        ),
        "tick loop: kernels outside the ops (queues' selects, slices, copies)": step
        - step_without(body, kernel),
        "outside the tick loop (gradient reduction, optimizer, ...)": step_without(
            module.entry, lambda ins: ins.name == tick_loop.name
        ),
    }
    return {"the ticks' ops": step - sum(parts.values()), **parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--top", type=int, default=30, help="kernel groups to list")
    parser.add_argument("--match", help="also list the costliest kernels whose scope matches this regex")
    args = parser.parse_args()
    plan, kernels, replay = record_kernels([args.config, *(x for s in args.set for x in ("--set", s))])
    step = plan["step_time"]
    print(f"step {step['seconds']:.3f} s:", {k: round(v, 3) for k, v in step["breakdown"].items()},
          f"peak {plan['per_device']['peak'] / 2**30:.2f} GiB")  # fmt: skip
    groups = collections.defaultdict(lambda: [0.0, 0, 0.0, 0.0])
    clones = collections.Counter()
    for ins, seconds, category, flops, nbytes, runs in kernels:
        scope = _scope(ins)
        group = groups[(category, _kind(ins), scope)]
        group[0] += seconds * runs
        group[1] += runs
        group[2] += flops * runs
        group[3] += nbytes * runs
        clones[("XLA remat clones" if ".remat" in ins.name else "the program's", category)] += seconds * runs
    print(f"{'seconds':>9} {'category':12} {'launches':>9} {'TFLOP':>9} {'GB':>9}  kernel kind, scope")
    for (category, kind, scope), (seconds, runs, flops, nbytes) in sorted(
        groups.items(), key=lambda item: -item[1][0]
    )[: args.top]:
        print(
            f"{seconds:9.3f} {category:12} {runs:9d} {flops / 1e12:9.1f} {nbytes / 1e9:9.1f}  {kind}, {scope}"
        )
    print("by origin:", {f"{a}, {b}": round(v, 3) for (a, b), v in sorted(clones.items())})
    if args.match:
        chosen = [k for k in kernels if re.search(args.match, _scope(k[0]))]
        for ins, seconds, _, flops, nbytes, runs in sorted(chosen, key=lambda k: -k[1] * k[5])[: args.top]:
            print(f"{seconds * runs:9.3f} s x{runs:6d} {nbytes / 1e6:9.1f} MB {flops / 1e9:9.1f} GFLOP "
                  f"{ins.name} {ins.shape[:70]} {_kind(ins)}")  # fmt: skip
    seen = set()
    for groups_of_ops in replay.one_of.values() if replay else ():
        for _, by_op in groups_of_ops:
            key = tuple(sorted((op, round(t.seconds, 9)) for op, (t, _) in by_op.items()))
            if key in seen or len(by_op) < 2:  # One op alone: a loop nested in an op, not a tick.
                continue
            seen.add(key)
            print("a tick's ops (one of them runs on each stage):")
            for op, (t, _) in sorted(by_op.items()):
                print(
                    f"  op {op}: {t.seconds * 1e3:8.3f} ms (compute {t.compute * 1e3:.3f}, memory-bound "
                    f"{t.memory_bound * 1e3:.3f}, exposed communication {t.exposed_communication * 1e3:.3f})"
                )
    if plan.get("pipeline") and plan["pipeline"].get("schedule") in ("1f1b", "interleaved"):
        print("the step outside the ops (each part: the step replayed without it):")
        for part, seconds in outside_the_ops(replay).items():
            print(f"  {seconds:8.3f} s  {part}")
    if plan.get("pipeline"):
        shown = ("schedule", "stages", "repeats", "micro_batches", "ticks", "backward_parts", "in_flight")
        print("pipeline:", {k: plan["pipeline"][k] for k in shown if k in plan["pipeline"]})


if __name__ == "__main__":
    main()
