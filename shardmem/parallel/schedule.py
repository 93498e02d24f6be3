"""1F1B schedules as tables: which op each pipeline stage runs at each tick, and where its data waits.

    table = schedule_table(stages=4, micro_batches=8)      # Megatron-LM's 1F1B, backwards in 2 parts
    table.rows[tick, OP, stage]                             # FORWARD, BACKWARD + part, ... or IDLE
    table.ring_slots                                        # 4: the most chunk passes a stage holds

The table is made by running the schedule in Python, tick by tick, with the hand-offs the program makes:
what a stage makes in a tick reaches its neighbour's queue at the end of that tick, for the next. Each
row names the slots the program reads and writes (``COLUMNS``), so the SPMD program that runs it
(:meth:`shardmem.parallel.pipeline.Pipeline.loss`) only looks them up.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

#: The ops of a 1F1B schedule table: the first chunk's forward embeds the inputs, the last's runs the head;
#: backward part p is ``BACKWARD + p`` (part 0 ends the chunk's backward; the first chunk's goes on into
#: the embedding instead: ``BACKWARD_TO_INPUT``).
IDLE, FORWARD, FORWARD_FROM_INPUT, FORWARD_AND_HEAD, BACKWARD_TO_INPUT, BACKWARD = range(6)


#: A row's entries for each stage: the op, its micro-batch and repeat, the residual slot (written by a
#: forward, read by a backward part), the source slot (the queued input of a forward, the queued gradient
#: of a backward part), the local slot (where a gradient the stage made for itself waits: the head's, or
#: a backward part's for the next part), and the input and gradient slots where what the stages before and
#: after sent this tick lands (-1: none).
COLUMNS = ("op", "micro", "repeat", "ring", "source", "local", "from_before", "from_after")
OP, MICRO, REPEAT, RING, SOURCE, LOCAL, FROM_BEFORE, FROM_AFTER = range(len(COLUMNS))

#: The program runs a tick's op as one of several loops, each run once where the op is its own and never
#: elsewhere, named ``{ONE_OF_SCOPE}_{n}/{i}`` (op i of n): a device runs one of them, so the step-time
#: model charges the slowest alone (:func:`shardmem.planning.hlo.one_of_groups`).
ONE_OF_SCOPE = "one_of"


class ScheduleTable(NamedTuple):
    """What each stage does at each tick of a 1F1B schedule (:func:`schedule_table`)."""

    rows: np.ndarray  # [ticks, len(COLUMNS), stages], read-only.
    ring_slots: int  # Chunk passes whose residuals a stage holds at once, at most (the ring's size).
    input_slots: int  # Inputs waiting for their forward at once, at most.
    grad_slots: int  # Gradients waiting for their backward part at once, at most.
    busy: int  # Ticks each stage runs an op: micro-batches x repeats x (1 + backward parts).

    @property
    def ticks(self) -> int:
        return self.rows.shape[0]

    @property
    def hand_offs(self) -> tuple[tuple[bool, bool], ...]:
        """Which hand-offs the program's ticks make, by the tick's phase: per phase, whether some stage
        receives an input from the stage before and whether some receives a gradient from the one after.
        One phase, both, unless the table's even ticks run forwards only (in phase: see
        :func:`schedule_table`); then two, even ticks handing nothing back, so the program sends no
        gradient-sized message of zeros to the stage before on those ticks (Megatron-LM sends each op's
        output one way)."""
        forward = (self.rows[:, FROM_BEFORE] >= 0).any(axis=1)
        back = (self.rows[:, FROM_AFTER] >= 0).any(axis=1)
        if self.ticks % 2 == 0:
            phases = tuple((bool(forward[q::2].any()), bool(back[q::2].any())) for q in (0, 1))
            if not all(all(phase) for phase in phases):
                return phases
        return ((True, True),)


@functools.lru_cache(maxsize=64)
def schedule_table(stages: int, micro_batches: int, repeats: int = 1, parts: int = 2) -> ScheduleTable:
    """Builds the 1F1B (``repeats`` 1) or interleaved 1F1B schedule as a table of ticks, by running it:
    each tick every stage runs one op, a chunk's forward or one of its ``parts`` backward parts (about a
    forward's work each), on the first micro-batch whose inputs are ready.

    A stage runs its forwards in Megatron-LM's order (groups of S micro-batches, each group through all R
    repeats) and its backwards in the same order with the repeats reversed, holding at most as many chunk
    passes as Megatron's warm-up gives it: with R = 1, stage s holds ``S - s`` micro-batches (``S - s - 1``
    warm-up forwards, then one forward, one backward) and runs a ready backward first; with R > 1,
    ``2 (S - s - 1) + (R - 1) S + 1`` chunk passes, a ready forward first. Either way the table is as
    short as the bubble formula says: ``(M R + S - 1) (1 + parts)`` ticks.

    A tick lasts as long as its slowest op (the stages hand on their outputs together at its end), so a
    whole backward (``parts`` 1: chunks of one layer) beside a neighbour's forward makes the forward's
    stage wait a second forward's time. Interleaved tables of whole backwards therefore keep the ops in
    phase: even ticks run forwards only, odd ticks a ready backward first, else a forward. They are longer
    in ticks but as short as the bubble formula in forwards' time, ``(M R + S - 1) 3``, and hold the
    same chunk passes (without phases: GPT-3's 8 stages x 12 repeats x 64 micro-batches took 1.29x that)."""
    s, m, r = stages, micro_batches, repeats
    if s * r < 2 or parts < 1 or m < 1:
        shape = f"{stages} stages x {repeats} repeats, {parts} parts, {micro_batches} micro-batches"
        raise ValueError(f"a 1F1B table needs 2 or more chunks, a backward part and a micro-batch: {shape}")
    if r == 1:
        return _run_schedule(s, m, r, parts, tuple(s - d for d in range(s)), backward_first=True)
    limits = tuple(2 * (s - d - 1) + (r - 1) * s + 1 for d in range(s))
    return _run_schedule(s, m, r, parts, limits, backward_first=False, in_phase=parts == 1)


def _run_schedule(s: int, m: int, r: int, parts: int, limits: tuple[int, ...], backward_first: bool,
                  in_phase: bool = False) -> ScheduleTable:  # fmt: skip
    """Runs the schedule tick by tick (see :func:`schedule_table`), each stage holding at most
    ``limits[stage]`` chunk passes; returns its table. ``in_phase``: even ticks run no backward, odd ticks
    a ready backward first."""
    chunks, total = r * s, m * r

    def forward_at(k):  # A stage's k-th forward: (micro-batch, repeat).
        group, within = divmod(k, chunks)
        return group * s + within % s, within // s

    finished: dict[tuple, int] = {}  # ("F", micro, chunk) or ("B", micro, chunk, part) -> tick.
    n_forward, n_backward, next_part, held = [0] * s, [0] * s, [parts - 1] * s, [0] * s
    ring_of: dict[tuple, int] = {}  # (micro, chunk) -> its residual slot.
    waiting: dict[tuple, int] = {}  # ("x", micro, chunk) or ("dy", micro, chunk, part) -> slot.
    free = {kind: [set() for _ in range(s)] for kind in ("ring", "x", "dy")}
    made = {kind: [0] * s for kind in free}  # Slots each stage has used so far.

    def take(kind, stage):
        if free[kind][stage]:
            slot = min(free[kind][stage])
            free[kind][stage].remove(slot)
            return slot
        made[kind][stage] += 1
        return made[kind][stage] - 1

    rows = []
    tick = 0
    while any(n < total for n in n_backward):
        if tick > 4 * (total + 2 * chunks) * (1 + parts):  # Megatron's limits never stall.
            raise RuntimeError(f"the 1F1B schedule stalled: {s} stages, {m} micro-batches, {r} repeats")
        ops = []
        for d in range(s):
            backward = forward = None
            if n_backward[d] < total:
                micro, repeat = forward_at(n_backward[d])
                c, p = (r - 1 - repeat) * s + d, next_part[d]
                after = ("F", micro, c) if c == chunks - 1 else ("B", micro, c + 1, 0)
                needs = after if p == parts - 1 else ("B", micro, c, p + 1)
                if finished.get(needs, tick) < tick:
                    backward = ("B", micro, c, p)
            if n_forward[d] < total and held[d] < limits[d]:
                micro, repeat = forward_at(n_forward[d])
                c = repeat * s + d
                if c == 0 or finished.get(("F", micro, c - 1), tick) < tick:
                    forward = ("F", micro, c)
            if in_phase:
                ops.append(forward if tick % 2 == 0 else backward or forward)
            else:
                ops.append(backward or forward if backward_first else forward or backward)
        row = np.zeros((len(COLUMNS), s), np.int32)
        row[[LOCAL, FROM_BEFORE, FROM_AFTER]] = -1
        arrivals = []
        for d, op in enumerate(ops):  # What each op reads is freed before this tick's slots are taken.
            if op is None:
                continue
            micro, c = op[1], op[2]
            row[MICRO, d], row[REPEAT, d] = micro, c // s
            if op[0] == "F":
                row[OP, d] = (
                    FORWARD_AND_HEAD if c == chunks - 1 else FORWARD_FROM_INPUT if c == 0 else FORWARD
                )
                if c > 0:
                    row[SOURCE, d] = waiting.pop(("x", micro, c))
                    free["x"][d].add(row[SOURCE, d])
            else:
                p = op[3]
                row[OP, d] = BACKWARD_TO_INPUT if (c, p) == (0, 0) else BACKWARD + p
                row[SOURCE, d] = waiting.pop(("dy", micro, c, p))
                free["dy"][d].add(row[SOURCE, d])
                row[RING, d] = ring_of[(micro, c)]
                if p == 0:
                    free["ring"][d].add(ring_of.pop((micro, c)))
        for d, op in enumerate(ops):
            if op is None:
                continue
            micro, c = op[1], op[2]
            finished[op] = tick
            if op[0] == "F":
                n_forward[d] += 1
                held[d] += 1
                row[RING, d] = ring_of[(micro, c)] = take("ring", d)
                if c == chunks - 1:  # The head's gradient waits here for the first backward part.
                    row[LOCAL, d] = waiting[("dy", micro, c, parts - 1)] = take("dy", d)
                else:
                    arrivals.append(((d + 1) % s, FROM_BEFORE, ("x", micro, c + 1), "x"))
            else:
                p = op[3]
                if p > 0:
                    row[LOCAL, d] = waiting[("dy", micro, c, p - 1)] = take("dy", d)
                    next_part[d] = p - 1
                else:
                    n_backward[d] += 1
                    held[d] -= 1
                    next_part[d] = parts - 1
                    if c > 0:
                        arrivals.append(((d - 1) % s, FROM_AFTER, ("dy", micro, c - 1, parts - 1), "dy"))
        for d, column, key, kind in arrivals:
            row[column, d] = waiting[key] = take(kind, d)
        rows.append(row)
        tick += 1
    busy = total * (1 + parts)
    ring, x, dy = (max(max(made[kind]), 1) for kind in ("ring", "x", "dy"))
    table = np.stack(rows)
    table.flags.writeable = False  # Cached: shared by every caller.
    return ScheduleTable(table, ring, x, dy, busy)
