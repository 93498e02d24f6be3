"""The Python examples of README.md and of the documentation site's pages run as written."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _examples() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
        found += [(f"{page.relative_to(ROOT)}:{i}", code) for i, code in enumerate(blocks)]
    return found


EXAMPLES = _examples()
# README's examples in every run; the docs pages' (a minute or two together) with the slow tests.
PARAMS = [pytest.param(name, code, id=name, marks=[] if name.startswith("README.md:") else [pytest.mark.slow])
          for name, code in EXAMPLES]  # fmt: skip


def test_readme_and_the_guides_have_python_examples():
    names = [name for name, _ in EXAMPLES]
    assert any(n.startswith("README.md:") for n in names)
    assert any(n.startswith("docs/guides/plan.md:") for n in names)  # The Python API's tour.


@pytest.mark.parametrize(("name", "code"), PARAMS)
def test_python_example_runs(tmp_path, name, code):
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # Run where the examples' files may be written.
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "object at 0x" not in result.stdout
    assert "DIFFERS" not in result.stdout and "warning" not in result.stdout  # a clean example
    if "shardmem.plan(" in code:
        assert "peak" in result.stdout
        # Planning keeps the CUDA plugin's C++ start-up complaint quiet. (shardmem.run.training.train
        # from Python still lets JAX print it once when its backends start: a known rough edge.)
        assert "Could not find cuda drivers" not in result.stderr
    for html in re.findall(r'save_html\("([^"]+)"\)', code):
        assert "peak" in (tmp_path / html).read_text()


def test_readme_figures_for_the_shipped_llama_70b_config_are_its_plan():
    # Issue 20, item 14: the pipeline table labelled a global-batch-32, 1-micro-batch row (38.27 GiB) as
    # llama-70b.yaml, which trains 64 sequences in 2 micro-batches (42.31 GiB).
    import shardmem
    from shardmem.units import format_bytes

    text = (ROOT / "docs" / "guides" / "pipeline-parallelism.md").read_text()
    assert not re.search(r"\| [^|]*\(`llama-70b\.yaml`\) \|", text), "a table row still names llama-70b.yaml"
    claim = re.search(r"shipped `llama-70b\.yaml` trains global batch (\d+) in (\d+) micro-batches of \d+: "
                      r"([\d.]+ GiB) peak", text)  # fmt: skip
    assert claim, "the pipeline guide no longer says what the shipped llama-70b.yaml plans at"
    _skip_unless_written_by_this_jax("the guide's peak")
    config = shardmem.load_config(ROOT / "configs" / "llama-70b.yaml")
    assert (config.train.global_batch, config.train.micro_batches) == (int(claim[1]), int(claim[2]))
    report = shardmem.plan(config, count_remat_overhead=False)
    assert format_bytes(report.per_device["peak"]) == claim[3]


def test_getting_started_gives_the_test_suites_figures_readme_gives():
    # Issue 30, item 10: getting-started still said 362 tests in 22 min after README said 461 in 25 min.
    def figures(text: str) -> list[str]:
        said = re.search(r"The main\s+test\s+suite \(.*?\n\n", text, re.S)  # To the paragraph's end.
        assert said, "no sentence on the test suite's size and time"
        return re.findall(r"\d+ tests|\d+ min \d+ s|\d{4}-\d\d-\d\d", said[0])

    readme = figures((ROOT / "README.md").read_text())
    assert len(readme) >= 5, readme
    assert figures((ROOT / "docs" / "getting-started.md").read_text()) == readme


def _skip_unless_written_by_this_jax(what: str) -> None:
    """Skips the test unless this is the JAX version README's figures were made with (its plan output says
    which): another version compiles other buffers and names other scopes."""
    import jax

    version = re.search(r"compiled in [\d.]+ s by JAX (\S+)", (ROOT / "README.md").read_text())
    if version is None or version[1] != jax.__version__:
        pytest.skip(f"{what} is JAX {version[1] if version else '?'}'s own; this is JAX {jax.__version__}")


def _shown_output_check(*pages: str) -> None:
    """Runs ``scripts/shown_output.py --check`` on ``pages`` (their commands again, compared with what the
    pages show), when the pages were written by this JAX version (scope names differ between versions)."""
    _skip_unless_written_by_this_jax("the output shown (scope names differ between versions)")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "shown_output.py"), "--check", *pages],
                          cwd=ROOT, capture_output=True, text=True, timeout=3000)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_real_output_shown_is_what_plan_prints_now():
    # Issue 30, item 10: README's and getting-started's "real output" lacked the step-time block and showed
    # scope names the report no longer gives; scripts/shown_output.py writes them, and checks them here.
    _shown_output_check("README.md", "getting-started.md")


def test_the_cards_page_shows_what_its_plans_and_searches_print_now():
    # Issue 41, item 10: its figures drifted from what the same commands print (gpt2-124m on t4: peak 8.02 vs
    # 8.36 GiB on the page); its tables and outputs are written and checked as README's (a few minutes).
    _shown_output_check("finetune-cards.md")


def test_readme_is_at_most_12_kb():
    # Issue 41, item 10: details belong on the site (docs/), the README is the front page.
    assert len((ROOT / "README.md").read_bytes()) <= 12_000


def test_the_timeline_guide_gives_the_peak_of_the_plan_it_says_it_draws():
    # The guide's picture and text said 47.64 GiB (and "layers (other)" filling it) for the plan of Getting
    # started, which prints 48.91 GiB, most of it the scan's attention and MLP activations.
    plan = re.search(r"^peak +│ ([\d.]+ GiB) │", (ROOT / "docs" / "getting-started.md").read_text(), re.M)
    assert plan, "getting-started no longer shows the llama-7b plan's peak"
    guide = (ROOT / "docs" / "guides" / "timeline.md").read_text()
    assert "the plan of [Getting started]" in guide
    said = set(re.findall(r"([\d.]+ GiB) (?:peak|in the backward pass)", guide))
    assert said == {plan[1]}, said
