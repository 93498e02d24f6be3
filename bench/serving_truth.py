"""Serving bench: shardmem's deviceless serving plan against published static-batch inference figures.

    python bench/serving_truth.py                  # every row on a100-80g, other published rows, the RTX 3090
                                                   # KV check, 70B timing, the KV cache's dtypes
    python bench/serving_truth.py --only truth --json out.json
    python bench/serving_truth.py --only kv        # Llama 2 7B's decode with an fp16 and an int8 cache

Four checks (issue 39) and a comparison, nothing fitted to them: the times are the step-time model's
(shardmem/planning/cost.py) on the targets' specs, the memory is the compiled programs'.

1. ``truth``: every row of ``shared/reference/serving-truth.md`` (TensorRT-LLM's and lmdeploy's A100
   static-batch figures) planned with ``plan --serve`` for ``a100-80g``: predicted time to first token
   and output tokens/s against the published ones, then the median and worst ratio of each (bars:
   within 20% median, 40% worst). A row's output of N tokens is ``serve.max_len = input + N - 1`` (the
   prefill's token, then N - 1 decode steps); the row without an output length (GPT-J at batch 1) is
   given 128, as its neighbour. Output tokens/s is every sequence's new tokens over the whole batch's
   time, prefill included (lmdeploy says so of its figures; TensorRT-LLM's static-batch benchmark
   times the whole generation).
2. ``rtx3090``: Llama-3.1-8B in bf16 on ``rtx-3090`` with ``--memory-fraction 0.9`` at 20,000 positions
   (vLLM issue #10517's start-up log: KV cache 3.81 GiB; 2.89 GiB at 29,000): the plan's KV room against
   it, a prefill of 19,968 (28,928) tokens standing for vLLM's profiling forward of 20,000 (29,000).
3. ``others``: published static-batch runs beyond that file, checked the same way: TensorRT-LLM's
   performance page (``docs/source/performance.md``) on A100 80GB in fp16: its "Peak Throughput" table
   (v0.6.1; batches of 52 to 1,280, tensor 1 to 8) and its "Low Latency" first-token table (v0.5, batch
   1) for the rows ``serving-truth.md`` does not already hold. The throughput table's A100 figures are
   read as per GPU, as its H100 table's header says ("out tok/s/GPU"): read as totals, Llama 70B at
   tensor 4 would run 1,280 sequences of 128 + 128 tokens in 245 s, six times what their FLOPs take at
   the four A100s' peak (about 38 s). Each row's plan also gives its memory verdict on the 80 GB card,
   where TensorRT-LLM ran it. Falcon 180B becomes the reference Llama at its sizes (80 layers, hidden
   14,848, 232 heads of 64 over 8 KV heads, vocab 65,024), its GELU MLP of width 59,392 a SwiGLU of two
   thirds (39,595) rounded up to a multiple of 512 (each of 8 tensor shards a multiple of 64: 39,936,
   0.6% more weights), its parallel attention and MLP run one after the other.
4. ``speed``: the wall and CPU time of ``shardmem plan --serve`` for Llama 3 70B at tensor 8 on
   ``h100-sxm`` (bar: under 30 s on the idle 2-core machine; the load average is printed beside it). The
   first plan of a model generates its kernels; later ones reuse them from the kernel cache
   (``SHARDMEM_KERNEL_CACHE``; ``off`` or an empty folder times a first plan). ``kernels``: the same
   plan's kernels, launched and distinct (the distinct ones are what a first plan generates).
5. ``kv``: Llama 2 7B on ``a100-80g`` at four static batches (``KV_SHAPES``), its KV cache in fp16 and in
   int8: each plan's decode temporaries, first and last decode step against their HBM bounds, and output
   tokens/s (no published figure: what storing the cache in int8 buys, as the plan predicts it).

How the models map: GPT-J 6B becomes the reference Llama with its sizes (28 layers, hidden 4096, 16
heads of 256, vocab 50,400), its GELU MLP of width 16,384 a SwiGLU MLP of width 10,944 (two thirds, the
calibration bench's convention, 10,923, rounded up to a multiple of 64: XLA pads an odd width's weight
at every step, a copy GPT-J's aligned 16,384 never needs; 0.2% more weights), its parallel attention and
MLP run one after the other (the same kernels), its biases dropped (4 vectors a layer). Llama 2 7B is the
``llama-7b`` preset; Llama-3.1-8B and Llama 3 70B are Llama 2's sizes with 128,256 tokens, 8 KV heads
(8B: MLP 14,336) and RoPE theta 500,000. Weights and KV cache in fp16 (A100 rows) or bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shardmem.config import config_from_dict  # noqa: E402
from shardmem.planning.serving import plan_serving, with_memory_fraction  # noqa: E402

GIB = 1 << 30

MODELS = {
    "gpt-j-6b": {"vocab_size": 50400, "d_model": 4096, "n_layers": 28, "n_heads": 16, "n_kv_heads": 16,
                 "head_dim": 256, "d_ff": 10944, "seq_len": 2048},
    "llama-2-7b": {"preset": "llama-7b"},
    "llama-3.1-8b": {"preset": "llama-7b", "vocab_size": 128256, "n_kv_heads": 8, "d_ff": 14336,
                     "rope_theta": 500000.0, "seq_len": 131072},
    "llama-3-70b": {"preset": "llama-70b", "vocab_size": 128256, "rope_theta": 500000.0},
    "llama-2-70b": {"preset": "llama-70b"},
    "falcon-180b": {"vocab_size": 65024, "d_model": 14848, "n_layers": 80, "n_heads": 232, "n_kv_heads": 8,
                    "head_dim": 64, "d_ff": 39936, "seq_len": 4096},
}  # fmt: skip

# (id, model, batch, input, output, published: {ttft seconds, output tokens/s, decode step seconds}).
ROWS = [
    ("gptj-6b-a100-bs1", "gpt-j-6b", 1, 128, 128, {"ttft": 12.5e-3, "tokens_per_second": 111}),
    ("gptj-6b-a100-bs64", "gpt-j-6b", 64, 128, 128, {"ttft": 481e-3, "tokens_per_second": 3679}),
    ("llama2-7b-a100-bs64", "llama-2-7b", 64, 128, 128, {"tokens_per_second": 3486}),
    ("llama2-7b-a100-bs32-long", "llama-2-7b", 32, 2048, 128, {"tokens_per_second": 529}),
    ("llama2-7b-a100-ttft-128", "llama-2-7b", 1, 128, 128, {"ttft": 16e-3}),
    ("llama2-7b-a100-ttft-2048", "llama-2-7b", 1, 2048, 2048, {"ttft": 133e-3}),
    ("llama2-7b-a100-lmdeploy-short", "llama-2-7b", 1, 128, 128,
     {"ttft": 22e-3, "tokens_per_second": 102.21, "decode": 10e-3}),
    ("llama2-7b-a100-lmdeploy-long", "llama-2-7b", 1, 2048, 2048,
     {"ttft": 140e-3, "tokens_per_second": 93.78, "decode": 11e-3}),
]  # fmt: skip


# TensorRT-LLM's performance page, A100 80GB fp16 (see the docstring): (id, model, tensor, batch, input,
# output, published: {output tokens/s per GPU, or ttft seconds}); a first-token row's output is 1 token.
OTHERS = [
    ("trtllm061-gptj-512-128-128", "gpt-j-6b", 1, 512, 128, 128, {"tokens_per_gpu": 6374}),
    ("trtllm061-gptj-120-128-2048-tp2", "gpt-j-6b", 2, 120, 128, 2048, {"tokens_per_gpu": 2192}),
    ("trtllm061-gptj-60-2048-128", "gpt-j-6b", 1, 60, 2048, 128, {"tokens_per_gpu": 670}),
    ("trtllm061-gptj-64-2048-2048-tp2", "gpt-j-6b", 2, 64, 2048, 2048, {"tokens_per_gpu": 903}),
    ("trtllm061-llama7b-384-128-128", "llama-2-7b", 1, 384, 128, 128, {"tokens_per_gpu": 5586}),
    ("trtllm061-llama7b-60-128-2048", "llama-2-7b", 1, 60, 128, 2048, {"tokens_per_gpu": 1928}),
    ("trtllm061-llama7b-52-2048-128", "llama-2-7b", 1, 52, 2048, 128, {"tokens_per_gpu": 591}),
    ("trtllm061-llama7b-64-2048-2048-tp2", "llama-2-7b", 2, 64, 2048, 2048, {"tokens_per_gpu": 782}),
    ("trtllm061-llama70b-1280-128-128-tp4", "llama-2-70b", 4, 1280, 128, 128, {"tokens_per_gpu": 670}),
    ("trtllm061-llama70b-240-128-2048-tp4", "llama-2-70b", 4, 240, 128, 2048, {"tokens_per_gpu": 525}),
    ("trtllm061-llama70b-120-2048-128-tp4", "llama-2-70b", 4, 120, 2048, 128, {"tokens_per_gpu": 79}),
    ("trtllm061-falcon180b-1024-128-128-tp8", "falcon-180b", 8, 1024, 128, 128, {"tokens_per_gpu": 232}),
    ("trtllm061-falcon180b-128-128-2048-tp8", "falcon-180b", 8, 128, 128, 2048, {"tokens_per_gpu": 180}),
    ("trtllm05-gptj-ttft-2048", "gpt-j-6b", 1, 1, 2048, 1, {"ttft": 129e-3}),
    ("trtllm05-llama70b-ttft-128-tp4", "llama-2-70b", 4, 1, 128, 1, {"ttft": 47e-3}),
    ("trtllm05-llama70b-ttft-2048-tp4", "llama-2-70b", 4, 1, 2048, 1, {"ttft": 377e-3}),
    ("trtllm05-falcon180b-ttft-128-tp8", "falcon-180b", 8, 1, 128, 1, {"ttft": 61e-3}),
    ("trtllm05-falcon180b-ttft-2048-tp8", "falcon-180b", 8, 1, 2048, 1, {"ttft": 509e-3}),
]  # fmt: skip


def _config(model: str, batch: int, prompt: int, max_len: int, target: str, dtype: str, tensor: int = 1,
            kv_dtype: str | None = None):  # fmt: skip
    return config_from_dict({
        "name": f"{model}-b{batch}-{prompt}-{max_len}",
        "model": {**MODELS[model], "attention": "auto"},
        "mesh": {"axes": {"data": 1, "tensor": tensor}},
        "precision": {"params": dtype, "compute": dtype},
        "serve": {"batch": batch, "prompt_len": prompt, "max_len": max_len, "kv_dtype": kv_dtype},
        "memory": {"target": target},
    })  # fmt: skip


def truth() -> dict:
    """Every serving-truth row planned on a100-80g: predicted against published, and the ratios."""
    plans, rows = {}, []
    for row, model, batch, prompt, output, published in ROWS:
        key = (model, batch, prompt, prompt + output - 1)
        if key not in plans:  # Rows of the same shape share a plan.
            started = time.perf_counter()
            plans[key] = plan_serving(_config(*key, "a100-80g", "float16"))
            print(f"planned {row} in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        t = plans[key].time
        predicted = {"ttft": t.time_to_first_token, "tokens_per_second": t.output_tokens_per_second,
                     "decode": t.mean_decode_seconds}  # fmt: skip
        for figure, value in published.items():
            rows.append({"row": row, "figure": figure, "published": value, "predicted": predicted[figure],
                         "ratio": predicted[figure] / value,
                         "decode_bound": t.bound_seconds((t.contexts[0] + t.contexts[1]) // 2),
                         "mean_decode": t.mean_decode_seconds})  # fmt: skip
    return {"rows": rows, "summary": _summary(rows, ("ttft", "tokens_per_second", "decode"),
                                              headline=("ttft", "tokens_per_second"))}  # fmt: skip


def _summary(rows: list[dict], figures: tuple[str, ...], headline: tuple[str, ...]) -> dict:
    """The median and worst |ratio - 1| of each figure's rows, and of the ``headline`` figures' together."""
    summary = {}
    for figure in figures:
        errors = [abs(r["ratio"] - 1) for r in rows if r["figure"] == figure]
        if errors:
            summary[figure] = {"median_error": statistics.median(errors), "worst_error": max(errors),
                               "rows": len(errors)}  # fmt: skip
    every = [abs(r["ratio"] - 1) for r in rows if r["figure"] in headline]
    summary["headline"] = {"median_error": statistics.median(every), "worst_error": max(every)}
    return summary


def others() -> dict:
    """TensorRT-LLM's other A100 rows planned on a100-80g: predicted against published, the ratios, and
    each plan's memory verdict where TensorRT-LLM ran the batch."""
    rows = []
    for row, model, tensor, batch, prompt, output, published in OTHERS:
        started = time.perf_counter()
        plan = plan_serving(_config(model, batch, prompt, prompt + output - 1, "a100-80g", "float16", tensor))
        t = plan.time
        predicted = {"ttft": t.time_to_first_token, "tokens_per_gpu": t.output_tokens_per_second / tensor}
        ((figure, value),) = published.items()
        rows.append({"row": row, "figure": figure, "published": value, "predicted": predicted[figure],
                     "ratio": predicted[figure] / value, "verdict": plan.verdict,
                     "peak_gib": plan.per_device["peak"] / GIB, "mean_decode": t.mean_decode_seconds,
                     "decode_bound": t.bound_seconds((t.contexts[0] + t.contexts[1]) // 2)})  # fmt: skip
        print(f"planned {row} in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    figures = ("ttft", "tokens_per_gpu")
    return {"rows": rows, "summary": _summary(rows, figures, headline=figures)}


def rtx3090() -> dict:
    """Llama-3.1-8B bf16 on an RTX 3090 at memory fraction 0.90: the KV room at 20,000 and 29,000 positions
    against vLLM's log (3.81 GiB; 2.89 GiB)."""
    out = {}
    for max_len, vllm_gib, blocks in ((20000, 3.81, 1952), (29000, 2.89, 1478)):
        # vLLM profiles one forward of max_num_batched_tokens (max_model_len) tokens; the prefill here takes
        # the nearest length the flash kernel's blocks of 128 tile, with room for max_len positions.
        prompt = max_len // 128 * 128
        config = _config("llama-3.1-8b", 1, prompt, max_len, "rtx-3090", "bfloat16")
        plan = plan_serving(with_memory_fraction(config, 0.9))
        room, figures = plan.capacity, plan.per_device
        out[max_len] = {"budget_gib": plan.budget_bytes / GIB, "weights_gib": figures["weights"] / GIB,
                        "prefill_temp_gib": figures["prefill_temp"] / GIB,
                        "decode_temp_gib": figures["decode_temp"] / GIB,
                        "peak_without_cache_gib": (figures["peak"] - figures["kv_cache"]) / GIB,
                        "kv_room_gib": room.cache_bytes / GIB, "tokens": room.tokens, "vllm_gib": vllm_gib,
                        "vllm_tokens": blocks * 16, "ratio": room.cache_bytes / GIB / vllm_gib}  # fmt: skip
    return out


#: The timed plan: Llama 3 70B at tensor 8 on h100-sxm (``speed`` and ``kernels``).
SPEED = {"name": "llama3-70b-tp8", "model": {**MODELS["llama-3-70b"], "attention": "auto"},
         "mesh": {"axes": {"data": 1, "tensor": 8}},
         "precision": {"params": "bfloat16", "compute": "bfloat16"},
         "serve": {"batch": 8, "prompt_len": 512, "max_len": 2048},
         "memory": {"target": "h100-sxm"}}  # fmt: skip


def speed() -> dict:
    """Wall time of `shardmem plan --serve` for Llama 3 70B at tensor 8 on h100-sxm, in a fresh process."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "llama3-70b-tp8.yaml"
        path.write_text(yaml.safe_dump(SPEED))
        load = os.getloadavg()[0]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "shardmem", "plan", str(path), "--serve", "--json"],
                              capture_output=True, text=True, cwd=ROOT)  # fmt: skip
        seconds = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # On a loaded machine the wall time is the load's; the CPU time is about what an idle one would take.
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if done.returncode not in (0, 3, 5):
        raise SystemExit(done.stderr[-2000:])
    plan = json.loads(done.stdout)
    return {"seconds": seconds, "cpu_seconds": cpu, "load_average_before": load,
            "load_average_after": os.getloadavg()[0],
            "compile_seconds": {f: plan[f]["compile_seconds"] for f in ("prefill", "decode")},
            "verdict": plan["verdict"], "time": plan["time"]}  # fmt: skip


def kernels() -> dict:
    """The same plan, in this process: per function, the kernels a run launches and the distinct ones
    XLA compiles (what a first plan generates code for; ``HloModule.kernels``), and the compile's time."""
    plan = plan_serving(config_from_dict(SPEED))
    return {f: {"launched": r.step_time.kernels, "compiled": len(r.module.kernels()),
                "compile_seconds": r.compile_seconds}
            for f, r in (("prefill", plan.prefill), ("decode", plan.decode))}  # fmt: skip


#: ``kv``'s static batches of Llama 2 7B: (batch, prompt length, positions per sequence).
KV_SHAPES = ((1, 128, 2048), (8, 512, 2048), (32, 2048, 4096), (64, 128, 256))


def kv_dtypes() -> dict:
    """Llama 2 7B's decode on a100-80g with its KV cache in fp16 and in int8, at each of ``KV_SHAPES``."""
    rows = []
    for batch, prompt, max_len in KV_SHAPES:
        for dtype in ("float16", "int8"):
            plan = plan_serving(_config("llama-2-7b", batch, prompt, max_len, "a100-80g", "float16",
                                        kv_dtype=dtype))  # fmt: skip
            t = plan.time
            first, last = t.contexts
            rows.append({"batch": batch, "prompt_len": prompt, "max_len": max_len, "kv_dtype": dtype,
                         "kv_cache_gib": plan.per_device["kv_cache"] / GIB,
                         "decode_temp_mib": plan.per_device["decode_temp"] / 2**20,
                         "first_decode": t.decode_seconds(first), "first_bound": t.bound_seconds(first),
                         "last_decode": t.decode_seconds(last), "last_bound": t.bound_seconds(last),
                         "tokens_per_second": t.output_tokens_per_second})  # fmt: skip
            print(f"planned {batch} x {prompt} -> {max_len}, {dtype}", file=sys.stderr, flush=True)
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("truth", "others", "rtx3090", "speed", "kernels", "kv"),
                        action="append")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    results = {}
    checks = (
        ("truth", truth),
        ("others", others),
        ("rtx3090", rtx3090),
        ("speed", speed),
        ("kernels", kernels),
        ("kv", kv_dtypes),
    )
    for name, check in checks:
        if args.only and name not in args.only:
            continue
        results[name] = check()
        if name == "truth":
            print("| row | figure | published | predicted | ratio | mean decode step | its HBM bound |")
            print("|---|---|---|---|---|---|---|")
            for r in results[name]["rows"]:
                unit = (lambda v: f"{v:,.1f} tok/s") if r["figure"] == "tokens_per_second" else (
                    lambda v: f"{v * 1e3:.1f} ms")  # fmt: skip
                decode = f"{r['mean_decode'] * 1e3:.2f} ms | {r['decode_bound'] * 1e3:.2f} ms"
                print(f"| {r['row']} | {r['figure']} | {unit(r['published'])} | {unit(r['predicted'])} | "
                      f"{r['ratio']:.2f} | {decode} |")  # fmt: skip
            for figure, s in results[name]["summary"].items():
                print(f"{figure}: median |error| {s['median_error']:.1%}, worst {s['worst_error']:.1%}")
        elif name == "others":
            print("| row | figure | published | predicted | ratio | plan on 80 GB | mean decode step | "
                  "its HBM bound |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|")
            for r in results[name]["rows"]:
                unit = (lambda v: f"{v:,.0f} tok/s/GPU") if r["figure"] == "tokens_per_gpu" else (
                    lambda v: f"{v * 1e3:.1f} ms")  # fmt: skip
                print(f"| {r['row']} | {r['figure']} | {unit(r['published'])} | {unit(r['predicted'])} | "
                      f"{r['ratio']:.2f} | {r['verdict']}, {r['peak_gib']:.1f} GiB | "
                      f"{r['mean_decode'] * 1e3:.2f} ms | {r['decode_bound'] * 1e3:.2f} ms |")  # fmt: skip
            for figure, s in results[name]["summary"].items():
                print(f"{figure}: median |error| {s['median_error']:.1%}, worst {s['worst_error']:.1%}")
        elif name == "kv":
            print("| batch x prompt -> positions | KV cache | its bytes | decode temporaries | first decode "
                  "step / HBM bound | last / bound | output tokens/s |")  # fmt: skip
            print("|---|---|---|---|---|---|---|")
            for r in results[name]["rows"]:
                first, last = (f"{r[f'{end}_decode'] * 1e3:.2f} / {r[f'{end}_bound'] * 1e3:.2f} ms"
                               for end in ("first", "last"))  # fmt: skip
                print(f"| {r['batch']} x {r['prompt_len']} -> {r['max_len']} | {r['kv_dtype']} | "
                      f"{r['kv_cache_gib']:.2f} GiB | {r['decode_temp_mib']:.1f} MiB | {first} | {last} | "
                      f"{r['tokens_per_second']:,.0f} |")  # fmt: skip
        else:
            print(json.dumps({name: results[name]}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
