"""The serving plan: the serving program's prefill and decode compiled for a target, what each needs and
how fast a static batch runs.

    serving = plan_serving(load_config("configs/llama-7b.yaml"), "h100-sxm")   # its serve: section
    serving.prefill, serving.decode        # a MemoryReport of each function, as plan gives the step's
    serving.per_device                     # weights, KV cache, each one's temporaries and peak
    serving.time.time_to_first_token, serving.time.output_tokens_per_second
    serving.capacity.max_batch, serving.capacity.max_len   # what the cache has room for beside them
    print(render_serving(serving))         # shardmem plan CONFIG --serve

Nothing the size of the model is allocated: the prefill (the prompts -> first logits and a new KV cache)
and the decode step (one token per sequence, the cache donated and updated in place) are compiled on
abstract arguments by :func:`~shardmem.planning.memory.plan_program`, deviceless for named GPUs and TPUs,
and timed by its step-time model (:mod:`shardmem.planning.cost`). A static batch runs one function at a
time, so serving fits when each of them does; its peak is the larger of the two.

Time (:class:`ServingTime`): the first token comes from the prefill; each of the ``max_len - prompt_len``
more is a decode step at a context one longer. The compiled decode step attends over all ``max_len``
positions of the cache; a step at a shorter context reads only its live part, so its time is the
compiled step's less the unread positions' bytes at the rate the model streams HBM (a step's time is
affine in its context). The sliding layers of a window shorter than the cache keep only the window's
positions (the cache's ring, :mod:`shardmem.models.kv_cache`): a step reads at most those of them, and a
model of your own's layers at most its ``cache_layout().window`` (GPUs' decode kernel skips the rest,
:mod:`shardmem.models.decode_attention`). Beside each step stands its bound: every weight and the live
cache read once at the full HBM bandwidth, which no step can beat.

Budget: what the device has for serving (device x ``memory.usable_fraction`` - ``memory.reserve``), less the
deviceless margin on each function's temporaries alone. The margin is for what a real GPU's compile may
decide otherwise (its kernels' workspace, its fusions); the weights and the KV cache are arguments whose
bytes are exact, and most of a serving peak. (A training plan divides its whole budget by 1 + the
margin, which was measured on a training step.)

Capacity (:class:`KVCapacity`): the bytes the cache may take are the budget less everything else at the
peak (weights, the larger function's temporaries), as vLLM sizes its cache after a profiling run; the
largest batch at ``max_len`` and the longest context at ``batch`` follow from the cache's bytes per token
(and per sequence: a ring's are the window's whatever the context, and with every layer sliding the cache
does not grow with the context at all).
:func:`search_capacity` checks them with compiles: the peak is affine in the batch and in the context,
so two compiles give the line, the budget gives the answer, and two more verify it (it fits, one step past
it does not). Near the budget XLA holds the temporaries below the line (the weights and the cache leave
it little memory), so where one step past fits too, the search goes on from there.
"""

from __future__ import annotations

import contextvars
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardmem._quiet import native_stderr_silenced
from shardmem.config import Config
from shardmem.errors import ConfigError
from shardmem.parallel.mesh import build_mesh
from shardmem.planning import cost
from shardmem.planning.memory import (
    MemoryReport,
    make_target,
    per_device_bytes,
    persistent_cache_off,
    plan_program,
)
from shardmem.planning.targets import Target
from shardmem.program.serving import ServingProgram, serving_program
from shardmem.units import format_bytes

#: Verdicts from best to worst: a plan of several functions has its worst one's.
_VERDICTS = ("fits", "tight", "does not fit")


