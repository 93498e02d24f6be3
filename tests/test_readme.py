"""README's Python examples run as written."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_readme_python_examples_run(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert blocks
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # Run where the examples' files may be written.
    for i, code in enumerate(blocks):
        script = tmp_path / f"example_{i}.py"
        script.write_text(code)
        result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                                timeout=600)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert "peak" in result.stdout and "object at 0x" not in result.stdout
        assert "DIFFERS" not in result.stdout and "warning" not in result.stdout  # a clean example
        assert "Could not find cuda drivers" not in result.stderr
    assert "peak" in (tmp_path / "llama-7b-4-layers.html").read_text()
