"""What a quantized frozen base costs in accuracy (BENCHMARKS.md, "Fine-tuning on a quantized base").

Pretrains the tiny model for PRETRAIN steps on the synthetic stream, exports it to safetensors, then
LoRA-fine-tunes it (rank 8 on every matrix of the layers, the rest frozen) for STEPS steps on the same
stream from a bf16, int8, int4 and nf4 base, and prints each base's loss before and after.

    PYTHONPATH=. .venv/bin/python scripts/finetune_quant_bench.py [PRETRAIN] [STEPS]
"""

import sys
import tempfile

import jax
import numpy as np

from shardmem import build_mesh, build_program, config_from_dict
from shardmem.finetune.export import export_safetensors
from shardmem.run.data import batch_stream

PRETRAIN, STEPS = (int(a) for a in (sys.argv[1:] + ["150", "200"])[:2])
BASE = {"model": {"preset": "tiny"}, "mesh": {"axes": {"data": 1}}, "precision": {"compute": "bfloat16"},
        "optimizer": {"learning_rate": 3e-3, "weight_decay": 0.0, "warmup_steps": 10}}  # fmt: skip


def run(config, steps, seed):
    program = build_program(config, build_mesh(config.mesh.axes, jax.devices()[:1]))
    batches = batch_stream(config, program)
    state = program.init()
    eval_batch = batch_stream(config.replace(f"train.seed={seed + 1000}"), program)(0)
    first = float(program.step(jax.tree.map(lambda x: x.copy(), state), eval_batch)[1]["loss"])
    losses = []
    for step in range(steps):
        state, metrics = program.step(state, batches(step))
        losses.append(float(metrics["loss"]))
    last = float(program.step(jax.tree.map(lambda x: x.copy(), state), eval_batch)[1]["loss"])
    return program, state, first, last, np.mean(losses[-10:])


with tempfile.TemporaryDirectory() as folder:
    pretrain = config_from_dict({**BASE, "train": {"global_batch": 16, "steps": PRETRAIN, "seed": 0}})
    program, state, _, loss, _ = run(pretrain, PRETRAIN, 0)
    export_safetensors(program, state, folder, dtype=np.float32)
    print(f"pretrained {PRETRAIN} steps: held-out loss {loss:.4f}")
    for base in ("bf16", "int8", "int4", "nf4"):
        finetune = {"init_from": folder, "base_dtype": "bfloat16",
                    "lora": {"rank": 8, "alpha": 16, "targets": ["layers/w*"]}}  # fmt: skip
        if base != "bf16":
            finetune["quantize"] = {"format": base, "group": 64, "targets": ["layers/w*"]}
        config = config_from_dict({**BASE, "train": {"global_batch": 16, "steps": STEPS, "seed": 1},
                                   "finetune": finetune})  # fmt: skip
        _, _, before, after, train_loss = run(config, STEPS, 1)
        print(
            f"{base:5s} base: held-out loss {before:.4f} before, {after:.4f} after {STEPS} LoRA steps "
            f"(train loss, last 10 steps: {train_loss:.4f})"
        )
