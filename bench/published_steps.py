"""Calibration bench: shardmem's predicted step time against published multi-GPU training runs.

    python bench/published_steps.py                  # every row, deviceless (minutes on 2 CPU cores)
    python bench/published_steps.py --only mpt-7b-8xh100 --json out.json
    python bench/published_steps.py --only nemotron4-15b-16xh100 --collective-matmuls   # issue 38 item 3

Plans, for every row of ``shared/reference/published-steps.md``, the closest shardmem config (the
reference Llama model) deviceless for the row's GPUs over its node count, and prints predicted against
published step time with the prediction's breakdown (compute, memory-bound kernels, launches, exposed
communication), then the median and worst ratio. Nothing here is fitted to the rows: the costs are the
step-time model's (shardmem/planning/cost.py) from the targets' specs.

How each row maps (every assumption is in ``ROWS``' ``assumptions`` and printed with its row):

- the model is shardmem's reference Llama: RMSNorm, rotary positions, SwiGLU MLP, no biases. A GELU or
  squared-ReLU MLP of width F becomes a SwiGLU MLP of width 2F/3 (the same matmul FLOPs; the file's
  convention), rounded to an integer; MPT's ALiBi becomes rotary positions (no matmul FLOPs either way).
- MHA is ``n_kv_heads = n_heads``; tied embeddings are ``tie_embeddings``; vocab and sequence as given.
- FSDP full shard over N GPUs is ``mesh.axes.fsdp = N`` over N / 8 hosts of 8 GPUs (``mesh.hosts``),
  ``rules.embed: fsdp``, the batch over fsdp; fp32 weights and bf16 compute unless the row says its
  parameters are bf16: then bf16 weights with fp32 master weights (``precision.master``), as FSDP's
  mixed precision and Megatron's keep them.
- the network is the target's default (h100-sxm: 400 Gb/s per GPU, a100-80g: 200 Gb/s per GPU) unless
  the row states it; mpt-70b-64xa100's "1600 Gb/s per node" is 200 Gb/s per GPU.
- Megatron's (Nemotron's, GPT-3's) tensor parallelism "with sequence parallelism" is every matrix split
  over ``tensor`` and ``rules.residual_seq: tensor`` (norms and residual adds on a quarter of the tokens
  each, docs/guides/sharding.md); its distributed optimizer is ``optimizer.shard_over_data``; its bf16
  model with fp32 main weights is ``precision.master: float32``. Megatron orders ranks tensor, then
  pipeline, then data: the mesh axes ``{data, stage, tensor}`` put tensor inside a node.
- GPT-3's interleaved pipeline (8 stages x 12 virtual stages) is ``pipeline.schedule: interleaved`` with
  ``pipeline.repeats: 12`` over ``mesh.axes.stage: 8`` (one layer per chunk), its 64 micro-batches per
  pipeline ``train.micro_batches: 64``; GPT-3's LayerNorm, biases and learned positions become RMSNorm,
  no biases and rotary positions (no matmul FLOPs either way).
- torchtitan's 2D layout is ``mesh.axes.fsdp: 32`` across nodes and ``tensor: 8`` inside them, its TP
  plan's sequence-parallel norms ``rules.residual_seq: tensor``. Its GPUs are H100s with 96 GB of HBM2e at
  2.4 TB/s at a 500 W power limit: target ``h100-sxm-96g`` (the H100 SXM's row with that memory); no
  clock at 500 W is published, so the matmul rates are the 700 W datasheet's and the row is predicted
  fast by what that leaves out.
- recomputation: "none" is ``remat.policy: none``, "full" is ``full``; torchtitan's selective per-op
  recompute (every second matmul) has no exact policy here: ``minimal`` (saves the projections,
  recomputes the rest) recomputes less.
- the published step is batch / tokens-per-second for the whole cluster (the row's "step ~").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import shardmem  # noqa: E402
from shardmem.config import config_from_dict  # noqa: E402
from shardmem.errors import ShardmemError  # noqa: E402


def _fsdp(gpus: int) -> dict:
    return {
        "axes": {"data": 1, "fsdp": gpus, "tensor": 1},
        "hosts": max(gpus // 8, 1),
        "devices_per_host": min(gpus, 8),
    }


FSDP_RULES = {"batch": ["data", "fsdp"], "embed": "fsdp", "heads": "tensor", "kv_heads": "tensor",
              "mlp": "tensor", "vocab": "tensor"}  # fmt: skip

MPT_7B = {"vocab_size": 50368, "d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32,
          "d_ff": round(2 * 16384 / 3), "seq_len": 2048, "tie_embeddings": True}  # fmt: skip
MPT_70B = {"vocab_size": 50368, "d_model": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 64,
           "d_ff": round(2 * 32768 / 3), "seq_len": 2048, "tie_embeddings": True}  # fmt: skip
LLAMA3_8B = {"vocab_size": 128256, "d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8,
             "d_ff": 14336, "seq_len": 8192, "rope_theta": 500000.0}  # fmt: skip
NEMOTRON4_15B = {"vocab_size": 256000, "d_model": 6144, "n_layers": 32, "n_heads": 48, "n_kv_heads": 8,
                 "d_ff": round(2 * 24576 / 3), "seq_len": 4096}  # fmt: skip
GPT3_175B = {"vocab_size": 51200, "d_model": 12288, "n_layers": 96, "n_heads": 96, "n_kv_heads": 96,
             "d_ff": round(2 * 49152 / 3), "seq_len": 2048}  # fmt: skip
LLAMA3_70B = {"vocab_size": 128256, "d_model": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8,
              "d_ff": 28672, "seq_len": 8192, "rope_theta": 500000.0}  # fmt: skip
#: Megatron's tensor parallelism with sequence parallelism: every matrix split over ``tensor``, the
#: residual stream's tokens too (rules.residual_seq); plain data parallelism over ``data``.
MEGATRON_RULES = {"batch": "data", "embed": None, "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor",
                  "vocab": "tensor", "residual_seq": "tensor"}  # fmt: skip
#: Megatron's runs without recomputation: those rules, the distributed optimizer, bf16 weights with fp32
#: main weights (Megatron's mixed precision).
MEGATRON = {"rules": MEGATRON_RULES, "optimizer": {"name": "adamw", "shard_over_data": True},
            "precision": {"params": "bfloat16", "compute": "bfloat16", "master": "float32"},
            "remat": {"policy": "none"}}  # fmt: skip
MEGATRON_ASSUMPTIONS = (
    "sequence parallelism -> rules.residual_seq: tensor (norms and residuals on a quarter of the tokens; "
    "reduce-scatter + all-gather pairs in place of the tensor-parallel all-reduces)",
    "distributed optimizer -> optimizer.shard_over_data",
    "bf16 model, fp32 main weights and gradients (Megatron's mixed precision) -> precision.params "
    "bfloat16 with precision.master float32 (split over data with the optimizer state)",
)

MPT_MAPPING = ("GELU MLP 16384 -> SwiGLU 10923 (2F/3)", "ALiBi -> rotary", "LayerNorm -> RMSNorm")

# id: (published step seconds, target, config sections, assumptions)
ROWS: dict[str, tuple[float, str, dict, tuple[str, ...]]] = {
    "mpt-7b-8xh100": (
        48 * 2048 / 85144,
        "h100-sxm",
        {
            "model": MPT_7B,
            "mesh": _fsdp(8),
            "rules": FSDP_RULES,
            "remat": {"policy": "none"},
            "train": {"global_batch": 48, "micro_batches": 1},
        },
        MPT_MAPPING,
    ),
    "mpt-70b-128xh100": (
        1024 * 2048 / 135490,
        "h100-sxm",
        {
            "model": MPT_70B,
            "mesh": _fsdp(128),
            "rules": FSDP_RULES,
            "remat": {"policy": "full"},
            "train": {"global_batch": 1024, "micro_batches": 1},
        },
        (
            "GELU MLP 32768 -> SwiGLU 21845 (2F/3)",
            "ALiBi -> rotary",
            "LayerNorm -> RMSNorm",
            "network not stated: h100-sxm's default, 400 Gb/s per GPU",
        ),
    ),
    "mpt-70b-64xa100": (
        2048 * 2048 / 26274,
        "a100-80g",
        {
            "model": MPT_70B,
            "mesh": _fsdp(64),
            "rules": FSDP_RULES,
            "remat": {"policy": "full"},
            "precision": {"params": "bfloat16", "compute": "bfloat16", "master": "float32"},
            "interconnect": {"network": "200Gb/s"},
            "train": {"global_batch": 2048, "micro_batches": 4},
        },
        (
            "GELU MLP 32768 -> SwiGLU 21845 (2F/3)",
            "ALiBi -> rotary",
            "LayerNorm -> RMSNorm",
            "params/grads bf16 (FSDP's fp32 shards) -> precision.params bfloat16, precision.master float32",
            "1600 Gb/s per node -> 200 Gb/s per GPU",
        ),
    ),
    "llama3-8b-64xa100": (
        64 * 8192 / (2973 * 64),
        "a100-80g",
        {
            "model": LLAMA3_8B,
            "mesh": _fsdp(64),
            "rules": FSDP_RULES,
            "remat": {"policy": "minimal"},
            "train": {"global_batch": 64, "micro_batches": 1},
        },
        (
            "selective per-op recompute (every second matmul) -> remat minimal (recomputes less)",
            "network not stated: a100-80g's default, 200 Gb/s per GPU",
        ),
    ),
    "nemotron4-15b-16xh100": (
        64 * 4096 / 92630,
        "h100-sxm",
        {
            **MEGATRON,
            "model": NEMOTRON4_15B,
            "mesh": {"axes": {"data": 4, "fsdp": 1, "tensor": 4}, "hosts": 2, "devices_per_host": 8},
            "train": {"global_batch": 64, "micro_batches": 4},
        },
        (
            "squared-ReLU MLP 24576 (no gate) -> SwiGLU 16384 (2F/3)",
            "LayerNorm -> RMSNorm",
            *MEGATRON_ASSUMPTIONS,
        ),
    ),
    "gpt3-175b-128xh100": (
        256 * 2048 / 58843,
        "h100-sxm",
        {
            **MEGATRON,
            "model": GPT3_175B,
            "mesh": {"axes": {"data": 4, "stage": 8, "tensor": 4}, "hosts": 16, "devices_per_host": 8},
            "rules": {**MEGATRON_RULES, "layers": "stage"},
            "pipeline": {"schedule": "interleaved", "repeats": 12},
            "train": {"global_batch": 256, "micro_batches": 64},
        },
        (
            "GELU MLP 49152 -> SwiGLU 32768 (2F/3)",
            "LayerNorm with biases -> RMSNorm, no biases; learned positions -> rotary",
            "pipeline 8 x 12 virtual stages (interleaved 1F1B) -> mesh.axes.stage 8, pipeline.schedule "
            "interleaved, pipeline.repeats 12 (one layer per chunk); 64 micro-batches of one sequence",
            "tensor 4 within a node, then pipeline, then data (Megatron's rank order) -> mesh.axes "
            "{data: 4, stage: 8, tensor: 4} over 16 hosts of 8",
            *MEGATRON_ASSUMPTIONS,
        ),
    ),
    "llama3-70b-256xh100-2d": (
        512 * 8192 / (597.3 * 256),
        "h100-sxm-96g",
        {
            "model": LLAMA3_70B,
            "mesh": {"axes": {"data": 1, "fsdp": 32, "tensor": 8}, "hosts": 32, "devices_per_host": 8},
            "rules": {**FSDP_RULES, "residual_seq": "tensor"},
            "remat": {"policy": "full"},
            "train": {"global_batch": 512, "micro_batches": 1},
        },
        (
            "torchtitan's TP plan (norms sequence-parallel) -> rules.residual_seq: tensor, tensor 8 "
            "within a node, FSDP 32 across nodes",
            "FSDP2 mixed precision (fp32 shards, bf16 compute) -> precision.params float32, compute bfloat16",
            "H100 96GB HBM2e at 500 W (Grand Teton) -> target h100-sxm-96g: 96 GiB at 2.4 TB/s, 400 Gb/s "
            "per GPU; matmul rates of the 700 W datasheet (none is published at 500 W): predicted fast",
        ),
    ),
}


def config_for(row_id: str, collective_matmuls: bool = False, compiler_options: dict | None = None):
    """Returns the shardmem Config and target for one row; ``collective_matmuls`` sets
    ``overlap.tensor_parallel`` on the rows with sequence parallelism and no pipeline (Megatron's
    ``tp_comm_overlap``), ``compiler_options`` adds XLA options (``memory.compiler_options``)."""
    _, target, sections, _ = ROWS[row_id]
    memory = {"target": target, "compiler_options": compiler_options or {}}
    base = {"precision": {"params": "float32", "compute": "bfloat16"}, "optimizer": {"name": "adamw"},
            "memory": memory}  # fmt: skip
    sequence_parallel = "residual_seq" in sections.get("rules", {}) and "pipeline" not in sections
    overlap = {"overlap": {"tensor_parallel": True}} if collective_matmuls and sequence_parallel else {}
    return config_from_dict({**base, **sections, **overlap, "name": row_id}), target


def plan_row(row_id: str, collective_matmuls: bool = False, compiler_options: dict | None = None) -> dict:
    """Plans one row (see :func:`config_for` for the options); returns its figures (or the reason it could
    not be planned)."""
    published, target, _, assumptions = ROWS[row_id]
    start = time.perf_counter()
    try:
        config, target = config_for(row_id, collective_matmuls, compiler_options)
        report = shardmem.plan(config, target=target, count_remat_overhead=False)
    except ShardmemError as e:
        return {"id": row_id, "error": str(e), "assumptions": assumptions}
    st = report.step_time
    return {
        "id": row_id, "published_seconds": published, "predicted_seconds": st.seconds,
        "ratio": st.seconds / published, "breakdown": st.breakdown(), "mfu": st.mfu, "hfu": st.hfu,
        "peak_gib": report.per_device["peak"] / 2**30, "fits": report.fits, "verdict": report.verdict,
        "budget_gib": report.budget_bytes / 2**30, "usable_gib": report.usable_bytes / 2**30,
        "plan_seconds": time.perf_counter() - start, "assumptions": assumptions,
    }  # fmt: skip


def _verdict(result: dict) -> str:
    return (f"{result['verdict']}: budget {result['budget_gib']:.1f} GiB, usable "
            f"{result['usable_gib']:.1f} GiB")  # fmt: skip


def _utilization(result: dict) -> str:
    # MFU needs the FLOPs without recomputation, a second compile that plan_row skips; HFU counts it.
    if result["mfu"] is not None:
        return f"MFU {result['mfu']:.1%}; "
    return f"HFU {result['hfu']:.1%}; " if result["hfu"] is not None else ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", action="append", choices=sorted(ROWS), help="plan only this row (repeatable)"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    overlap = "overlap.tensor_parallel: true on the sequence-parallel rows without a pipeline"
    parser.add_argument("--collective-matmuls", action="store_true", help=overlap)
    xla = "an XLA option for every compile, e.g. xla_gpu_memory_limit_slop_factor=200"
    parser.add_argument("--xla", action="append", default=[], metavar="OPTION=VALUE", help=xla)
    args = parser.parse_args(argv)
    options = {}
    for option in args.xla:
        name, _, value = option.partition("=")
        options[name] = yaml.safe_load(value)
    results = []
    print(f"{'row':24} {'published':>9} {'predicted':>9} {'ratio':>6}  breakdown (s)")
    for row_id in args.only or ROWS:
        result = plan_row(row_id, args.collective_matmuls, options)
        results.append(result)
        if "error" in result:
            print(f"{row_id:24} cannot be planned: {result['error']}")
            continue
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in result["breakdown"].items() if v)
        print(f"{row_id:24} {result['published_seconds']:9.3f} {result['predicted_seconds']:9.3f} "
              f"{result['ratio']:6.2f}  {parts}; peak {result['peak_gib']:.1f} GiB"
              f"{'' if result['fits'] else ' (' + _verdict(result) + ')'}; {_utilization(result)}"
              f"planned in {result['plan_seconds']:.0f} s", flush=True)  # fmt: skip
        for assumption in result["assumptions"]:
            print(f"{'':26}assumes: {assumption}")
    ratios = [r["ratio"] for r in results if "ratio" in r]
    if ratios:
        worst = max(ratios, key=lambda r: abs(r - 1))
        print(f"predicted / published over {len(ratios)} rows: median {statistics.median(ratios):.2f}, "
              f"worst {worst:.2f} (bars: within 15% median, 35% worst)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