@dataclasses.dataclass(frozen=True)
class ServingTime:
    """Predicted times of a static batch on the target (see the module docstring): the prefill, then
    ``output_len - 1`` decode steps at contexts ``prompt_len + 1`` to ``prompt_len + output_len - 1``."""

    time_to_first_token: float  # The prefill's seconds: every prompt's first new token.
    decode_at_max_len: float  # The compiled decode step's seconds: every max_len position read.
    streamed: float  # Bytes per second per device at which a step's kernels read the cache (HBM).
    weight_bytes: int  # Per device, read by every step.
    kv_bytes_per_position: int  # Per device: one position of every sequence, every layer of the stack.
    memory_bandwidth: float  # Bytes per second of HBM per device.
    batch: int
    prompt_len: int
    max_len: int
    window: int | None = None  # A model of your own's cache_layout().window: the most its steps read.
    ring_window: int | None = None  # The ring's (the sliding layers' keys, kv_cache.KVCache.ring).
    ring_bytes_per_position: int = 0  # Per device: one position of every sequence in the ring.

    def live(self, context: int) -> int:
        """Positions of each sequence in the stack a step at ``context`` reads: all, or the window's."""
        return context if self.window is None else min(context, self.window)

    def kv_bytes(self, context: int) -> int:
        """Bytes per device of the cache a step at ``context`` reads: the stack's live positions and the
        ring's (at most its window's)."""
        ring = 0 if self.ring_window is None else min(context, self.ring_window)
        return self.live(context) * self.kv_bytes_per_position + ring * self.ring_bytes_per_position

    @property
    def output_len(self) -> int:
        """New tokens per sequence: the prefill's and one per decode step, until the cache is full."""
        return self.max_len - self.prompt_len + 1

    def decode_seconds(self, context: int) -> float:
        """A decode step's predicted seconds when each sequence has ``context`` live positions."""
        return self.decode_at_max_len - (self.kv_bytes(self.max_len) - self.kv_bytes(context)) / self.streamed

    def bound_seconds(self, context: int) -> float:
        """The step's HBM bound: the weights and ``context`` live positions (those in a window) read
        once at full bandwidth."""
        return (self.weight_bytes + self.kv_bytes(context)) / self.memory_bandwidth

    @property
    def contexts(self) -> tuple[int, int]:
        """The live positions of the first and of the last decode step."""
        return self.prompt_len + 1, self.max_len

    @property
    def mean_decode_seconds(self) -> float:
        """The decode steps' mean: affine in the context up to a window, then in the next piece, so the
        mean of each piece's first and last step, weighted by its steps."""
        first, last = self.contexts
        if last <= first:
            return (self.decode_seconds(first) + self.decode_seconds(last)) / 2
        bends = sorted({w for w in (self.window, self.ring_window) if w is not None and first <= w < last})
        total, start = 0.0, first
        for end in [*bends, last]:
            total += (end - start + 1) * (self.decode_seconds(start) + self.decode_seconds(end)) / 2
            start = end + 1
        return total / (last - first + 1)

    @property
    def total_seconds(self) -> float:
        """The whole static batch: the prefill and every decode step."""
        return self.time_to_first_token + (self.output_len - 1) * self.mean_decode_seconds

    @property
    def output_tokens_per_second(self) -> float:
        """New tokens of every sequence over :attr:`total_seconds` (prefill included, as the static-batch
        benchmarks of TensorRT-LLM and lmdeploy count them)."""
        return self.batch * self.output_len / self.total_seconds

    def to_json(self) -> dict[str, Any]:
        first, last = self.contexts
        return {
            "time_to_first_token": self.time_to_first_token,
            "output_len": self.output_len,
            "decode_seconds": {"first": self.decode_seconds(first), "last": self.decode_seconds(last),
                               "mean": self.mean_decode_seconds},
            "decode_bound_seconds": {"first": self.bound_seconds(first), "last": self.bound_seconds(last)},
            "total_seconds": self.total_seconds,
            "output_tokens_per_second": self.output_tokens_per_second,
        }  # fmt: skip


