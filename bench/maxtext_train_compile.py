"""Runs MaxText's train_compile unchanged and prints every field of the compiled step's memory analysis.

    /path/to/maxtext-venv/bin/python bench/maxtext_train_compile.py compile_topology=v5p-8 ...

Run in MaxText's own environment (MaxText from PyPI, its JAX and libtpu), not shardmem's: this file
imports nothing of shardmem. MaxText prints ``memory_analysis()``, whose text leaves out XLA's
``peak_memory_in_bytes``; this wrapper keeps the compiled object that MaxText's ``jit_and_compile``
returns and prints one line ``MEMORY_STATS_JSON {...}`` with all the fields, which
``bench/maxtext_compare.py`` reads. The arguments are MaxText's, passed through as they are.
"""

import json
import sys

from absl import app
from maxtext.trainers.pre_train import train_compile

_compile = train_compile.jit_and_compile


def _jit_and_compile(*args, **kwargs):
    compiled = _compile(*args, **kwargs)
    stats = compiled.memory_analysis()
    fields = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "temp_size_in_bytes",
        "generated_code_size_in_bytes",
        "host_temp_size_in_bytes",
        "peak_memory_in_bytes",
    )
    print("MEMORY_STATS_JSON " + json.dumps({f: int(getattr(stats, f, 0) or 0) for f in fields}), flush=True)
    return compiled


train_compile.jit_and_compile = _jit_and_compile

if __name__ == "__main__":
    app.run(train_compile.main, argv=[sys.argv[0], *sys.argv[1:]])
