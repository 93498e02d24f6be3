"""Writes what the pages show of shardmem's output from runs of the commands now, so that each page shows
what its commands print:

- the fenced block after a ``<!-- shown-output: shardmem ARGS -->`` line becomes the output of
  ``shardmem ARGS`` (README's and getting-started's plan of llama-7b; the cards page's T4 plan and its
  tune searches);
- the table between ``<!-- shown-table: NAME -->`` and ``<!-- /shown-table -->`` is made again, a
  ``shardmem plan ... --json`` per row (:data:`TABLES`: the cards page's two tables).

    .venv/bin/python scripts/shown_output.py                # rewrite every page (minutes: each is a compile)
    .venv/bin/python scripts/shown_output.py --check        # exit 1 when a page differs from a fresh run
    .venv/bin/python scripts/shown_output.py README.md      # these pages only (README.md, getting-started.md)

``tests/test_readme.py`` runs the check (in CI, on the JAX version the pages were written with). A run's
own figures (the compile's seconds) are not compared.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardmem.units import format_bytes, format_seconds  # noqa: E402

PAGES = (ROOT / "README.md", ROOT / "docs" / "getting-started.md",
         ROOT / "docs" / "guides" / "finetune-cards.md")  # fmt: skip
_OUTPUT = re.compile(r"(<!-- shown-output: shardmem ([^\n]*?) -->\n+```[a-z]*\n)(.*?)(```)", re.S)
_TABLE = re.compile(r"(<!-- shown-table: ([\w-]+) -->\n)(.*?)(<!-- /shown-table -->)", re.S)
_OWN_FIGURES = re.compile(r"^compiled in [\d.]+ s by JAX ", re.M)
#: A plan's exit statuses that are verdicts: fits, does not fit, tight.
_VERDICTS = (0, 3, 5)


@functools.cache
def output(args: str) -> str:
    """What ``shardmem ARGS`` prints on stdout, as the pages show it (no trailing spaces)."""
    done = subprocess.run([sys.executable, "-m", "shardmem", *shlex.split(args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)  # fmt: skip
    if done.returncode not in _VERDICTS:
        raise SystemExit(f"shardmem {args} exited {done.returncode}: {done.stderr[-2000:]}")
    return "".join(line.rstrip() + "\n" for line in done.stdout.splitlines())


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of a generated table: the cells it shows before the figures, and the plan it is."""

    cells: tuple[str, ...]
    config: str
    target: str
    overrides: tuple[str, ...] = ()

    def plan(self) -> dict:
        sets = " ".join(f"--set {shlex.quote(item)}" for item in self.overrides)
        return json.loads(output(f"plan {self.config} --target {self.target} {sets} --json --top 0"))


def _verdict(plan: dict) -> str:
    margin = format_bytes(abs(plan["margin_bytes"]))
    return {"fits": f"fits, {margin} spare", "tight": f"tight, {margin} over the budget",
            "does not fit": f"does not fit, {margin} over"}[plan["verdict"]]  # fmt: skip


def _step(plan: dict) -> str:
    if plan["verdict"] == "does not fit" or not plan["step_time"]:
        return ""
    step = plan["step_time"]
    return f"{format_seconds(step['seconds'])}, {step['tokens_per_second']:,.0f} tokens/s"


def _card_cells(plan: dict) -> tuple[str, ...]:
    peak, budget = plan["per_device"]["peak"], plan["budget_bytes"]
    return format_bytes(peak), format_bytes(budget), _verdict(plan), _step(plan)


def _finetune_cells(plan: dict) -> tuple[str, ...]:
    held = plan["per_device"]
    frozen = format_bytes(held["frozen"]) if held["frozen"] else "0"
    step = format_seconds(plan["step_time"]["seconds"]) if plan["step_time"] else ""
    return (format_bytes(held["params"]), frozen, format_bytes(held["optimizer"]), format_bytes(held["peak"]),
            _verdict(plan), step)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    align: tuple[str, ...]  # Markdown's column alignments ("---", "---:").
    rows: tuple[Row, ...]
    figures: Callable[[dict], tuple[str, ...]]  # A plan's JSON -> the row's figure cells.

    def render(self) -> str:
        lines = [f"| {' | '.join(self.header)} |", f"|{'|'.join(self.align)}|"]
        lines += [f"| {' | '.join((*row.cells, *self.figures(row.plan())))} |" for row in self.rows]
        return "\n".join(lines) + "\n"