@dataclasses.dataclass(frozen=True)
class KVCapacity:
    """How much cache fits beside the weights and the temporaries (see the module docstring). ``verified``
    says whether the batch and context were compiled at and fit (:func:`search_capacity`), or read off
    one plan's bytes per token, the temporaries held as planned: then ``max_batch`` is an upper bound,
    since a larger batch's prefill needs more temporaries too."""

    cache_bytes: int  # Per device: the budget less everything but the cache at the plan's peak.
    bytes_per_token: int  # Per device: one position of one sequence, every stack layer's keys and values.
    max_batch: int  # Sequences of max_len positions that fit (a multiple of the batch's shards).
    max_len: int | None  # Positions per sequence that fit at the planned batch (None: any, every layer
    # slides and keeps its window's positions only).
    verified: bool = False
    bytes_per_sequence: int = 0  # Per device: one sequence's ring (its sliding layers' window), if any.
    tokens: int = 0  # Positions of the stack the room holds over the planned batch, past its rings.

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ServingPlan:
    """The prefill's and the decode step's reports for one ``serve:`` section on one target, with the
    predicted times (None where the target has no step-time model) and the cache's capacity."""

    prefill: MemoryReport
    decode: MemoryReport
    serve: dict[str, Any]  # The serve section planned: batch, prompt_len, max_len, kv_dtype, quantize.
    time: ServingTime | None = None
    capacity: KVCapacity | None = None
    # The cache's ring (kv_cache.KVCache.ring): its sliding layers, their window and its bytes per device.
    ring: dict[str, int] | None = None
    # The window every layer slides over, if they all do: the cache stops growing at it (as a ring).
    every_layer_window: int | None = None

    @property
    def per_device(self) -> dict[str, int]:
        """Bytes per device: the ``weights`` and ``kv_cache`` (both held while serving), each function's
        temporaries and peak, and the serving ``peak`` (the larger)."""
        prefill, decode = self.prefill.per_device, self.decode.per_device
        return {
            "weights": decode["params"],
            "kv_cache": decode["kv_cache"],
            "prefill_temp": prefill["temp"],
            "decode_temp": decode["temp"],
            "prefill_peak": prefill["peak"],
            "decode_peak": decode["peak"],
            "peak": max(prefill["peak"], decode["peak"]),
        }

    @property
    def peaked_function(self) -> str:
        """The function whose peak is serving's: ``"prefill"``, unless the decode step's is higher."""
        return "prefill" if self.prefill.per_device["peak"] >= self.decode.per_device["peak"] else "decode"

    @property
    def peaked(self) -> MemoryReport:
        """The report of :attr:`peaked_function` (whose memory timeline ``plan --serve --html`` draws)."""
        return self.prefill if self.peaked_function == "prefill" else self.decode

    @property
    def binding_function(self) -> str:
        """The function with the least room under its budget, ``"prefill"`` on a tie (both hold the
        weights and the cache; their temporaries, and so their budgets, differ)."""
        return "prefill" if self.prefill.margin_bytes <= self.decode.margin_bytes else "decode"

    @property
    def binding(self) -> MemoryReport:
        """The report of :attr:`binding_function`."""
        return self.prefill if self.binding_function == "prefill" else self.decode

    @property
    def budget_bytes(self) -> int:
        """The budget of :attr:`binding`: what the device has for serving less the deviceless margin on
        that function's temporaries (module docstring)."""
        return self.binding.budget_bytes

    @property
    def margin_bytes(self) -> int:
        """The least room either function has under its budget: negative when serving does not fit."""
        return self.binding.margin_bytes

    @property
    def fits(self) -> bool:
        """Whether both functions fit the budget."""
        return self.prefill.fits and self.decode.fits

    @property
    def verdict(self) -> str:
        """The worse of the two functions' verdicts: ``"fits"``, ``"tight"`` or ``"does not fit"``."""
        return max(self.prefill.verdict, self.decode.verdict, key=_VERDICTS.index)

    @property
    def shared_warnings(self) -> list[str]:
        """The warnings the prefill's and the decode step's reports both give: of the one program they
        compile (``finetune.init_from`` not there yet, a partition rule), said once for serving."""
        return [w for w in self.decode.warnings if w in self.prefill.warnings]

    @property
    def warnings(self) -> list[str]:
        """The :attr:`shared_warnings`, then what in the layout costs serving (the decode step gathering
        the weights it should hold)."""
        return self.shared_warnings + self._layout_warnings()

    def _layout_warnings(self) -> list[str]:
        gathered, weights = self.decode.collectives.get("all-gather", 0), self.per_device["weights"]
        if not weights or gathered < weights / 4:
            return []
        split = ", ".join(f"mesh.axes.{axis}={size}" for axis, size in self.decode.mesh.items()
                          if size > 1 and axis not in ("data", "tensor")) or "the mesh"  # fmt: skip
        return [f"each decode step all-gathers {format_bytes(gathered)} of weights ({split} splits them, as "
                "training does), where it should read each weight once from its own device: split them "
                "over mesh.axes.tensor and data replicas instead (shardmem tune CONFIG --search "
                "serve)"]  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """Returns the plan as plain JSON-ready data (``shardmem plan --serve --json``)."""
        return {
            "name": self.decode.name.removesuffix(": decode"),
            "target": self.decode.target,
            "serve": self.serve,
            "per_device": self.per_device,
            "budget_bytes": self.budget_bytes,
            "usable_bytes": self.decode.usable_bytes,
            "fits": self.fits,
            "verdict": self.verdict,
            "time": self.time.to_json() if self.time else None,
            "kv_capacity": self.capacity.to_json() if self.capacity else None,
            "kv_ring": self.ring,
            "warnings": self.warnings,
            "prefill": self.prefill.to_json(),
            "decode": self.decode.to_json(),
        }


