"""Planning an unscanned user model (issue 20, item 5): a Linen decoder of Gemma-3-4B widths (d_model 2560,
8 query heads and 4 key/value heads of 256, GeGLU FFN 10,240, vocabulary 262,144) whose layers are a Python
loop of blocks (no ``nn.scan``, no remat argument), planned deviceless over 8 H100s with FSDP.

    python bench/unrolled_plan.py --layers 4 --seq 1024
    python bench/unrolled_plan.py --layers 34 --seq 4096 --option xla_gpu_enable_triton_gemm=false
    python bench/unrolled_plan.py --layers 34 --seq 4096 --scan     # the same model, layers scanned

Each run is one fresh process per case (``--child`` does the plan), timed around the process: wall time and
CPU time (user + system, children included: XLA runs ptxas as subprocesses). Prints one line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def build(rngs, remat=None, *, layers, seq, scan=False, vocab=262144, d_model=2560, heads=8, kv_heads=4,
          head_dim=256, d_ff=10240):  # fmt: skip
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from shardmem.models.linen import RematLayers, from_linen

    def dense(features, axes, name, **kw):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes)
        return nn.DenseGeneral(features, kernel_init=init, use_bias=False, name=name, **kw)

    def norm():
        return nn.RMSNorm(scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)))

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x_BxLxD):
            h = norm()(x_BxLxD)
            q = dense((heads, head_dim), ("embed", "heads", "head_dim"), "q")(h)
            k = dense((kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), "k")(h)
            v = dense((kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), "v")(h)
            ctx = jax.nn.dot_product_attention(q, k, v, is_causal=True)
            x_BxLxD = x_BxLxD + dense(d_model, ("heads", "head_dim", "embed"), "o", axis=(-2, -1))(ctx)
            h = norm()(x_BxLxD)
            gate = jax.nn.gelu(dense(d_ff, ("embed", "mlp"), "gate")(h))
            up = dense(d_ff, ("embed", "mlp"), "up")(h)
            return x_BxLxD + dense(d_model, ("mlp", "embed"), "down")(gate * up)

    class Decoder(nn.Module):
        @nn.compact
        def __call__(self, tokens_BxL):
            embed = nn.Embed(vocab, d_model, embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(0.02), ("vocab", "embed")))  # fmt: skip
            x = embed(tokens_BxL)  # float32 throughout (Linen's default dtypes)
            if scan:  # One scanned block: the way to plan fast (remat from the config's plan too).
                x = RematLayers(Block, remat, layers)(x)
            for i in range(0 if scan else layers):  # Unrolled: one copy of the block per layer.
                x = Block(name=f"block_{i}")(x)
            return embed.attend(norm()(x))

    return from_linen(Decoder(), jnp.zeros((1, seq), jnp.int32), rngs=rngs)


def child(args) -> None:
    import functools

    import shardmem
    from shardmem.config import config_from_dict

    config = config_from_dict({
        "name": f"gemma3-4b-widths-{args.layers}-unrolled",
        "model": {"preset": "tiny", "n_layers": args.layers},  # Widths come from the factory.
        "mesh": {"axes": {"fsdp": 8}},
        "data": {"batch": {"shape": ["global_batch", args.seq + 1], "dtype": "int32",
                           "axes": ["batch", None]}},
        "train": {"loss": "shardmem:next_token_loss", "global_batch": 8},
        "memory": {"compiler_options": dict(args.option)},
        "remat": {"policy": args.remat, "layers": {}},  # Reaches scanned layers only.
    })  # fmt: skip
    factory = functools.partial(build, layers=args.layers, seq=args.seq, scan=args.scan)
    report = shardmem.plan(config, "h100-sxm", model_factory=factory, count_remat_overhead=False)
    print(json.dumps({"compile_seconds": report.compile_seconds, "peak": report.per_device["peak"]}))


def option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    return key, {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--option", type=option, action="append", default=[], metavar="XLA_FLAG=VALUE")
    parser.add_argument("--scan", action="store_true", help="scan the layers (RematLayers) instead")
    parser.add_argument("--remat", default="none", help="remat.policy for --scan (default none)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start, load = time.perf_counter(), os.getloadavg()[0]
    command = [sys.executable, __file__, "--child", *sys.argv[1:]]
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode:
        sys.exit(f"plan failed (exit {done.returncode}): {done.stderr.strip()[-600:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    options = ", ".join(f"{k}={v}" for k, v in args.option) or "defaults"
    how = f"scanned, remat {args.remat}" if args.scan else "unrolled"
    print(f"layers {args.layers} {how}, seq {args.seq}, {options}: wall {wall:.1f} s, CPU {cpu:.1f} s, "
          f"XLA compile {result['compile_seconds']:.1f} s, peak {result['peak'] / 2**30:.2f} GiB, "
          f"load {load:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
