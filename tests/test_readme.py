"""README's Python examples run as written."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_readme_python_examples_run(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert blocks
    for i, code in enumerate(blocks):
        script = tmp_path / f"example_{i}.py"
        script.write_text(code)
        result = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                                timeout=600)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert "peak" in result.stdout and "object at 0x" not in result.stdout