def with_memory_fraction(config: Config, fraction: float | None) -> Config:
    """Returns ``config`` whose budget is ``fraction`` of the device's memory and nothing else held back
    (no ``memory.reserve``, no deviceless margin): what vLLM's ``gpu_memory_utilization`` gives its
    engine, so that a plan's KV capacity compares with its start-up log. None: ``config`` as it is."""
    if fraction is None:
        return config
    if not 0 < fraction <= 1:
        raise ConfigError(f"--memory-fraction={fraction}: give the share of device memory serving may use, "
                          "in (0, 1], e.g. 0.9 (vLLM's gpu_memory_utilization)")  # fmt: skip
    memory = dataclasses.replace(config.memory, usable_fraction=fraction, reserve=0, deviceless_margin=0.0)
    return dataclasses.replace(config, memory=memory)


def plan_serving(config: Config, target: str | None = None, *, top: int = 10) -> ServingPlan:
    """Compiles the config's serving program (its ``serve:`` section) for ``target`` (default
    ``memory.target``) and returns the :class:`ServingPlan` of its prefill and decode."""
    resolved = make_target(config, target)
    program = serving_program(config, build_mesh(config.mesh.axes, resolved.devices))
    return _plan(program, resolved, top=top)


def _plan(program: ServingProgram, target: Target, *, top: int = 10) -> ServingPlan:
    config = program.config
    # The prefill and the decode step compile side by side: XLA releases the GIL while it compiles, so
    # on two cores a plan takes about the longer of the two, not their sum (`plan --serve` of Llama 3 70B
    # at tensor 8: 22.5 s instead of 35.4 s, the same reports). The blocks that change the process (the
    # persistent cache's switch, fd 2) are entered once around both; each thread runs in a copy of this
    # context.
    with persistent_cache_off(), native_stderr_silenced(watch=True):
        with ThreadPoolExecutor(2, thread_name_prefix="shardmem-serving-plan") as pool:
            planned = {function: pool.submit(contextvars.copy_context().run, plan_program, program, target,
                                             function=function, top=top)
                       for function in ("prefill", "decode")}  # fmt: skip
            reports = {function: _margined(future.result()[0], f"{config.name}: {function}")
                       for function, future in planned.items()}  # fmt: skip
    s = program.serving
    quantize = config.serve.quantize
    serve = {"batch": s.batch, "prompt_len": s.prompt_len, "max_len": s.max_len, "kv_dtype": s.kv_dtype,
             "quantize": dataclasses.asdict(quantize) if quantize else None}  # fmt: skip
    layout, ring = s.layout, None
    if ringed := layout.ringed(s.max_len):
        ring = {"layers": len(ringed), "window": layout.window, "bytes": per_device_bytes(s.cache.ring)}
    every = layout.window if layout.ring and len(layout.ring) == layout.layers else None
    plan = ServingPlan(reports["prefill"], reports["decode"], serve, ring=ring, every_layer_window=every)
    time = _time(plan, target, None if layout.ring else layout.window)
    return dataclasses.replace(plan, time=time, capacity=_capacity(plan, _batch_shards(program)))


