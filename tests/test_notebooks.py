"""The notebooks run top to bottom from a clean kernel (the same check as `pytest --nbmake notebooks`).

Each executed notebook is stored (docs/hooks.py's store_executed) as the copy the documentation site
renders with its outputs, so building the site does not execute them again."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _docs_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (its dataclass needs it)
    spec.loader.exec_module(module)
    return module


def test_notebooks_exist_and_are_stored_without_outputs():
    assert [p.name for p in NOTEBOOKS] == [
        "01_quickstart.ipynb", "02_remat_tradeoffs.ipynb", "03_sharding_tradeoffs.ipynb",
        "04_your_own_model.ipynb", "05_choosing_a_layout.ipynb", "06_finetune_on_a_24gb_card.ipynb",
        "07_serving.ipynb",
    ]  # fmt: skip
    for path in NOTEBOOKS:
        cells = json.loads(path.read_text())["cells"]
        code = [c for c in cells if c["cell_type"] == "code"]
        assert all(not c["outputs"] and c["execution_count"] is None for c in code), path.name
        assert 'jax.config.update("jax_num_cpu_devices", 8)' in "".join(code[0]["source"]), path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})  # fmt: skip
    client.execute()  # Raises CellExecutionError, with the failing cell and its traceback.
    stored = _docs_hooks().store_executed(path, notebook)
    assert any(c.get("outputs") for c in nbformat.read(stored, as_version=4).cells if c.cell_type == "code")
