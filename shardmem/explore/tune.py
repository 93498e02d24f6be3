"""Tuning a config to its memory budget with few compiles: the cheapest per-layer remat plan that fits,
the largest global batch that fits, or the fewest micro-batches that fit; the fastest layout
(:mod:`shardmem.explore.layout`) and a fine-tune's knobs (:mod:`shardmem.explore.finetune`) too.

    result = tune(load_config("configs/llama-7b.yaml"), target="h100-sxm")
    result.config.remat_plan().describe()   # e.g. "0-25: minimal, 26-31: dots"
    result.compiles, result.chosen.recompute_overhead
    Path("tuned.yaml").write_text(result.config.to_yaml())

The search orders candidates by an estimate that costs no compile, confirms with compiles, and prunes by
monotonicity. For remat: recomputed FLOPs are exact from the traced step (they add up layer by layer);
the activation bytes a policy keeps come from the residuals of ``jax.vjp`` on abstract shapes, scaled
to per-device bytes by the compiles already made; a policy that saves a subset of what another saves
never needs more memory, so when one does not fit, none that saves more is compiled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from shardmem.config import Config
from shardmem.errors import ConfigError, PlanError, at_least, one_of
from shardmem.explore.search import (
    Planner,
    Trial,
    TuneResult,
    batch_shards,
    margin_text,
    no_fit,
    plan_budget,
    residual_bytes,
)
from shardmem.parallel.mesh import build_mesh
from shardmem.parallel.pipeline import STAGE_AXIS
from shardmem.parallel.rules import Rules, spec_axes
from shardmem.planning import hlo
from shardmem.planning.memory import make_target, model_flops, op_shares, plan
from shardmem.program import build_program, pipeline_for
from shardmem.remat import PRESETS
from shardmem.units import clip, format_bytes, format_seconds

SEARCHES = ("remat", "batch", "micro_batches", "layout", "finetune", "serve")

#: Policy -> policies that keep a superset of what it keeps on the device (so need no less memory).
_SAVES_MORE = {
    "full": {"save_out_proj", "save_qkv", "minimal", "offload", "dots", "dots_no_batch", "none"},
    "offload": {"minimal", "dots", "none"},
    "save_out_proj": {"minimal", "dots", "none"},
    "save_qkv": {"minimal", "dots", "none"},
    "minimal": {"dots", "none"},
    "dots_no_batch": {"dots", "none"},
    "dots": {"none"},
    "none": set(),
}

#: Among policies that cost the same, the more familiar first.
_PREFERENCE = ("none", "dots", "minimal", "dots_no_batch", "offload", "save_qkv", "save_out_proj", "full")

#: An estimate this far over the budget is rejected without a compile (estimates run low, not high).
_ESTIMATE_REJECT = 1.15


_STATE_KEYS = ("optimizer.shard_over_data", "optimizer.mu_dtype", "memory.offload_optimizer")


def getattr_path(config: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def tune(
    config: Config,
    target: str | None = None,
    *,
    search: str | None = None,
    allow_offload: bool | None = None,
    max_compiles: int = 12,
    progress: Callable[[str], None] | None = None,
    objective: str | None = None,
    jobs: int | None = None,
    trials: list[Trial] | None = None,
    min_seq_len: int | None = None,
) -> TuneResult:
    """Searches for the best config that fits the budget of ``target`` (default ``memory.target``).

    ``search``: ``"remat"`` finds the per-layer remat plan with the fewest recomputed FLOPs (then the
    fewest host-offloaded bytes); ``"batch"`` the largest ``train.global_batch``; ``"micro_batches"`` the
    fewest ``train.micro_batches`` for the configured global batch; ``"layout"`` the mesh, micro-batches,
    remat and ZeRO-1 with the shortest predicted step time (``objective="throughput"``: the most tokens
    per second per device, each top layout at the largest global batch that fits), with the best compiled
    layout of each family in ``TuneResult.families``, compiling in ``jobs``
    worker processes (:mod:`shardmem.explore.layout`; ``objective`` and ``jobs`` are for that search
    only, and it needs ``max_compiles`` of 3 or more, the others 2); ``"finetune"`` the LoRA rank, base
    quantization, remat, micro-batches and (down to ``min_seq_len``, where given) sequence length of a
    fine-tune, with what each knob costs (:mod:`shardmem.explore.finetune`); ``"serve"`` the tensor degree,
    KV dtype (and for ``objective="throughput"`` the batch) of the serving program with the least time
    for its static batch (``objective="latency"``, the default) or the most output tokens/s
    (:mod:`shardmem.explore.serving`). ``search`` defaults to
    ``"finetune"`` for a config with a ``finetune:`` section, else ``"remat"``. ``allow_offload`` defaults
    to whether the target is a GPU (offloading saves nothing on CPU). At most ``max_compiles`` compiles.
    ``trials``: a list the search appends each trial to as it goes (what a caller interrupted mid-search
    still has).
    """
    if search is None:
        search = "finetune" if config.finetune.active else "remat"
    if search not in SEARCHES:
        raise ConfigError(f"--search {search!r}: use {one_of(SEARCHES)}")
    if min_seq_len is not None and search != "finetune":
        raise ConfigError(f"--min-seq-len {min_seq_len}: only --search finetune shortens the sequence; "
                          "leave it out or use --search finetune")  # fmt: skip
    if allow_offload is False and search == "serve":
        raise ConfigError("--no-offload: --search serve offloads nothing to host memory (its programs hold "
                          "no activations for a backward pass); drop --no-offload")  # fmt: skip
    if allow_offload is False and search not in ("remat", "layout"):  # They alone choose the remat policy.
        raise ConfigError(f"--no-offload: only --search remat or layout chooses what to offload (this is "
                          f"--search {search}, which offloads only where the config's remat.policy does); "
                          "set remat.policy, or drop --no-offload")  # fmt: skip
    from shardmem.explore.layout import OBJECTIVES
    from shardmem.explore.sweep import JOBS_FIX

    if search == "layout":  # Two layouts to compare, and the winner's full report.
        fix = "--search layout needs at least 3: two layouts to compare and the winner's full report"
        at_least("--max-compiles", max_compiles, 3, fix)
    else:
        at_least("--max-compiles", max_compiles, 2, f"--search {search} needs at least 2")
    at_least("--jobs", jobs, 1, JOBS_FIX)
    for option, value in (("--objective", objective), ("--jobs", jobs)):
        users = ("layout", "serve") if option == "--objective" else ("layout",)
        if value is not None and search not in users:
            raise ConfigError(f"{option} {value}: only --search {' or '.join(users)} uses it (this is "
                              f"--search {search}); add --search layout, or drop {option}")  # fmt: skip
    if search != "serve":
        objective = objective or "step_time"
    if search != "serve" and objective not in OBJECTIVES:
        raise ConfigError(f"--objective {objective!r}: use {one_of(OBJECTIVES)}")
    resolved = make_target(config, target)
    if allow_offload is None:
        allow_offload = resolved.platform != "cpu"
    planner = Planner(config, target, max_compiles, progress, trials)
    if search == "remat":
        result = _tune_remat(planner, resolved, allow_offload)
    elif search == "layout":
        result = _tune_layout(planner, resolved, allow_offload, objective, jobs)
    elif search == "finetune":
        from shardmem.explore.finetune import tune_finetune

        result = tune_finetune(planner, resolved, min_seq_len)
    elif search == "serve":
        from shardmem.explore.serving import tune_serving

        result = tune_serving(planner, resolved, objective)
    elif search == "batch":
        result = _tune_batch(planner, resolved)
    else:
        result = _tune_micro_batches(planner, resolved)
    if result.config is not None:
        # The tuned config runs under a name of its own (runs/<name>), not in the run dir of the input;
        # the tuned file plans for the target it was tuned for.
        name = config.name if config.name.endswith("-tuned") else f"{config.name}-tuned"
        sets = [f"name={name}", *([f"memory.target={target}"] if target is not None else [])]
        result = dataclasses.replace(result, config=result.config.replace(*sets))
    return result


# --- remat ---------------------------------------------------------------------------------------


def _zero1_applies(config: Config, target) -> bool:
    """Whether the batch runs over a mesh axis of size > 1 that the parameters are replicated over."""
    if config.optimizer.shard_over_data or config.optimizer.name == "sgd" or config.param_rules:
        return False
    rules = Rules.from_config(config.rules, tuple(config.mesh.axes), config.param_rules)
    used = {a for name, axes in rules.logical if name not in ("batch", "seq") for a in spec_axes(axes)}
    return any(config.mesh.axes[a] > 1 for a in spec_axes(rules.mesh_axes("batch")) if a not in used)


def _state_savings(config: Config, target) -> list[tuple[str, tuple[str, ...]]]:
    """Optimizer-state savings that recompute nothing, in the order tune adds them when even full remat
    does not fit: ZeRO-1 (costs communication only), a bf16 first moment, then the state in host memory
    (where the target has it)."""
    steps = []
    if _zero1_applies(config, target):
        steps.append(("ZeRO-1", ("optimizer.shard_over_data=true",)))
    if config.optimizer.name != "sgd" and not config.optimizer.mu_dtype:
        steps.append(("bf16 first moment", ("optimizer.mu_dtype=bfloat16",)))
    kinds = {m.kind for m in target.devices[0].addressable_memories()}
    if not config.memory.offload_optimizer and "pinned_host" in kinds and target.platform != "cpu":
        steps.append(("optimizer state on the host", ("memory.offload_optimizer=true",)))
    return steps


def _uniform(policy: str) -> tuple[str, ...]:
    return (f"remat.policy={policy}", "remat.layers={}")


def _mix(base: str, top: str, m: int, n: int, chunks: int = 1, counts: tuple[int, ...] = ()) -> tuple:
    """``base`` for the first ``n - m`` layers, ``top`` for the last ``m``, in each of ``chunks`` runs of
    ``n`` layers (a pipeline's stage chunks, which all run one program); with uneven stages of ``counts``
    layers, ``n`` is the largest and ``top`` goes to the last ``m`` of the ``n`` layer slots each has."""
    if m <= 0:
        return _uniform(base)
    if m >= n:
        return _uniform(top)
    counts = counts or (n,) * chunks
    starts = [sum(counts[:c]) for c in range(len(counts))]
    runs = [(a + n - m, a + k - 1) for a, k in zip(starts, counts, strict=True) if k > n - m]
    spans = [f"{first}-{last}" if last > first else f"{first}" for first, last in runs]
    layers = ", ".join(f'"{span}": {top}' for span in spans)
    return (f"remat.policy={base}", f"remat.layers={{{layers}}}")


def _mix_name(base: str, top: str, m: int, n: int, chunks: int = 1) -> str:
    if m <= 0:
        return base
    if m >= n:
        return top
    if chunks > 1:
        return f"{base}, the last {m} of each stage chunk's {n} layers: {top}"
    last = f"{n - m}-{n - 1}" if m > 1 else f"{n - 1}"
    first = f"0-{n - m - 1}" if n - m > 1 else "0"
    return f"{first}: {base}, {last}: {top}"


def _tune_remat(planner: Planner, target, allow_offload: bool) -> TuneResult:
    config = planner.base
    n = getattr(config.model, "n_layers", None)
    if n is None:
        raise ConfigError(
            "shardmem tune --search remat picks a policy per layer: set model.n_layers to your model's "
            "depth (and give its factory a remat argument)"
        )
    mesh = build_mesh(config.mesh.axes, target.devices)
    policies = [p for p in PRESETS if allow_offload or p != "offload"]
    # Pipeline stages run one program: a mix applies to the same positions of every chunk of layers.
    pipeline = pipeline_for(config.replace(*_uniform("full")), mesh)
    chunks = pipeline.stages * pipeline.repeats if pipeline else 1
    counts = pipeline.split(n) if pipeline and pipeline.repeats == 1 else ()
    n = max(counts) if counts else n // chunks

    # Exact recomputed FLOPs per uniform policy (traced, not compiled) and estimated residual bytes.
    flops, device_residual, host_residual = {}, {}, {}
    for policy in policies:
        program = build_program(config.replace(*_uniform(policy)), mesh)
        jaxpr = program.step.trace(program.abstract_state, program.abstract_batch).jaxpr
        flops[policy] = hlo.matmul_flops(jaxpr, op_shares(program))
        if policy == "none":  # The model's FLOPs, every report's baseline (no recomputation at all).
            planner.flops_no_remat = model_flops(program, jaxpr)
        device_residual[policy] = residual_bytes(config.replace(*_uniform(policy)), program.attention)
    device_residual["offload"] = device_residual["full"]  # offloaded residuals live on the host
    if allow_offload:
        host_residual["offload"] = (
            residual_bytes(config.replace(*_uniform("offload")), program.attention) - device_residual["full"]
        )
    overhead = {p: flops[p] / flops["none"] - 1.0 for p in policies}
    host_est = {p: host_residual.get(p, 0) / len(target.devices) for p in policies}

    full = planner.compile("full", _uniform("full"))
    budget = full.budget_bytes
    for what, overrides in _state_savings(planner.base, target) if not full.fits else ():
        if planner.compiles >= planner.max_compiles - 1:
            break
        planner.rebase(overrides)
        planner.progress(f"full remat does not fit: adding {what}")
        full = planner.compile("full + " + " ".join(overrides), _uniform("full"))
        if full.fits:
            break
    if not full.fits:
        return no_fit(planner, target, budget, "remat", [
            f"even 'full' remat (keep only each layer's input) needs {format_bytes(full.per_device['peak'])} "
            f"per device against a budget of {format_bytes(budget)}; no remat plan fits",
            "reduce the activations per device: raise train.micro_batches (try shardmem tune --search "
            "micro_batches), lower train.global_batch, or shard over more devices",
        ])  # fmt: skip

    compiled_peak = {"full": full.per_device["peak"]}

    def scale() -> float:
        """Per-device bytes of peak per global residual byte, fitted to the compiled policies."""
        points = [(device_residual[p] - device_residual["full"], compiled_peak[p] - compiled_peak["full"])
                  for p in compiled_peak if device_residual[p] != device_residual["full"]]  # fmt: skip
        if not points:
            return 1.0 / len(target.devices)
        return max(sum(x * y for x, y in points) / sum(x * x for x, _ in points), 0.0)

    def peak_of(policy: str) -> tuple[int, bool]:
        if policy in compiled_peak:
            return compiled_peak[policy], True
        estimate = compiled_peak["full"] + scale() * (device_residual[policy] - device_residual["full"])
        return int(estimate), False

    # Uniform plans, cheapest in recomputation first; the first that fits is the base of the plan.
    # Among equals in FLOPs, "none" before "dots": dots still recomputes the cheap elementwise ops.
    order = sorted(policies, key=lambda p: (round(overhead[p], 6), host_est[p], _PREFERENCE.index(p)))
    rejected: set[str] = set()
    best = "full"
    for policy in order:
        if policy == "full":
            break
        pruned_by = next((q for q in rejected if policy in _SAVES_MORE[q]), None)
        same_as = next((q for q in rejected if q in compiled_peak and q != "offload"
                        and device_residual[policy] >= device_residual[q]), None)  # fmt: skip
        if pruned_by or same_as:
            why = (f"keeps more than '{pruned_by}'" if pruned_by
                   else f"keeps at least the residual bytes of '{same_as}'")  # fmt: skip
            planner.note(policy, _uniform(policy), None, None, overhead[policy], False, "pruned",
                         f"{why}, which does not fit")  # fmt: skip
            rejected.add(policy)
            continue
        estimate, _ = peak_of(policy)
        if planner.compiles >= planner.max_compiles - 1:
            planner.note(policy, _uniform(policy), estimate, int(host_est[policy]), overhead[policy], False,
                         "skipped", "compile budget spent")  # fmt: skip
            continue
        if estimate > budget * _ESTIMATE_REJECT:
            planner.note(policy, _uniform(policy), estimate, int(host_est[policy]), overhead[policy], False,
                         "estimated", f"estimated {format_bytes(estimate)} against a budget of "
                         f"{format_bytes(budget)}")  # fmt: skip
            rejected.add(policy)
            continue
        report = planner.compile(policy, _uniform(policy))
        compiled_peak[policy] = report.per_device["peak"]
        if report.fits:
            best = policy
            break
        rejected.add(policy)

    # Then move the last layers to a policy that recomputes less (or offloads less), as many as fit.
    base_peak = compiled_peak[best]
    options = []
    for top in rejected:
        gain = (overhead[best] - overhead[top], host_est[best] - host_est[top])
        extra_per_layer = (peak_of(top)[0] - base_peak) / n
        if gain <= (0, 0) or gain[0] < 0 or extra_per_layer <= 0:
            continue
        m = min(n - 1, int((budget - base_peak) // extra_per_layer))
        if m > 0:
            options.append(((m * gain[0], m * gain[1]), top, m))
    chosen_name, chosen_overrides = best, _uniform(best)
    if options:
        _, top, guess = max(options)
        lo, hi = 0, n  # Invariant: m=lo fits (or is the uniform base), m=hi does not (or is untested).
        peaks = {0: base_peak, n: peak_of(top)[0]}  # The top end may be an estimate; only a guide.
        m = guess
        while hi - lo > 1 and not planner.exhausted:
            mix = _mix(best, top, m, n, chunks, counts)
            report = planner.compile(_mix_name(best, top, m, n, chunks), mix)
            peaks[m] = report.per_device["peak"]
            if report.fits:
                lo = m
            else:
                hi = m
            if hi - lo <= 1:
                break
            if peaks[hi] > peaks[lo]:  # Interpolate between the nearest points on either side.
                m = lo + int((budget - peaks[lo]) / (peaks[hi] - peaks[lo]) * (hi - lo))
            else:
                m = (lo + hi) // 2
            m = min(max(m, lo + 1), hi - 1)
        if lo > 0:
            chosen_name = _mix_name(best, top, lo, n, chunks)
            chosen_overrides = _mix(best, top, lo, n, chunks, counts)

    report = planner.compile(chosen_name, chosen_overrides)  # Already compiled: no extra compile.
    tuned = planner.base.replace(*chosen_overrides)
    chosen = next(
        t for t in reversed(planner.trials) if t.overrides == chosen_overrides and t.how == "compiled"
    )
    explanation = [
        f"budget {format_bytes(budget)} per device on {target.label}",
        f"chose {chosen_name}: peak {format_bytes(report.per_device['peak'])}, "
        f"{margin_text(report.margin_bytes)}; recomputation {(report.recompute_overhead or 0):+.1%} over no "
        f"remat (uniform full: {overhead['full']:+.1%}); "
        f"host offload {format_bytes(report.per_device['host'])}",
    ]
    state = [(key, getattr_path(tuned, key)) for key in _STATE_KEYS if getattr_path(tuned, key)]
    if state:
        explanation.append("optimizer state: " + ", ".join(f"{k}={v}" for k, v in state))
    cheaper = [t for t in planner.trials if not t.fits and t.recompute_overhead is not None
               and t.recompute_overhead < (report.recompute_overhead or 0) - 1e-9]  # fmt: skip
    if cheaper:
        explanation.append("rejected as over budget although they recompute less: " + ", ".join(
            f"{t.candidate} ({t.recompute_overhead:+.1%}, {t.how})" for t in cheaper))  # fmt: skip
    explanation.append(f"{planner.compiles} compiles")
    return TuneResult("remat", tuned, report, chosen, planner.trials, planner.compiles, budget,
                      target.label, explanation)  # fmt: skip


# --- layout --------------------------------------------------------------------------------------


def _tune_layout(
    planner: Planner, target, allow_offload: bool, objective: str, jobs: int | None
) -> TuneResult:
    from shardmem.explore.layout import search_layouts, why_winner

    config = planner.base
    # Compiles kept back: the winner's full report, and a per-layer remat search on its mesh.
    kept = 1 + min(6, planner.max_compiles // 4)
    ranked, compiles, notes, families = search_layouts(
        config, planner.target, target, max_compiles=max(planner.max_compiles - kept, 1), jobs=jobs,
        objective=objective,
        allow_offload=allow_offload, progress=planner.progress, note=planner.note,
    )  # fmt: skip
    planner.compiles = compiles
    searched = compiles
    budget = plan_budget(config, target)
    shown = ranked_rows(ranked, config)
    fitting = [r for r in ranked if r.fits]
    if not fitting:
        result = no_fit(planner, target, budget, "layout", [
            "no compiled layout fits the budget", *notes,
            "shard over more devices, or tune with a smaller train.global_batch",
        ])  # fmt: skip
        return dataclasses.replace(result, ranked=shown, families=family_rows(families, None, config))
    best = fitting[0]
    tuned = config.replace(*best.overrides)
    report = plan(tuned, planner.target, top=5)  # The winner's full report (one more compile).
    compiles += 1
    refined = mixed = None
    left = planner.max_compiles - compiles
    if best.layout.policy != "none" and left >= 3:
        # Per-layer remat on the winning mesh: the cheapest mix that fits, kept if it is faster. The
        # remat search ranks by recomputed FLOPs, host copies only breaking ties, so offload joins the
        # mix only where the winner itself offloads (whose PCIe time the ranking above weighed): else
        # it becomes the base of the mix (llama-70b, FSDP over 64 H100s: 8 compiles for "0-48: offload",
        # 4.88 s against uniform full's 3.33 s).
        planner.progress(f"per-layer remat for {best.layout.describe()} ({left} compiles left)")
        try:
            mixed = tune(tuned, planner.target, search="remat", max_compiles=left,
                         allow_offload=allow_offload and best.layout.policy == "offload")  # fmt: skip
        except PlanError as e:  # XLA failed on a mix: the uniform plan stands, and the report says why.
            mixed = None
            notes.insert(
                -1,
                "per-layer remat search stopped by a compile failure (its compiles are not counted): "
                + clip(str(e), 150),
            )
        compiles += mixed.compiles if mixed else 0
        if (
            mixed is not None
            and mixed.found
            and mixed.report.step_time
            and mixed.report.step_time.seconds < report.step_time.seconds
        ):
            refined = (f"per-layer remat {mixed.config.remat_plan().describe()} instead of uniform "
                       f"{best.layout.policy}: {format_seconds(report.step_time.seconds)} -> "
                       f"{format_seconds(mixed.report.step_time.seconds)} per step "
                       f"({mixed.compiles} compiles)")  # fmt: skip
            tuned, report = mixed.config, mixed.report
    planner.compiles = compiles
    st = report.step_time.to_json() if refined else best.step_time
    rows = family_rows(families, best, config, objective)
    # The winner's layout with the remat it runs: the per-layer mix where that refined it.
    chose = dataclasses.replace(best.layout, remat=tuned.remat_plan().describe()) if refined else best.layout
    explanation = [
        f"budget {format_bytes(budget)} per device on {target.label}",
        f"chose {chose.describe()}: predicted {format_seconds(st['seconds'])} per step"
        + (f", {st['tokens_per_second']:,.0f} tokens/s" if st.get("tokens_per_second") else "")
        + (f", MFU {st['mfu']:.1%}" if st.get("mfu") is not None else "")
        + f"; peak {format_bytes(report.per_device['peak'])}, {margin_text(report.margin_bytes)}",
        why_winner(best, fitting[1] if len(fitting) > 1 else None, objective, len(target.devices)),
        _against_own(best, ranked, objective, len(target.devices)),
        *_against_families(rows),
        *([refined] if refined else []),
        *notes[:-1],
        *_host_rates_note(target),
        f"{compiles} compiles in all: {searched} of layouts, 1 of the winner's full report"
        + (f", {mixed.compiles} of its per-layer remat search" if mixed is not None else "")
        + f" ({notes[-1]})",
    ]
    chosen = next(t for t in reversed(planner.trials) if t.overrides == best.overrides)
    if refined:
        chosen = mixed.chosen
        planner.trials.extend(mixed.trials)
    return TuneResult("layout", tuned, report, chosen, planner.trials, compiles, budget, target.label,
                      explanation, ranked=shown, families=rows)  # fmt: skip


def _against_families(rows: list[dict[str, Any]]) -> list[str]:
    """One line on the winner against the best compiled layout of each other family (or why a family has
    none): its step time and the term it loses most in."""
    others = []
    for row in rows:
        best = row["layout"]
        if best is None:
            others.append(f"{row['name']}: {row['reason']}")
        elif row["behind"]["term"] != "the winner":
            step = format_seconds(best["step_time"]["seconds"]) if best["step_time"] else "no step time"
            others.append(f"{row['name']} {step} ({_behind(row)})")
    return ["against each other family's best compiled layout: " + "; ".join(others)] if others else []


def _behind(row: dict[str, Any]) -> str:
    """Where a family's best loses to the winner: "+929 ms, most in exposed communication (+634 ms)"
    (for --objective throughput, per 1,000 tokens: the winner may run a grown batch)."""
    behind = row["behind"]
    if behind["seconds"] is None or behind["term"] == "the winner":
        return behind["term"]
    if not behind["per_1000_tokens"]:
        return (f"+{format_seconds(behind['seconds'])}, most in {behind['term']} "
                f"(+{format_seconds(behind['term_seconds'])})")  # fmt: skip
    return f"most in {behind['term']} (+{format_seconds(behind['term_seconds'])} per 1,000 tokens)"


def _host_rates_note(target) -> list[str]:
    """On a CPU target, the rates every candidate was costed with, and what they do to near-ties."""
    if target.platform != "cpu":
        return []
    from shardmem.planning.cost import HOST_RATES_ENV, host_rates

    flops, bandwidth = host_rates()
    return [f"CPU step times use this machine's rates, {flops / 1e9:,.1f} GFLOP/s and {bandwidth / 1e9:,.1f} "
            f"GB/s, measured once for the whole search; they move with the machine's load, which can "
            f"reorder near-ties in another run; {HOST_RATES_ENV}=FLOPS,BYTES pins them"]  # fmt: skip


def _against_own(best, ranked: list, objective: str, devices: int) -> str:
    """One line on the winner against the config as written (compiled first, whether or not it fits)."""
    own = next((r for r in ranked if r.layout.own and r.layout.global_batch is None), None)  # Not grown.
    if own is None:
        return "the config as written did not compile (see the notes)"
    if own is best:
        return "the config as written is the best compiled layout: keep it"
    if not own.fits:
        return (f"the config as written does not fit: peak {format_bytes(own.peak_bytes)}, "
                f"{margin_text(own.margin_bytes)}")  # fmt: skip
    if objective == "throughput":
        rate = own.throughput_per_device(devices)
        return (f"the config as written: {rate:,.1f} tokens/s per device; the choice "
                f"{best.throughput_per_device(devices) / rate - 1:+.1%}")  # fmt: skip
    return (f"the config as written: {format_seconds(own.seconds)} per step; the choice "
            f"{best.seconds / own.seconds - 1:+.1%}")  # fmt: skip


def ranked_rows(ranked: list, config: Config) -> list[dict[str, Any]]:
    """The layout search's compiled layouts as ``TuneResult.ranked`` rows, each with the global batch
    it ran and its micro-batches: layouts are compared at the config's global batch (a grown one only
    for ``--objective throughput``), one that cannot hold all of it at once accumulating gradients over
    more micro-batches."""
    return [dataclasses.asdict(r) | {"describe": r.layout.describe(), "mesh": r.layout.describe(batch=False),
                                     "global_batch": r.layout.batch(config),
                                     "micro_batches": r.layout.micro_batches} for r in ranked]  # fmt: skip


def family_rows(families: list, winner, config: Config, objective: str = "step_time") -> list[dict[str, Any]]:
    """The best compiled layout of each family (:func:`shardmem.explore.layout.search_layouts`) as
    ``TuneResult.families`` rows: its :func:`ranked_rows` row, the pruning estimate it was compiled on,
    and where it loses to the ``winner`` (the term of the step time, or that it does not fit); or, with
    no layout, the reason (not buildable, compile budget spent)."""
    from shardmem.explore.layout import family_name, widest_gap

    rows = []
    for fam in families:
        guess = fam.estimate
        row = {"family": fam.family, "name": family_name(fam.family, config), "reason": fam.reason,
               "layout": None, "estimated_peak_bytes": guess.peak_bytes if guess else None,
               "estimated_seconds": guess.seconds if guess else None, "behind": None}  # fmt: skip
        best = fam.best
        if best is not None:
            row["layout"] = ranked_rows([best], config)[0]
            if best is winner:
                row["behind"] = {"term": "the winner", "seconds": 0.0}
            elif not best.fits:
                row["behind"] = {"term": "does not fit", "seconds": None}
            elif winner is not None and best.step_time and winner.step_time:
                per_token = objective == "throughput"
                term, gain = widest_gap(winner, best, per_token)
                row["behind"] = {"term": term, "seconds": best.seconds - winner.seconds,
                                 "term_seconds": gain * (1000 if per_token else 1),
                                 "per_1000_tokens": per_token}  # fmt: skip
        rows.append(row)
    return rows


def _finish(planner: Planner, target, search: str, overrides: tuple[str, ...], what: str,
            notes: tuple[str, ...] = ()) -> TuneResult:  # fmt: skip
    report = planner.reports[overrides]
    chosen = next(t for t in planner.trials if t.overrides == overrides)
    explanation = [
        f"budget {format_bytes(report.budget_bytes)} per device on {target.label}",
        f"chose {what}: peak {format_bytes(report.per_device['peak'])}, {margin_text(report.margin_bytes)}",
    ]
    over = [t for t in planner.trials if not t.fits]
    if over:
        explanation.append("over budget: " + ", ".join(t.candidate for t in over))
    explanation += [f"{planner.compiles} compiles", *notes]
    return TuneResult(search, planner.base.replace(*overrides), report, chosen, planner.trials,
                      planner.compiles, report.budget_bytes, target.label, explanation)  # fmt: skip


def _tune_batch(planner: Planner, target) -> TuneResult:
    """Largest global batch (a multiple of batch shards x micro-batches) that fits, micro-batches fixed.

    Peak memory grows about linearly with the batch: each guess interpolates the compiled points nearest
    the budget, and the known fit / no-fit bounds close in on the answer."""
    config = planner.base
    quantum = batch_shards(config, target) * config.train.micro_batches
    peaks: dict[int, int] = {}
    lo, hi = 0, None  # Largest number of quanta known to fit; smallest known not to.
    budget = 0

    def probe(units: int) -> None:
        nonlocal lo, hi, budget
        batch = units * quantum
        report = planner.compile(f"global_batch={batch}", (f"train.global_batch={batch}",))
        peaks[units], budget = report.per_device["peak"], report.budget_bytes
        if report.fits:
            lo = max(lo, units)
        else:
            hi = units if hi is None else min(hi, units)

    probe(max(1, config.train.global_batch // quantum))
    while not planner.exhausted and (hi is None or hi - lo > 1):
        if len(peaks) >= 2:
            a, b = (lo, hi) if lo in peaks and hi in peaks else sorted(peaks)[-2:]
            slope = (peaks[b] - peaks[a]) / (b - a)
            guess = int(a + (budget - peaks[a]) / slope) if slope > 0 else 2 * b
        else:
            guess = 2 * lo if lo else hi // 2
        guess = max(guess, lo + 1)
        guess = min(guess, hi - 1) if hi is not None else min(guess, max(8 * lo, 1))
        if guess < 1:
            break
        probe(guess)
    if lo == 0:
        smallest = min(peaks)
        return no_fit(planner, target, budget, "batch", [
            f"the global batch of {smallest * quantum} needs {format_bytes(peaks[smallest])} per device "
            f"against a budget of {format_bytes(budget)}",
            "raise train.micro_batches, use a remat policy that keeps less (shardmem tune), or shard more",
        ])  # fmt: skip
    batch = lo * quantum
    notes = ()
    if hi is None or hi - lo > 1:  # Out of compiles before the bounds met.
        above = "none is known not to fit" if hi is None else f"{hi * quantum} does not fit"
        notes = (f"the compile budget is spent before the search closed in ({batch} fits, {above}): a "
                 "larger batch may fit; raise --max-compiles",)  # fmt: skip
    return _finish(planner, target, "batch", (f"train.global_batch={batch}",), f"train.global_batch={batch}",
                   notes)  # fmt: skip


def _tune_micro_batches(planner: Planner, target) -> TuneResult:
    """Fewest micro-batches (gradient accumulation steps) that fit the configured global batch. With
    pipeline stages, the most: more micro-batches lower both the peak and the bubble, whose idle ticks
    run (fewer would only buy larger matmuls at a higher peak and more FLOPs)."""
    config = planner.base
    batch, shards = config.train.global_batch, batch_shards(config, target)
    stages = dict(build_mesh(config.mesh.axes, target.devices).shape).get(STAGE_AXIS, 1)
    counts = [k for k in range(stages, batch + 1) if batch % k == 0 and (batch // k) % shards == 0]
    if not counts:
        raise ConfigError(
            f"train.global_batch={batch} cannot be split into micro-batches that divide over the {shards} "
            f"batch shards; use a multiple of {shards}"
        )

    def key(k: int) -> tuple[str, ...]:
        return (f"train.micro_batches={k}",)

    lo, hi = -1, len(counts) - 1  # counts[hi] fits (once checked); counts[lo] does not.
    last = planner.compile(f"micro_batches={counts[hi]}", key(counts[hi]))
    if last.fits and stages > 1:
        bubble = last.pipeline["bubble_fraction"]
        what = f"train.micro_batches={counts[hi]} (the most: the smallest bubble, {bubble:.1%}, and peak)"
        return _finish(planner, target, "micro_batches", key(counts[hi]), what)
    if not last.fits:
        return no_fit(planner, target, last.budget_bytes, "micro_batches", [
            f"even {counts[hi]} micro-batches of {batch // counts[hi]} need "
            f"{format_bytes(last.per_device['peak'])} against a budget of {format_bytes(last.budget_bytes)}",
            "use a remat policy that keeps less (shardmem tune --search remat), or shard more",
        ])  # fmt: skip
    while hi - lo > 1 and not planner.exhausted:
        mid = (lo + hi) // 2
        if planner.compile(f"micro_batches={counts[mid]}", key(counts[mid])).fits:
            hi = mid
        else:
            lo = mid
    return _finish(planner, target, "micro_batches", key(counts[hi]), f"train.micro_batches={counts[hi]}")


def render_tune(result: TuneResult):
    """Returns the trials and the explanation as a rich renderable."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if result.search == "layout":
        return _render_layout(result)
    if result.search == "finetune":
        from shardmem.explore.finetune import render_costs

        return render_costs(result)
    if result.search == "serve":
        from shardmem.explore.serving import render_serving_tune

        return render_serving_tune(result)
    table = Table(title=f"shardmem tune --search {result.search}", title_justify="left", show_edge=False)
    for column in ("candidate", "peak / device", "host", "recompute", "verdict", "how", "why"):
        figure = column in ("peak / device", "host", "recompute")  # Never "0" over "B": the why wraps.
        table.add_column(column, justify="right" if figure else "left", no_wrap=figure)
    for t in result.trials:
        peak = (
            "-"
            if t.peak_bytes is None
            else ("~" if t.how == "estimated" else "") + format_bytes(t.peak_bytes)
        )
        table.add_row(
            t.candidate, peak, "-" if t.host_bytes is None else format_bytes(t.host_bytes),
            "-" if t.recompute_overhead is None else f"{t.recompute_overhead:+.1%}",
            Text("fits", style="green") if t.fits else Text("over", style="red"), t.how, t.reason,
        )  # fmt: skip
    style = "bold green" if result.found else "bold red"
    lines = [Text(result.explanation[0]), table]
    lines += [Text(line, style=style if i == 0 else None) for i, line in enumerate(result.explanation[1:])]
    return Group(*lines)