def _margined(report: MemoryReport, name: str) -> MemoryReport:
    """A serving function's report named ``name``, its budget what the device has for it less the
    deviceless margin on its temporaries alone (module docstring)."""
    report = dataclasses.replace(report, name=name)
    if not report.deviceless_margin or not report.usable_bytes:
        return report
    budget = report.usable_bytes - int(report.deviceless_margin * report.per_device["temp"])
    return dataclasses.replace(report, budget_bytes=budget, fits=report.per_device["peak"] <= budget,
                               margin_on_temporaries=True)  # fmt: skip


def _time(plan: ServingPlan, target: Target, window: int | None = None) -> ServingTime | None:
    """The static batch's times, from the two functions' step times (None without a time model); a
    step reads at most ``window`` positions of each sequence in the stack (a model of your own's
    ``cache_layout().window``), and at most the ring's window of those in it."""
    prefill, decode = plan.prefill.step_time, plan.decode.step_time
    if prefill is None or decode is None:
        return None
    hardware = cost.Hardware.of(target) or cost.Hardware.host(len(target.devices))
    ring = plan.ring or {"bytes": 0, "window": None}
    per_position = (plan.per_device["kv_cache"] - ring["bytes"]) // plan.serve["max_len"]
    return ServingTime(
        time_to_first_token=prefill.seconds, decode_at_max_len=decode.seconds,
        streamed=hardware.memory_bandwidth * cost.MEMORY_EFFICIENCY,
        weight_bytes=plan.per_device["weights"], kv_bytes_per_position=per_position,
        memory_bandwidth=hardware.memory_bandwidth, batch=plan.serve["batch"],
        prompt_len=plan.serve["prompt_len"], max_len=plan.serve["max_len"], window=window,
        ring_window=ring["window"], ring_bytes_per_position=ring["bytes"] // (ring["window"] or 1),
    )  # fmt: skip