GPT2, LLAMA_1B, QLORA = "configs/gpt2-124m.yaml", "configs/llama-1b.yaml", "configs/llama3-8b-qlora.yaml"
ONE_CARD = ("mesh.axes={data: 1, fsdp: 1, tensor: 1}", "mesh.devices_per_host=1")
GPT2_T4 = (*ONE_CARD, "train.global_batch=32", "train.micro_batches=4")
FULL = (*ONE_CARD, "remat.policy=full")

#: The generated tables, by the name their marker gives.
TABLES = {
    "cards": Table(
        ("config, on one card", "overrides", "peak", "budget", "verdict", "predicted step"),
        ("---",) * 6,
        (
            Row(("`gpt2-124m` on `rtx-4090`", "`train.global_batch=32`, `micro_batches=1`"), GPT2, "rtx-4090",
                (*ONE_CARD, "train.global_batch=32", "train.micro_batches=1")),
            Row(("`gpt2-124m` on `t4`", "`global_batch=32`, `micro_batches=4`, `precision.compute=float16`"),
                GPT2, "t4", (*GPT2_T4, "precision.compute=float16")),
            Row(("`gpt2-124m` on `t4`, bf16", "the same in `bfloat16` (with a warning, below)"), GPT2, "t4",
                (*GPT2_T4, "precision.compute=bfloat16")),
            Row(("`llama-1b` on `rtx-4090`", "`global_batch=4`, `remat.policy=full`"), LLAMA_1B, "rtx-4090",
                (*FULL, "train.global_batch=4")),
            Row(("`llama-1b` on `rtx-4090`",
                 "`global_batch=1`, `remat.policy=full`, `optimizer.mu_dtype=bfloat16`"),
                LLAMA_1B, "rtx-4090", (*FULL, "train.global_batch=1", "optimizer.mu_dtype=bfloat16")),
            Row(("`llama-1b` on `l40s`", "`global_batch=8`, `remat.policy=full`"), LLAMA_1B, "l40s",
                (*FULL, "train.global_batch=8")),
            Row(("`llama-1b` on `v100-32g`",
                 "`global_batch=4`, `remat.policy=full`, `precision.compute=float16`"),
                LLAMA_1B, "v100-32g", (*FULL, "train.global_batch=4", "precision.compute=float16")),
        ),
        _card_cells,
    ),
    "finetune": Table(
        ("program", "`--set`", "trainable", "frozen", "optimizer", "peak", "verdict", "predicted step"),
        ("---", "---", "---:", "---:", "---:", "---:", "---", "---:"),
        (
            Row(("full fine-tune", "`'finetune={}'`"), QLORA, "rtx-4090", ("finetune={}",)),
            Row(("LoRA r16 on q/k/v/o, bf16 base", "`finetune.quantize=null`"), QLORA, "rtx-4090",
                ("finetune.quantize=null",)),
            Row(("QLoRA: the same on an NF4 base", "(the config as shipped)"), QLORA, "rtx-4090"),
        ),
        _finetune_cells,
    ),
}  # fmt: skip


def written(text: str) -> str:
    """``text`` with its shown outputs and tables made again from runs now."""
    text = _OUTPUT.sub(lambda m: m[1] + output(m[2]) + m[4], text)
    return _TABLE.sub(lambda m: m[1] + TABLES[m[2]].render() + m[4], text)


def comparable(text: str) -> str:
    return _OWN_FIGURES.sub("compiled in (seconds) s by JAX ", text)


def main(argv: list[str]) -> int:
    names = [a for a in argv if not a.startswith("--")]
    pages = [p for p in PAGES if not names or p.name in names]
    stale = []
    for page in pages:
        text = page.read_text()
        if not _OUTPUT.search(text) and not _TABLE.search(text):
            raise SystemExit(f"{page}: no <!-- shown-output: ... --> or <!-- shown-table: ... --> marker")
        fresh = written(text)
        if "--check" in argv:
            stale += [str(page.relative_to(ROOT))] if comparable(fresh) != comparable(text) else []
        else:
            page.write_text(fresh)
    if stale:
        print(f"what {', '.join(stale)} show is not what the commands print now; run scripts/shown_output.py",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