def _render_layout(result: TuneResult, top: int = 10):
    """The ranked layouts (the batch and micro-batches each ran, peak, margin, step time, MFU, exposed
    communication, bubble) and the why."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title="shardmem tune --search layout: fastest layouts that fit", title_justify="left",
                  show_edge=False)  # fmt: skip
    for column in (
        "#",
        "layout",
        "batch",
        "micro",
        "peak / device",
        "margin",
        "step",
        "tokens/s",
        "MFU",
        "exposed comm",
        "bubble",
    ):
        table.add_column(column, justify="left" if column == "layout" else "right", overflow="fold")
    as_written = lambda r: r["layout"]["own"] and r["layout"]["global_batch"] is None  # noqa: E731
    rows = result.ranked[:top] + [r for r in result.ranked[top:] if as_written(r)]  # Always shown.
    for i, row in enumerate(rows, 1):
        st = row["step_time"] or {}
        margin = row["margin_bytes"]
        over = Text(f"{format_bytes(-margin)} over", style="red")
        table.add_row("-" if not row["fits"] else str(i), row["mesh"], str(row["global_batch"]),
                      str(row["micro_batches"]), format_bytes(row["peak_bytes"]),
                      format_bytes(margin) if margin >= 0 else over,
                      format_seconds(st["seconds"]) if st else "-",
                      f"{st['tokens_per_second']:,.0f}" if st.get("tokens_per_second") else "-",
                      "-" if st.get("mfu") is None else f"{st['mfu']:.1%}",
                      format_seconds(st["breakdown"]["exposed_communication"]) if st else "-",
                      format_seconds(st["bubble_seconds"]) if st.get("bubble_seconds") else "-")  # fmt: skip
    over = [t for t in result.trials if t.how == "compiled" and not t.fits]
    style = "bold green" if result.found else "bold red"
    lines = [Text(result.explanation[0]), table]
    if over:
        lines.append(Text("compiled, over budget: " + "; ".join(
            f"{t.candidate} ({format_bytes(t.peak_bytes)})"
                                                              for t in over[:6]), style="dim"))  # fmt: skip
    if result.families:
        lines.append(_render_families(result.families))
    lines += [Text(line, style=style if i == 0 else None) for i, line in enumerate(result.explanation[1:])]
    return Group(*lines)


def _render_families(families: list[dict[str, Any]]):
    """The best compiled layout of each family: peak, step, where it loses to the winner, and the pruning
    estimate it was compiled on (or why the family has no layout)."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title="best of each family (each compiled)", title_justify="left", show_edge=False)
    for column in ("family", "best layout", "peak / device", "step", "behind the winner", "estimated"):
        table.add_column(column, justify="right" if column in ("peak / device", "step") else "left",
                         overflow="fold")  # fmt: skip
    for row in families:
        best = row["layout"]
        if best is None:
            table.add_row(row["name"], Text(row["reason"], style="dim"), "-", "-", "-", "-")
            continue
        st = best["step_time"] or {}
        peak = format_bytes(best["peak_bytes"]) + ("" if best["fits"] else " (over)")
        lag = _behind(row) if row["behind"] else "-"
        estimated = "-"
        if row["estimated_seconds"] is not None:
            guess = row["estimated_peak_bytes"], row["estimated_seconds"]
            estimated = f"{format_bytes(guess[0])}, {format_seconds(guess[1])}"
        table.add_row(row["name"], best["mesh"], Text(peak, style=None if best["fits"] else "red"),
                      format_seconds(st["seconds"]) if st else "-", lag, estimated)  # fmt: skip
    return table