def _capacity(plan: ServingPlan, batch_shards: int, verified: bool = False) -> KVCapacity:
    """The cache's room read off one plan: the budget less the peak's other bytes, in whole sequences
    (``batch_shards``: the devices a batch is split over, each holding its share of the sequences)."""
    figures, serve = plan.per_device, plan.serve
    cache_bytes = plan.margin_bytes + figures["kv_cache"]  # Each function's budget less its other bytes.
    rows = serve["batch"] // batch_shards  # Sequences per device.
    ring = plan.ring["bytes"] if plan.ring else 0
    per_token, per_sequence = (figures["kv_cache"] - ring) // (rows * serve["max_len"]), ring // rows
    sequence = per_sequence + per_token * serve["max_len"]
    if not sequence or cache_bytes <= 0:
        return KVCapacity(max(cache_bytes, 0), per_token, 0, 0, verified, per_sequence)
    past_rings = cache_bytes - rows * per_sequence  # The planned batch's room past its sequences' rings.
    tokens = max(past_rings, 0) // per_token if per_token else 0
    max_len = (tokens // rows if past_rings >= 0 else 0) if per_token else None
    every = plan.every_layer_window  # Past it every layer's positions are a ring of it: any length fits.
    if max_len is not None and every is not None and max_len >= every:
        max_len = None
    return KVCapacity(cache_bytes, per_token, cache_bytes // sequence * batch_shards, max_len, verified,
                      per_sequence, tokens)  # fmt: skip


def search_capacity(config: Config, target: str | None = None) -> ServingPlan:
    """Returns the config's serving plan with its :class:`KVCapacity` found by compiles: the largest
    ``serve.batch`` at ``serve.max_len`` and the longest ``serve.max_len`` at ``serve.batch`` that fit.
    Each starts from two compiled points (the peak is affine in each) and compiles where their line meets
    the budget, then one step past the largest value that fit, until a value that fits and the next one
    that does not bracket the answer (:data:`CAPACITY_COMPILES` at most): near the budget the arguments
    (weights and cache) leave XLA little memory, and it holds the temporaries below the line. Where every
    layer slides, the cache stops growing at the window (it becomes a ring): one compile past it says
    whether any context fits (``max_len`` None), and else the answer lies below it."""
    resolved = make_target(config, target)
    program = serving_program(config, build_mesh(config.mesh.axes, resolved.devices))
    plan = _plan(program, resolved)
    shards = _batch_shards(program)
    s = program.serving

    def compiled(key: str, value: int) -> ServingPlan:
        return _plan(program.variant(f"serve.{key}={value}"), resolved)

    found = {}
    every = plan.every_layer_window
    for key, start, quantum, least in (
        ("batch", s.batch, shards, shards),
        ("max_len", s.max_len, 1, s.prompt_len),
    ):
        points = [(start, plan)]
        if key == "max_len" and every is not None:  # The cache stops growing at the window (a ring).
            past = plan if start > every else compiled(key, every + 1)
            if past.fits:
                found[key] = None  # Any context fits.
                continue
            if start > every:
                start = max(every, least)
                points = [(start, compiled(key, start))]
            points.append((every + 1, past))
        else:
            points.append((2 * start, compiled(key, 2 * start)))
        fits = max((v for v, p in points if p.fits), default=0)
        over = min((v for v, p in points if not p.fits), default=None)
        for _ in range(CAPACITY_COMPILES):
            if over is not None and fits + quantum >= over:
                break  # Bracketed: ``fits`` is the largest.
            guess = room_limit(points[-2:]) // quantum * quantum
            guess = max(guess, fits + quantum) if fits else guess  # Past what fits: is it the largest?
            guess = min(guess, over - quantum) if over is not None else guess
            if guess < least or guess in dict(points):
                break
            points.append((guess, compiled(key, guess)))
            if points[-1][1].fits:
                fits = max(fits, guess)
            else:
                over = guess if over is None else min(over, guess)
        found[key] = fits
    capacity = dataclasses.replace(_capacity(plan, shards), max_batch=found["batch"],
                                   max_len=found["max_len"], verified=True)  # fmt: skip
    return dataclasses.replace(plan, capacity=capacity)


#: Compiles :func:`search_capacity` spends on each answer after its two starting points (each compiles
#: a prefill and a decode step): where the peak is affine, two (the answer, and one step past it).
CAPACITY_COMPILES = 4


def room_limit(points: list[tuple[int, ServingPlan]]) -> int:
    """Where the line through two compiled points leaves no room under the budget: the smaller of the
    prefill's and the decode's answers (each function's room is affine; the smaller of the two need not
    be)."""
    (a, plan_a), (b, plan_b) = points
    answers = [1024 * max(a, b)]  # Where no room shrinks, as far as a guess goes.
    for function in ("prefill", "decode"):
        room_a, room_b = (getattr(plan, function).margin_bytes for plan in (plan_a, plan_b))
        slope = (room_b - room_a) / (b - a)
        if slope < 0:
            answers.append(b - room_b / slope)
    return int(min(answers))


def _batch_shards(program: ServingProgram) -> int:
    """Devices the batch is split over (each holds its share of the sequences and of their cache)."""
    s = program.serving
    return s.batch // s.rows.shard_shape((s.batch,))[0]
