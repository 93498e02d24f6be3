"""Toolkit overhead: shardmem's training step against the same step written by hand in JAX + Optax.

    python bench/step_overhead.py configs/tiny.yaml --devices 8 --reps 30 --steps 20

Both steps run the same model (with the config's remat plan and the attention kernel shardmem resolved
for the devices), the same loss (vocabulary-chunked where ``model.loss_chunk`` chunks), the same optimizer
chain (``optimizer.mu_dtype`` included), the same
parameter, optimizer-state and batch shardings and the same activation sharding rules; both donate
their state. They are timed alternately in one process (``--steps`` steps per timing, ``--reps``
pairs), and the median of the per-pair ratios shardmem / hand-written is reported as a markdown row,
beside the ratio of the two fastest steps (``min``): on a shared machine other work only ever adds time,
so the fastest step of many is the least disturbed measure of what each program costs. The script also
lists the optimized-HLO instructions (without names, metadata and layouts) that one program has and
the other has not.
"""

from __future__ import annotations

import argparse
import collections
import platform
import statistics
import time

import shardmem


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", nargs="?", default="configs/tiny.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--reps", type=int, default=30, help="alternating timing pairs")
    parser.add_argument("--steps", type=int, default=20, help="steps per timing")
    args = parser.parse_args()
    shardmem.ensure_cpu_devices(args.devices)

    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardmem.run.data import global_batch, make_source

    config = shardmem.load_config(args.config, args.overrides)
    mesh = shardmem.build_mesh(config.mesh.axes, jax.devices()[: args.devices])
    program = shardmem.build_program(config, mesh)

    # The hand-written step: plain jax.jit, value_and_grad and an Optax chain built directly.
    opt = config.optimizer
    warmup = min(opt.warmup_steps, config.train.steps - 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, opt.learning_rate, warmup,
                                                  config.train.steps, opt.learning_rate * 0.1)  # fmt: skip
    tx = optax.chain(
        optax.clip_by_global_norm(opt.grad_clip),
        optax.adamw(
            schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay, mu_dtype=opt.mu_dtype
        ),
    )
    graphdef = program.graphdef

    from shardmem.models.losses import chunked_cross_entropy

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params)
        chunk = model.loss_chunk
        if chunk and chunk < model.cfg.vocab_size:
            hidden = model.hidden_states(batch[:, :-1])
            return chunked_cross_entropy(hidden, model.unembedding(), batch[:, 1:], chunk=chunk)
        logits = model(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype("float32"), batch[:, 1:]).mean()

    def hand_step(params, opt_state, batch):
        with program.rules.activate(mesh):  # the same activation sharding constraints
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.global_norm(grads)

    shardings = program.state_shardings
    replicated = NamedSharding(mesh, P())
    hand = jax.jit(
        hand_step,
        in_shardings=(shardings["params"], shardings["opt_state"], program.batch_sharding),
        out_shardings=(shardings["params"], shardings["opt_state"], replicated, replicated),
        donate_argnums=(0, 1),
    )

    source = make_source(config.data.path, vocab_size=config.model.vocab_size,
                         seq_len=config.model.seq_len, seed=0)  # fmt: skip
    batch = global_batch(source, 0, config.train.global_batch, program.batch_sharding)
    state = program.init()
    init = program.init()
    params, opt_state = init["params"], init["opt_state"]

    # Warm up (compile) and check that both steps compute the same loss.
    state, metrics = program.step(state, batch)
    params, opt_state, loss, _ = hand(params, opt_state, batch)
    assert abs(float(metrics["loss"]) - float(loss)) < 1e-5, (metrics["loss"], loss)

    ratios, ours, theirs = [], [], []
    fastest = {"shardmem": float("inf"), "hand": float("inf")}
    for rep in range(args.reps):
        order = ("shardmem", "hand") if rep % 2 == 0 else ("hand", "shardmem")
        times = {}
        for which in order:
            start = time.perf_counter()
            for _ in range(args.steps):
                tick = time.perf_counter()
                if which == "shardmem":
                    state, metrics = program.step(state, batch)
                    jax.block_until_ready((state, metrics))
                else:
                    params, opt_state, loss, norm = hand(params, opt_state, batch)
                    jax.block_until_ready((params, opt_state, loss, norm))
                fastest[which] = min(fastest[which], time.perf_counter() - tick)
            times[which] = (time.perf_counter() - start) / args.steps
        ours.append(times["shardmem"])
        theirs.append(times["hand"])
        ratios.append(times["shardmem"] / times["hand"])

    model = config.model
    shape = (f"d_model={model.d_model} layers={model.n_layers} seq={model.seq_len} "
             f"batch={config.train.global_batch}")  # fmt: skip
    mesh_text = " ".join(f"{k}={v}" for k, v in mesh.shape.items())
    print(
        "| config | model | mesh | remat | attention | shardmem ms/step | hand-written ms/step "
        "| ratio (median) | fastest steps, ms | ratio (min) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {config.name} | {shape} | {mesh_text} | {config.remat_plan().describe()} | "
        f"{program.attention.describe()} | "
        f"{statistics.median(ours) * 1e3:.2f} | {statistics.median(theirs) * 1e3:.2f} | "
        f"{statistics.median(ratios):.3f} | {fastest['shardmem'] * 1e3:.2f} / {fastest['hand'] * 1e3:.2f} | "
        f"{fastest['shardmem'] / fastest['hand']:.3f} |"
    )
    ours_hlo = collections.Counter(_normalized_hlo(program.step, (state, batch)))
    hand_hlo = collections.Counter(_normalized_hlo(hand, (params, opt_state, batch)))
    extra, missing = ours_hlo - hand_hlo, hand_hlo - ours_hlo
    print(
        f"\noptimized HLO: {sum(ours_hlo.values())} instructions against {sum(hand_hlo.values())}; "
        f"{sum(extra.values())} only in shardmem's, {sum(missing.values())} only in the hand-written one"
    )
    for line in sorted(extra):
        print("  only shardmem's:", line[:160])
    for line in sorted(missing):
        print("  only hand-written:", line[:160])
    spread = sorted(ratios)
    machine = platform.processor() or platform.machine()
    print(f"\n{args.reps} alternating pairs of {args.steps} steps on {machine}; "
          f"ratio quartiles {spread[len(spread) // 4]:.3f} / {spread[3 * len(spread) // 4]:.3f}")  # fmt: skip


def _normalized_hlo(jitted, args) -> list[str]:
    """The optimized HLO's instructions without names, metadata and layouts, sorted: two programs that
    compute the same ops give the same list."""
    import re

    text = jitted.lower(*args).compile().as_text()
    out = []
    for line in text.splitlines():
        line = re.sub(r", metadata=\{.*?\}(?=,|$)", "", line)
        line = re.sub(r"%[\w.\-]+", "%", line)
        line = re.sub(r"\{[0-9,]*\}", "", line)
        line = re.sub(r"parameter\(\d+\)", "parameter()", line)
        line = re.sub(r"/\*index=\d+\*/", "", line)
        if " = " in line:
            out.append(line.strip())
    return sorted(out)


if __name__ == "__main__":
    main()
