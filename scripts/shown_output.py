"""Writes the "Real output" of ``shardmem plan configs/llama-7b.yaml`` into README.md and the getting-started
page, from a run of it now, so that what they show is what the command prints.

    .venv/bin/python scripts/shown_output.py          # rewrite both blocks (about 20 s)
    .venv/bin/python scripts/shown_output.py --check  # exit 1 when a block differs from a fresh run

``tests/test_readme.py`` runs the check (slow tests). A run's own figures (the compile's seconds) are
not compared.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", ROOT / "docs" / "getting-started.md")
COMMAND = ("plan", "configs/llama-7b.yaml")
# The fenced block after the paragraph that introduces it.
_BLOCK = re.compile(r"(Real output [^\n]*\n(?:[^\n]+\n)*?\n```\n)(.*?)(```)", re.S)
_OWN_FIGURES = re.compile(r"^compiled in [\d.]+ s by JAX ", re.M)


def run() -> str:
    """The command's output as the pages show it (no trailing spaces)."""
    done = subprocess.run([sys.executable, "-m", "shardmem", *COMMAND], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"shardmem {' '.join(COMMAND)} exited {done.returncode}: {done.stderr[-2000:]}")
    return "".join(line.rstrip() + "\n" for line in done.stdout.splitlines())


def shown(page: Path) -> str:
    """The output ``page`` shows."""
    match = _BLOCK.search(page.read_text())
    if match is None:
        raise SystemExit(f"{page}: no 'Real output' paragraph followed by a fenced block")
    return match[2]


def comparable(output: str) -> str:
    return _OWN_FIGURES.sub("compiled in (seconds) s by JAX ", output)


def main(argv: list[str]) -> int:
    output = run()
    if "--check" in argv:
        stale = [str(p.relative_to(ROOT)) for p in PAGES if comparable(shown(p)) != comparable(output)]
        if stale:
            print(f"the real output shown in {', '.join(stale)} is not what the command prints now; run "
                  "scripts/shown_output.py", file=sys.stderr)  # fmt: skip
            return 1
        return 0
    for page in PAGES:
        text = page.read_text()
        page.write_text(_BLOCK.sub(lambda m: m[1] + output + m[3], text, count=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
