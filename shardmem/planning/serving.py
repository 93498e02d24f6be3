"""The serving plan: the serving program's prefill and decode compiled for a target, and what each needs.

    serving = plan_serving(load_config("configs/llama-7b.yaml"), "h100-sxm")   # its serve: section
    serving.prefill, serving.decode        # a MemoryReport of each function, as plan gives the step's
    serving.per_device                     # weights, KV cache, each one's temporaries and peak
    print(render_serving(serving))         # shardmem plan CONFIG --serve

Nothing the size of the model is allocated: the prefill (the prompts -> first logits and a new KV cache)
and the decode step (one token per sequence, the cache donated and updated in place) are compiled on
abstract arguments by :func:`~shardmem.planning.memory.plan_program`, deviceless for named GPUs and TPUs.
A static batch runs one function at a time, so serving fits when each of them does; its peak is the larger
of the two (the prefill's holds its cache as an output, the decode's as a donated argument).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardmem.config import Config
from shardmem.parallel.mesh import build_mesh
from shardmem.planning.memory import MemoryReport, make_target, plan_program
from shardmem.program.serving import serving_program

#: Verdicts from best to worst: a plan of several functions has its worst one's.
_VERDICTS = ("fits", "tight", "does not fit")


@dataclasses.dataclass(frozen=True)
class ServingPlan:
    """The prefill's and the decode step's reports for one ``serve:`` section on one target."""

    prefill: MemoryReport
    decode: MemoryReport
    serve: dict[str, Any]  # The serve section planned: batch, prompt_len, max_len, kv_dtype, quantize.

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
    def fits(self) -> bool:
        """Whether both functions fit the budget."""
        return self.prefill.fits and self.decode.fits

    @property
    def verdict(self) -> str:
        """The worse of the two functions' verdicts: ``"fits"``, ``"tight"`` or ``"does not fit"``."""
        return max(self.prefill.verdict, self.decode.verdict, key=_VERDICTS.index)

    def to_json(self) -> dict[str, Any]:
        """Returns the plan as plain JSON-ready data (``shardmem plan --serve --json``)."""
        return {
            "name": self.decode.name.removesuffix(": decode"),
            "target": self.decode.target,
            "serve": self.serve,
            "per_device": self.per_device,
            "budget_bytes": self.decode.budget_bytes,
            "fits": self.fits,
            "verdict": self.verdict,
            "prefill": self.prefill.to_json(),
            "decode": self.decode.to_json(),
        }


def plan_serving(config: Config, target: str | None = None, *, top: int = 10) -> ServingPlan:
    """Compiles the config's serving program (its ``serve:`` section) for ``target`` (default
    ``memory.target``) and returns the :class:`ServingPlan` of its prefill and decode."""
    resolved = make_target(config, target)
    program = serving_program(config, build_mesh(config.mesh.axes, resolved.devices))
    reports = {}
    for function in ("prefill", "decode"):
        report, _ = plan_program(program, resolved, function=function, top=top)
        reports[function] = dataclasses.replace(report, name=f"{config.name}: {function}")
    s = program.serving
    quantize = config.serve.quantize
    serve = {"batch": s.batch, "prompt_len": s.prompt_len, "max_len": s.max_len, "kv_dtype": s.kv_dtype,
             "quantize": dataclasses.asdict(quantize) if quantize else None}  # fmt: skip
    return ServingPlan(reports["prefill"], reports["decode"], serve)
