"""How far shardmem's logits are from `transformers`' on checkpoints it wrote (BENCHMARKS.md, "Checkpoints
written by `transformers`"): the same models, files and tokens as tests/test_weights.py's test, with each
gap printed, and both against the test file's float64 numpy port of Hugging Face's PyTorch forward.

    PYTHONPATH=. .venv/bin/python scripts/transformers_logits_bench.py
"""

import os
import tempfile
from pathlib import Path

import jax
import numpy as np
import transformers
from safetensors.numpy import load_file

from shardmem import build_mesh, build_program, config_from_dict
from tests import test_weights as tw

jax.config.update("jax_num_cpu_devices", 8)  # As tests/conftest.py: FSDP over 8 simulated devices.

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PORTS = {"llama": tw._hf_llama_logits, "gemma": tw._hf_gemma_logits}
tokens = np.random.default_rng(7).integers(0, tw.V, (8, 16), dtype=np.int32)
print(f"transformers {transformers.__version__}, JAX {jax.__version__}")
models = tw._transformers_models(transformers)
for seed, (name, (model_class, hf_config, section)) in enumerate(models.items()):
    folder = Path(tempfile.mkdtemp())
    reference = np.asarray(tw._transformers_checkpoints(folder, model_class, hf_config, seed)(tokens).logits)
    float64 = PORTS[name](load_file(str(folder / "pt" / "model.safetensors")), tokens)
    print(f"{name}: max |logit| {np.abs(reference).max():.2f}, "
          f"transformers vs float64 {np.abs(reference - float64).max():.2e}")  # fmt: skip
    for layout in ("pt", "flax"):
        for axes in ({"data": 1}, {"fsdp": 8}):
            config = config_from_dict({"model": section, "mesh": {"axes": axes},
                                       "precision": {"compute": "float32"}, "train": {"global_batch": 8},
                                       "finetune": {"init_from": str(folder / layout)}})  # fmt: skip
            devices = jax.devices()[: int(np.prod(list(axes.values())))]
            program = build_program(config, build_mesh(config.mesh.axes, devices))
            got = tw._logits(program, program.init()["params"], tokens)
            print(f"  {layout:4} {axes}: vs transformers {np.abs(got - reference).max():.2e}, "
                  f"vs float64 {np.abs(got - float64).max():.2e}")  # fmt: skip
