"""The ``shardmem`` command: thin wrappers that parse arguments and call the library.

Exit codes: 0 success (plan: fits; train: finished or stopped by SIGTERM with a checkpoint), 3 the
plan does not fit, 5 the plan is tight (over the budget only by the deviceless margin: likely fits), 2 a
config or usage error (printed without a traceback), 4 training diverged (NaN or infinite loss, gradient
or state), 130 interrupted (Ctrl-C: every command stops at once, even mid-compile, see
:mod:`shardmem._interrupt`; ``train`` from its first step saves a checkpoint first).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import json
import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from rich.console import Console

from shardmem._files import check_writable
from shardmem._interrupt import ends_on_interrupt
from shardmem.errors import ConfigError, DoesNotFit, ShardmemError, at_least, did_you_mean, one_of
from shardmem.planning.targets import MIG_TARGETS, TARGET_NAMES, is_target_name
from shardmem.remat import DESCRIPTIONS
from shardmem.units import format_bytes

EXIT_OK, EXIT_USAGE, EXIT_DOES_NOT_FIT = 0, 2, 3
EXIT_DIVERGED, EXIT_TIGHT, EXIT_INTERRUPTED = 4, 5, 130


def console(fit=None) -> Console:
    """A console that does not squeeze tables to 80 columns when output goes to a file or pipe: there
    it is 120 columns wide, or as wide as the rich renderable ``fit`` is unwrapped."""
    out = Console()
    if out.is_terminal:
        return out
    needed = out.measure(fit, options=out.options.update_width(10_000)).maximum if fit is not None else 0
    return Console(width=max(120, needed))


def _target(name: str) -> str:
    """An argparse type for --target: a known target, or an error that suggests the nearest ones."""
    if is_target_name(name):
        return name
    names = (*TARGET_NAMES, *MIG_TARGETS)
    near = [t for t in names if name and t.startswith(name)]  # h100 -> h100-sxm, h100-pcie
    near += [t for t in difflib.get_close_matches(name, names, n=2, cutoff=0.5) if t not in near]
    hint = f"did you mean {' or '.join(near[:2])}? " if near else ""
    raise argparse.ArgumentTypeError(
        f"unknown target {name!r}: {hint}choose from {', '.join(TARGET_NAMES)}, a MIG slice such as "
        "h100-sxm-mig-3g.40gb (shardmem policies lists them) or a TPU slice such as v5p-64"
    )


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file (see configs/)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set remat.policy=full (YAML value)",
    )


def _load(args, *, planning_only: bool = False):
    """Loads the config. For a plan that runs nothing (any target but ``local``), keeps JAX off an
    attached GPU, whose client would otherwise start and reserve most of its memory; a plan for
    ``local`` gets the allocator limit ``train`` would run with, so both budget alike."""
    from shardmem.config import load_config
    from shardmem.planning.targets import configure_local_memory

    config = load_config(args.config, args.overrides)
    if planning_only:
        if (getattr(args, "target", None) or config.memory.target) == "local":
            configure_local_memory(config)
        else:
            import jax

            jax.config.update("jax_platforms", "cpu")
    return config


#: A plan still compiling after this long says so, and again every _PROGRESS_EVERY_S (libtpu's compile of a
#: large model takes minutes, without a word).
_PROGRESS_AFTER_S, _PROGRESS_EVERY_S = 20.0, 60.0


@contextlib.contextmanager
def _progress_lines(what: str) -> Iterator[None]:
    """While the block runs past :data:`_PROGRESS_AFTER_S`, a line on stderr now and then: it still runs."""
    from shardmem._quiet import say

    done, started = threading.Event(), time.monotonic()

    def tell() -> None:
        wait = _PROGRESS_AFTER_S
        while not done.wait(wait):
            say(f"shardmem: still {what} ({time.monotonic() - started:.0f} s so far)\n")
            wait = _PROGRESS_EVERY_S

    teller = threading.Thread(target=tell, name="shardmem-progress", daemon=True)
    teller.start()
    try:
        yield
    finally:
        done.set()
        teller.join()


def _same_file(path: str, other: str) -> bool:
    same = os.path.realpath(path) == os.path.realpath(other)
    if not same and os.path.exists(path) and os.path.exists(other):
        same = os.path.samefile(path, other)  # A hard link.
    return same


def _check_not_the_input(out: str, config_path: str) -> None:
    """Raises ConfigError when ``--out`` names the config file read: writing the tuned YAML there would
    lose its comments and whatever the tuned config does not repeat."""
    if _same_file(out, config_path):
        stem, ext = os.path.splitext(out)
        raise ConfigError(f"--out {out!r} is the input config, which the tuned one would overwrite (its "
                          f"comments lost); write beside it, e.g. --out {stem}-tuned{ext}")  # fmt: skip


def cmd_plan(args) -> int:
    with ends_on_interrupt():  # Ctrl-C ends a compile of minutes at once: exit 130.
        return _plan(args)


def _plan(args) -> int:
    from shardmem.planning.memory import plan
    from shardmem.planning.report import render, render_refused, sharding_json

    at_least("--top", args.top, 0, "give the number of buffers to list, 0 or more")
    for value, flag in ((args.memory_fraction, "--memory-fraction"), (args.capacity, "--capacity")):
        if value is not None and value is not False and not args.serve:
            raise ConfigError(f"{flag} sizes the serving plan's KV cache: add --serve, or leave {flag} out")
    for path, flag, ext in ((args.html, "--html", ".html"), (args.png, "--png", ".png")):
        if path and _same_file(path, args.config):  # The picture would replace the config.
            beside = f"{os.path.splitext(path)[0]}{ext}"
            raise ConfigError(f"{flag} {path!r} is the input config, which the timeline would overwrite; "
                              f"write it beside it, e.g. {flag} {beside}")  # fmt: skip
        if path:
            check_writable(path, flag)
    if args.html and args.png and _same_file(args.html, args.png):
        raise ConfigError(f"--html and --png both name {args.png!r}: the image would overwrite the page; "
                          "give each a file of its own")  # fmt: skip
    config = _load(args, planning_only=True)
    target = args.target or config.memory.target
    if args.serve:
        return _plan_serving(args, config, target)
    try:
        with _progress_lines(f"compiling the step of {config.name} for {target}"):
            report = plan(config, args.target, top=args.top)
    except DoesNotFit as e:  # libtpu refused the step as over the chip's HBM: no report, still a verdict.
        if args.json:
            known = {**e.per_device, "temp": e.required_bytes} if e.per_device else {}
            verdict = {"name": config.name, "target": target, "fits": False, "verdict": "does not fit",
                       "refused_by_compiler": True, "required_bytes": e.required_bytes,
                       "available_bytes": e.available_bytes, "per_device": known,
                       "error": str(e)}  # fmt: skip
            print(json.dumps(verdict, indent=2), flush=True)
        else:
            console().print(render_refused(e, config.name, target))
        print(f"shardmem: error: {e}", file=sys.stderr)
        return e.exit_code  # The verdict is printed: main() adds no error object.
    if args.json:
        data = report.to_json()
        if args.sharding:
            data["sharding"] = sharding_json(report.sharding)
        print(json.dumps(data, indent=2), flush=True)
    else:
        console().print(render(report, sharding=args.sharding))
    _write_timeline(args, report)
    return {"fits": EXIT_OK, "tight": EXIT_TIGHT, "does not fit": EXIT_DOES_NOT_FIT}[report.verdict]


def _write_timeline(args, report, what: str = "") -> None:
    """Writes ``report``'s memory timeline where ``--html`` and ``--png`` say, if they do."""
    if not (args.html or args.png):
        return
    from shardmem._files import staged
    from shardmem.planning.timeline import timeline

    figure = timeline(report)
    for path, flag, save in (
        (args.html, "--html", figure.save_html),
        (args.png, "--png", figure.save_png),
    ):
        if path:
            with staged([path], flag) as (temporary,):  # Whole or not at all: the old file otherwise.
                save(temporary)
    written = " and ".join(path for path in (args.html, args.png) if path)
    print(f"wrote the memory timeline{what} to {written}", file=sys.stderr)


def _plan_serving(args, config, target: str) -> int:
    """``plan --serve``: the serving program's prefill and decode, compiled for the target."""
    from shardmem.planning.report import render_serving, sharding_json
    from shardmem.planning.serving import plan_serving, search_capacity, with_memory_fraction

    config = with_memory_fraction(config, args.memory_fraction)
    with _progress_lines(f"compiling the prefill and decode of {config.name} for {target}"):
        if args.capacity:
            plan = search_capacity(config, args.target)
        else:
            plan = plan_serving(config, args.target, top=args.top)
    if args.json:
        data = plan.to_json()
        if args.sharding:
            data["sharding"] = sharding_json(plan.decode.sharding)
        print(json.dumps(data, indent=2), flush=True)
    else:
        console().print(render_serving(plan, sharding=args.sharding))
    _write_timeline(args, plan.peaked, f" of the {plan.peaked_function} (the serving peak)")
    return {"fits": EXIT_OK, "tight": EXIT_TIGHT, "does not fit": EXIT_DOES_NOT_FIT}[plan.verdict]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardmem",
        description="Declarative sharding and rematerialization for JAX, checked before a run.",
    )
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="print shardmem's, JAX's and Python's versions and exit")  # fmt: skip
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser(
        "plan",
        help="compile the training step ahead of time and report per-device memory",
        description="Compiles the config's training step on abstract shapes for a target and reports "
        "the peak device memory, what it is made of, and whether it fits. Exit 0: fits; 5: tight (over "
        "the budget only by the deviceless margin, within the device's usable memory: likely fits); 3: "
        "does not fit; 2: config error.",
    )
    _config_args(p)
    p.add_argument(
        "--target",
        type=_target,
        metavar="TARGET",
        help=f"where to plan for (default: memory.target): {', '.join(TARGET_NAMES)}, a MIG slice such as "
        "h100-sxm-mig-3g.40gb, or a TPU slice such as v5p-64",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--top", type=int, default=10, help="buffers live at the peak to list")
    p.add_argument("--sharding", action="store_true", help="also print the parameter sharding table")
    p.add_argument("--html", metavar="PATH", help="write the memory timeline as a self-contained HTML page")
    p.add_argument("--png", metavar="PATH", help="write the memory timeline as a PNG image")
    p.add_argument("--serve", action="store_true",
                   help="plan the serving program instead (the serve section): its prefill and decode step, "
                   "the weights, the KV cache and each one's temporaries per device, time to first token, "
                   "decode step time beside its HBM bound, output tokens/s, the KV cache's room")  # fmt: skip
    p.add_argument("--memory-fraction", type=float, metavar="F",
                   help="with --serve: the budget is F x device memory, nothing else held back (vLLM's "
                   "gpu_memory_utilization), in place of memory.usable_fraction, reserve and the deviceless "
                   "margin")  # fmt: skip
    p.add_argument("--capacity", action="store_true",
                   help="with --serve: find the largest serve.batch and the longest serve.max_len that "
                   "fit by compiles (two points, then the answer and one step past it, each), not "
                   "from the plan's bytes per token")  # fmt: skip
    p.set_defaults(run=cmd_plan)

    p = commands.add_parser("policies", help="list remat policies, model presets and targets")
    p.set_defaults(run=cmd_policies)
    _add_train_commands(commands)
    _add_explore_commands(commands)
    parser.set_defaults(commands=tuple(commands.choices))  # What launch may start in each process.
    return parser


class _Version(argparse.Action):
    """``--version``: what a bug report needs, shardmem's version and the JAX and Python it runs on (read
    when asked, not each time the parser is built)."""

    def __call__(self, parser, namespace, values, option_string=None):
        import platform
        from importlib import metadata

        import jax

        try:
            version = metadata.version("shardmem")
        except metadata.PackageNotFoundError:  # Run from a checkout on PYTHONPATH, not installed.
            version = "(not installed)"
        jaxlib = metadata.version("jaxlib")
        python = platform.python_version()
        print(f"shardmem {version} (jax {jax.__version__}, jaxlib {jaxlib}, python {python})")
        parser.exit()


def cmd_train(args) -> int:
    # Ctrl-C before the first step ends the process at once (exit 130), even mid-compile, and takes back
    # what the start made; from the first step on, the loop stops at the next step and saves first.
    with ends_on_interrupt():
        code, stopped = _train(args)
    if stopped:
        # Stopped by a signal and saved: another Ctrl-C while Python and JAX tear down just ends the
        # process, instead of a KeyboardInterrupt traceback from some atexit hook.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    return code


def _train(args) -> tuple[int, bool]:
    """Returns the exit code, and whether a signal stopped the run (saved)."""
    from shardmem.planning.report import render
    from shardmem.run.training import DivergedError, DoesNotFitError, start_runtime, train

    config = _load(args)
    start_runtime(config, coordinator=args.coordinator, num_processes=args.num_processes,
                  process_id=args.process_id, local_devices=args.local_devices)  # fmt: skip
    out = console()
    try:
        result = train(config, args.run_dir or f"runs/{config.name}", force=args.force, console=out)
    except DoesNotFitError as e:
        out.print(render(e.report))
        print(f"shardmem: error: {e}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT, False
    except DivergedError as e:
        print(f"shardmem: error: {e}", file=sys.stderr)
        return EXIT_DIVERGED, False
    code = EXIT_INTERRUPTED if result.status == "interrupted" else EXIT_OK
    return code, result.status != "finished"


def cmd_export(args) -> int:
    with ends_on_interrupt():  # Ctrl-C ends it at once, exit 130; the file being written goes first.
        return _export(args)


def _export(args) -> int:
    import jax

    from shardmem._quiet import native_stderr_silenced
    from shardmem.finetune.export import export_run
    from shardmem.planning.targets import ensure_cpu_devices

    config = _load(args)
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        ensure_cpu_devices(config.mesh.device_count())
    with native_stderr_silenced():
        jax.devices()  # Start the backends now, without the CUDA stub's expected complaint (as train does).
    run_dir = args.run_dir or f"runs/{config.name}"
    step, files = export_run(config, run_dir, args.out, dtype=jax.numpy.dtype(args.dtype),
                             adapters_only=args.adapters_only, force=args.force, step=args.step,
                             warn=lambda line: print(f"warning: {line}", file=sys.stderr))  # fmt: skip
    lora = " (LoRA merged)" if config.finetune.lora else ""
    what = "the adapters" if args.adapters_only else f"the weights{lora}"
    beside = f", with {', '.join(f.name for f in files[1:])}" if files[1:] else ""
    print(f"wrote {what} of step {step} to {files[0]}{beside}", file=sys.stderr)
    adapter_config = next((f for f in files if f.name == "adapter_config.json"), None)
    if (
        adapter_config is not None
        and json.loads(adapter_config.read_text())["base_model_name_or_path"] is None
    ):
        print(f"warning: {adapter_config} names no base model (base_model_name_or_path: null): the base, "
              f"finetune.init_from={config.finetune.init_from!r}, is not a Hugging Face checkpoint PEFT can "
              "load; export that base run merged, and set the field to its folder",
              file=sys.stderr)  # fmt: skip
    return EXIT_OK


def cmd_launch(args) -> int:
    from shardmem.run.distributed import launch

    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise ConfigError("launch needs a command after --, e.g. shardmem launch --nproc 2 -- train "
                          "configs/tiny.yaml")  # fmt: skip
    names = args.commands
    if argv[0] not in names:  # Each process would print the same usage error.
        raise ConfigError(f"launch -- {argv[0]!r}: not a shardmem command{did_you_mean(argv[0], names)}; "
                          f"give one of {one_of(names)}, e.g. shardmem launch --nproc 2 -- train "
                          "configs/tiny.yaml")  # fmt: skip
    if argv[0] not in _JOINED:  # The others ignore the launcher's variables: N copies of one command.
        raise ConfigError(f"launch -- {argv[0]}: only train and generate join the processes into one "
                          f"JAX run; each process would run its own {argv[0]} alone, so run "
                          f"`shardmem {argv[0]} ...` without launch (it uses every device of this "
                          "machine)")  # fmt: skip
    for arg in argv[1:]:  # The launcher sets these; the command's own would win.
        name = arg.split("=", 1)[0]
        flag = next((f for f in _LAUNCHER_SETS if len(name) > 3 and f.startswith(name)), None)
        if flag is not None:
            raise ConfigError(f"{arg!r} after launch --: launch --nproc {args.nproc} gives each process "
                              f"its {flag} (the processes would wait for peers that never start); drop "
                              f"{flag}")  # fmt: skip
    if argv[0] == "generate":  # Its mistakes are said once, here, not by each process.
        _generation_inputs(build_parser().parse_args(argv))
    return launch(args.nproc, argv, devices_per_process=args.local_devices)


#: The commands launch starts: each joins its processes into one JAX run (shardmem.run.distributed.start).
_JOINED = ("train", "generate")
#: The flags of train and generate that launch sets for each process it starts (argparse also takes their
#: prefixes).
_LAUNCHER_SETS = ("--coordinator", "--num-processes", "--process-id")


def cmd_generate(args) -> int:
    with ends_on_interrupt():  # Ctrl-C ends it at once, exit 130, even mid-compile.
        return _generate(args)


def _sampling(args):
    """The sampling the flags ask for; the sampling flags without a temperature are a mistake (greedy
    decoding would ignore them)."""
    from shardmem.run.sampling import Sampling

    given = {"--top-k": args.top_k, "--top-p": args.top_p, "--seed": args.seed}
    ignored = [flag for flag, value in given.items() if value is not None]
    if ignored and not args.temperature:
        apply = "apply" if len(ignored) > 1 else "applies"
        raise ConfigError(f"{' and '.join(ignored)} only {apply} to sampling, and --temperature "
                          f"{args.temperature:g} decodes greedily: add --temperature, e.g. 0.7, or drop "
                          f"{'them' if len(ignored) > 1 else 'it'}")  # fmt: skip
    return Sampling(args.temperature, args.top_k or 0, 1.0 if args.top_p is None else args.top_p,
                    args.seed or 0)  # fmt: skip


@contextlib.contextmanager
def _out_of_memory_named(program, devices):
    """Turns the devices running out of memory for the weights or the KV cache into a ConfigError naming
    what they hold and the keys that size them (``plan --serve`` says beforehand whether they fit)."""
    import jax

    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e) and "Out of memory" not in str(e):
            raise
        from shardmem.planning.memory import per_device_bytes

        s = program.serving
        cache = per_device_bytes(s.cache)
        raise ConfigError(
            f"out of memory on the {devices[0].platform} devices: the KV cache takes {format_bytes(cache)} "
            f"per device (serve.batch={s.batch} x serve.max_len={s.max_len}) beside the weights; lower "
            "serve.max_len or serve.batch, or set serve.kv_dtype=int8 (shardmem plan CONFIG --serve --target "
            "local says what fits)"
        ) from None


class _GenerationInputs(NamedTuple):
    """What generate runs with, checked before anything is built (``launch -- generate`` checks them too)."""

    sampling: Any  # shardmem.run.sampling.Sampling
    prompts: list[list[int]]  # Token ids (text prompts encoded).
    eos: tuple[int, ...]
    config: Any  # shardmem.config.Config
    notes: list[str]  # Said with the first tokens.
    tokenizer: Any  # tokenizers.Tokenizer of text prompts; None for token ids.


def _generation_inputs(args) -> _GenerationInputs:
    """Reads and checks generate's flags and config (see :class:`_GenerationInputs`)."""
    from shardmem.run import generation

    at_least("--max-new-tokens", args.max_new_tokens, 1, "generate at least 1 token")
    sampling = _sampling(args)
    for flag, value in (("--tokenizer", args.tokenizer), ("--chat", args.chat or None)):
        if value is not None and args.prompt is None:
            raise ConfigError(f"{flag} only applies to text prompts (--prompt TEXT); token ids need none")
    if args.prompt_ids is not None:
        prompts = [generation.parse_prompt_ids(args.prompt_ids)]
    elif args.prompt_file is not None:
        prompts = generation.read_prompts(args.prompt_file)
    eos = generation.parse_prompt_ids(args.eos, "--eos") if args.eos is not None else None
    config = _load(args)
    tokenizer = source = None
    if args.prompt is not None:
        file = generation.tokenizer_file(config, args.tokenizer)
        source = f"--tokenizer {str(file)!r}" if args.tokenizer else f"{str(file)!r} (finetune.init_from's)"
        tokenizer = generation.load_tokenizer(file)
        if args.chat:  # The template writes the special tokens.
            chats = [generation.chat_text(file, text) for text in args.prompt]
            prompts = [tokenizer.encode(chat, add_special_tokens=False).ids for chat in chats]
        else:  # Its special tokens too (BOS), as transformers' tokenizer adds them.
            prompts = [tokenizer.encode(text).ids for text in args.prompt]
        for text, ids in zip(args.prompt, prompts, strict=True):
            if not ids:
                raise ConfigError(f"--prompt {text!r} encodes to no tokens (its tokenizer adds no BOS); give "
                                  "it some text")  # fmt: skip
    notes = [generation.weights_note(config, args.config)]
    if eos is None:
        eos = generation.checkpoint_eos(config)
        notes.append(generation.run_base_note(config, eos))
    generation.check_prompts(config, prompts, args.max_new_tokens, eos, tokenizer=source)
    notes = [note for note in notes if note is not None]
    return _GenerationInputs(sampling, prompts, eos, config, notes, tokenizer)


def _generate(args) -> int:
    import jax

    from shardmem.parallel.mesh import build_mesh
    from shardmem.planning.targets import configure_local_memory
    from shardmem.program.serving import serving_program
    from shardmem.run import distributed, generation

    sampling, prompts, eos, config, notes, tokenizer = _generation_inputs(args)  # Before anything is built.
    configure_local_memory(config)  # A GPU's allocator holds what plan --serve --target local budgets.
    # One process, or one of several (launch, a cluster's job) that together hold the mesh, as train does.
    distributed.start(config.mesh.device_count(), args.coordinator, args.num_processes, args.process_id,
                      args.local_devices)  # fmt: skip
    if jax.process_count() > 1 and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # Ends it, as alone; not JAX's preemption notifier.
    devices = jax.devices()
    program = serving_program(config, build_mesh(config.mesh.axes, devices))
    lead = jax.process_index() == 0  # Every process draws the same tokens; the first one prints them.
    stream = sys.stderr if args.json else sys.stdout  # With --json, stdout holds the JSON object alone.

    shown = tokenizer is not None and lead  # Text, printed by the first process.
    texts = [generation.TextStream(tokenizer, prompt) for prompt in prompts] if shown else []

    def show(step: int, tokens: list) -> None:
        if not lead:
            return
        while notes:
            print(notes.pop(0), file=sys.stderr, flush=True)
        if not texts:
            print(" ".join("-" if t is None else str(t) for t in tokens), file=stream, flush=True)
            return
        added = [text.step(token) if token is not None and token not in eos else ""  # An EOS adds no text.
                 for text, token in zip(texts, tokens, strict=True)]  # fmt: skip
        if len(texts) == 1:  # One prompt's text as it comes; several prompts' each at the end.
            print(added[0], end="", file=stream, flush=True)

    started = time.monotonic()
    with _out_of_memory_named(program, devices):
        weights = program.init()
        result = generation.generate(program, weights, prompts, max_new_tokens=args.max_new_tokens,
                                     sampling=sampling, eos=eos, on_step=show)  # fmt: skip
    seconds = time.monotonic() - started
    if not lead:
        return EXIT_OK
    made = sum(len(t) for t in result.tokens)
    completions = [text.text for text in texts]
    if len(texts) == 1:
        print(file=stream, flush=True)  # The streamed text's line ends.
    elif texts:
        for i, completion in enumerate(completions):
            print(f"[{i}] {completion}", file=stream, flush=True)
    if args.json:
        text = {"text": completions} if texts else {}
        print(json.dumps({**result.to_json(), **text, "seconds": round(seconds, 3)}), flush=True)
    plural = lambda n: "s" * (n != 1)  # noqa: E731
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    print(f"generated {made} token{plural(made)} for {len(prompts)} prompt{plural(len(prompts))} in "
          f"{seconds:.1f} s (compiles included) on {len(devices)} {devices[0].platform} "
          f"device{plural(len(devices))}{processes}", file=sys.stderr)  # fmt: skip
    return EXIT_OK


def _process_args(p: argparse.ArgumentParser) -> None:
    """The flags of a command that runs in one process or joins several into one JAX run (train, generate:
    shardmem.run.distributed.start)."""
    p.add_argument("--local-devices", type=int, metavar="N",
                   help="simulated CPU devices per process (default: as many as the mesh needs)")  # fmt: skip
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="multi-process: the coordinator of process 0 (or SHARDMEM_COORDINATOR)")  # fmt: skip
    p.add_argument("--num-processes", type=int, metavar="N",
                   help="multi-process: how many processes (or SHARDMEM_NUM_PROCESSES)")  # fmt: skip
    p.add_argument("--process-id", type=int, metavar="I",
                   help="multi-process: this process's index (or SHARDMEM_PROCESS_ID)")  # fmt: skip


def _add_train_commands(commands) -> None:
    p = commands.add_parser(
        "train",
        help="train a config: gated by the memory plan, checkpointed, resumable, multi-process",
        description="Plans the step for the attached devices and refuses to start when it does not "
        "fit (exit 3; --force runs anyway), then trains, logging to RUN_DIR/metrics.jsonl and "
        "checkpointing to RUN_DIR/checkpoints. A run directory with checkpoints resumes from the "
        "newest. SIGTERM or SIGINT saves a checkpoint and stops (exit 0, or 130 for SIGINT). "
        "Exit 2: config error (also a bad token id found mid-run, once the steps done are saved); "
        "4: the loss, the gradient or the state became NaN or infinite.",
    )
    _config_args(p)
    p.add_argument("--run-dir", help="where checkpoints and metrics go (default: runs/<config name>)")
    p.add_argument("--force", action="store_true", help="train even when the plan says it does not fit")
    _process_args(p)
    p.set_defaults(run=cmd_train)

    p = commands.add_parser(
        "export",
        help="write a run's trained weights as safetensors (LoRA merged, or the adapters alone)",
        description="Restores the newest checkpoint of RUN_DIR (or --step N's) and writes "
        "OUT/model.safetensors: Hugging Face Llama names for the reference model (LoRA merged into its "
        "matrices, a quantized base dequantized) with the config.json transformers loads it by, a model of "
        "your own's parameter paths; with --adapters-only PEFT's OUT/adapter_model.safetensors and "
        "adapter_config.json. Each file is complete or not there: an error, a full disk or Ctrl-C leaves OUT "
        "as it was. Exit 2: config error, no checkpoint, a config other than the run's, an export already in "
        "OUT (--force replaces it) or a value --dtype cannot hold; 130: interrupted.",
    )
    _config_args(p)
    p.add_argument("--run-dir", help="the run to export (default: runs/<config name>)")
    p.add_argument("--step", type=int, metavar="N",
                   help="export the checkpoint of step N (default: the run's newest)")  # fmt: skip
    p.add_argument("--out", required=True, metavar="FOLDER",
                   help="where the files go (created; never the run's finetune.init_from)")  # fmt: skip
    p.add_argument("--force", action="store_true", help="replace the files of an earlier export in --out")
    p.add_argument("--adapters-only", action="store_true", help="write the LoRA adapters alone (PEFT layout)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="the dtype of the tensors written (default: bfloat16)")  # fmt: skip
    p.set_defaults(run=cmd_export)

    p = commands.add_parser(
        "launch",
        help="run N local processes of train or generate, e.g. launch --nproc 2 -- train CONFIG",
        description="Starts N processes of `shardmem train ARGS...` or `shardmem generate ARGS...` on this "
        "machine, joined into one JAX run over loopback, and prefixes their output with [i] (generate's "
        "tokens come from process 0 alone). Signals are forwarded.",
    )
    p.add_argument("--nproc", type=int, required=True, help="how many processes")
    p.add_argument("--local-devices", type=int, metavar="K", help="simulated CPU devices per process")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- train|generate ...",
                   help="the train or generate command each process runs")  # fmt: skip
    p.set_defaults(run=cmd_launch)

    p = commands.add_parser(
        "generate",
        help="generate from prompts (text or token ids) with the serving program (prefill, KV-cache decode)",
        description="Builds the config's serving program (the serve section: batch, prompt_len, max_len, "
        "kv_dtype, quantize) on the devices there are (in several processes joined as train's are, e.g. "
        "launch --nproc 2 -- generate CONFIG, on all of theirs, process 0 alone printing), with random "
        "weights from train.seed or "
        "finetune.init_from's, prefills the prompts and decodes greedily or by sampling, printing one line "
        "per step as the tokens come: each prompt's next token, '-' for a prompt that has drawn EOS. Text "
        "prompts (--prompt) are encoded with the checkpoint's tokenizer.json and the new tokens printed as "
        "text: one prompt's as they come, several prompts' each at the end. Exit 2: config or usage error "
        "(a prompt longer than serve.prompt_len, more prompts than serve.batch, too little serve.max_len, "
        "no tokenizer, ...); 130: interrupted.",
    )
    _config_args(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", metavar="IDS", help="one prompt's token ids, e.g. 1,2,3")
    prompt.add_argument("--prompt-file", metavar="PATH",
                        help="a file of prompts, one line of token ids each (1 2 3 or 1,2,3)")  # fmt: skip
    prompt.add_argument("--prompt", metavar="TEXT", action="append",
                        help="a prompt's text (repeat it for more prompts), encoded with the "
                             "tokenizer")  # fmt: skip
    p.add_argument("--chat", action="store_true",
                   help="with --prompt: each prompt as a user message in the checkpoint's chat template "
                        "(tokenizer_config.json's), as transformers' apply_chat_template renders "
                        "it")  # fmt: skip
    p.add_argument("--tokenizer", metavar="PATH",
                   help="with --prompt: a tokenizer.json or its folder (default: the one beside "
                        "finetune.init_from's weights, a fine-tuned run's base's)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=16,
                   help="tokens to generate per prompt at most (default 16)")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0,
                   help="divides the logits before sampling; 0 is greedy (the largest logit)")  # fmt: skip
    p.add_argument(
        "--top-k", type=int, help="with --temperature: sample among the k likeliest tokens (0: all)"
    )
    p.add_argument("--top-p", type=float,
                   help="with --temperature: sample among the likeliest tokens whose probabilities add up "
                        "to p")  # fmt: skip
    p.add_argument("--seed", type=int,
                   help="with --temperature: seeds the sampling (default 0); the same seed gives the same "
                        "tokens")  # fmt: skip
    p.add_argument("--eos", metavar="IDS",
                   help="end-of-sequence token ids, e.g. 2 or 128001,128009 (default: finetune.init_from's "
                   "eos_token_id, from its generation_config.json or else its config.json, a fine-tuned "
                   "run's from the checkpoint it started from; else none)")  # fmt: skip
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout at the end (the steps on stderr)")  # fmt: skip
    _process_args(p)
    p.set_defaults(run=cmd_generate)


def cmd_sweep(args) -> int:
    with ends_on_interrupt(workers=True):  # Ctrl-C ends the workers mid-compile too: exit 130.
        return _sweep(args)


def _sweep(args) -> int:
    from rich.progress import Progress

    from shardmem.explore import sweep as sweeping

    config = _load(args, planning_only=not args.measure)
    grid = sweeping.parse_grid(args.grid)
    sweeping.check_grid_and_sets(grid, args.overrides or [])
    sweeping.check_options(config, args.target, jobs=args.jobs, measure=args.measure,
                           measure_steps=args.steps)  # fmt: skip
    sweeping.check_candidates(config, sweeping.candidates(grid))  # Before any output or compile.
    from shardmem._files import make_folder

    out_dir = str(make_folder(args.out or f"sweep-{config.name}", "--out"))
    check_writable(os.path.join(out_dir, "sweep.csv"), "--out")  # Now, not after the sweep.
    errors = Console(stderr=True)
    started = time.monotonic()
    if not errors.is_terminal:  # No live bar in a log or a pipe: say what runs, then a line per candidate.
        print(f"sweep: {len(sweeping.candidates(grid))} candidates; a line as each finishes", file=sys.stderr,
              flush=True)  # fmt: skip
    with Progress(console=errors, transient=True) as bar:
        task = bar.add_task("planning", total=None)

        def advance(done: int, total: int, row) -> None:
            bar.update(task, completed=done, total=total)
            if not errors.is_terminal:
                line = sweeping.progress_line(done, total, row, time.monotonic() - started)
                print(line, file=sys.stderr, flush=True)

        rows = sweeping.sweep(config, grid, args.target, jobs=args.jobs, measure=args.measure,
                     measure_steps=5 if args.steps is None else args.steps, progress=advance)  # fmt: skip
    paths = sweeping.write_outputs(rows, out_dir, title=f"{config.name}: sweep")
    if args.json:
        print(json.dumps([{**row.flat(), "collectives": row.collectives} for row in rows], indent=2))
    else:
        rendered = sweeping.render_sweep(rows, title=f"shardmem sweep  {config.name}")
        console(fit=rendered.renderables[0]).print(rendered)  # Wide enough for the table; errors wrap.
        console().print(f"wrote {paths['csv']}, {paths['json']}, {paths['png']}")
    if rows and all(row.error and row.fits is None for row in rows):  # A compiler's refusal is a verdict.
        print(f"shardmem: error: all {len(rows)} candidates failed; see their errors", file=sys.stderr)
        return EXIT_USAGE
    invalid = [row for row in rows if row.config_error]
    if invalid:  # A mistyped grid value must not pass unnoticed in a script: exit 2, like plan.
        first = invalid[0]
        print(f"shardmem: error: {len(invalid)} of {len(rows)} candidates are not valid configs; first "
              f"{first.candidate}: {first.error.splitlines()[0]}", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    if rows and not any(row.fits for row in rows):  # As plan exits: 5 if the best is tight, else 3.
        planned = [row for row in rows if row.peak_bytes is not None and row.budget_bytes is not None]
        best = min([row for row in planned if row.tight] or planned, key=lambda row: row.peak_bytes,
                   default=None)  # fmt: skip
        if best is None:  # Each one failed or was refused by the compiler (a TPU's), with no report.
            print("shardmem: no candidate fits; see their errors", file=sys.stderr)
            return EXIT_DOES_NOT_FIT
        verdict = "is tight" if best.tight else "does not fit"
        print(f"shardmem: no candidate fits; the {'smallest tight' if best.tight else 'smallest'} peak, "
              f"{best.candidate}'s "
              f"{format_bytes(best.peak_bytes)} per device, {verdict} in its budget of "
              f"{format_bytes(best.budget_bytes)}", file=sys.stderr)  # fmt: skip
        return EXIT_TIGHT if best.tight else EXIT_DOES_NOT_FIT
    return EXIT_OK


def cmd_tune(args) -> int:
    trials = []  # The search's trials as it goes: what Ctrl-C prints.
    with ends_on_interrupt(lambda: _print_interrupted_tune(trials, json_output=args.json), workers=True):
        return _tune(args, trials)


def _print_interrupted_tune(trials, *, json_output: bool) -> None:
    import dataclasses

    compiled = [t for t in trials if t.how == "compiled"]
    if json_output:
        data = {
            "interrupted": True,
            "compiles": len(compiled),
            "trials": [dataclasses.asdict(t) for t in trials],
        }
        print(json.dumps(data, indent=2))
        return
    print(f"interrupted after {len(compiled)} compiles" + ("; compiled so far:" if compiled else ""))
    for t in compiled:
        print(f"  {t.candidate}: {t.reason}")


def _tune(args, trials) -> int:
    from shardmem.explore.tune import render_tune, tune

    if args.out:
        _check_not_the_input(args.out, args.config)
    config = _load(args, planning_only=True)
    if args.out:
        check_writable(args.out, "--out")
    search = args.search or ("finetune" if config.finetune.active else "remat")
    default_compiles = {"layout": 40, "finetune": 16}.get(search, 12)
    max_compiles = args.max_compiles if args.max_compiles is not None else default_compiles
    progress = None
    if args.search in ("layout", "serve") and not args.json:
        progress = lambda message: print(f"  {message}", file=sys.stderr, flush=True)  # noqa: E731
    result = tune(config, args.target, search=search, allow_offload=False if args.no_offload else None,
                  max_compiles=max_compiles, objective=args.objective, jobs=args.jobs,
                  min_seq_len=args.min_seq_len, progress=progress, trials=trials)  # fmt: skip
    if result.found and args.out:
        header = "".join(f"# {line}\n" for line in result.explanation)
        try:
            with open(args.out, "w") as f:
                f.write(f"# shardmem tune --search {search}\n{header}{result.config.to_yaml()}")
        except OSError as e:
            raise ConfigError(f"--out {args.out!r}: cannot write the tuned config: {e.strerror}") from None
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        console().print(render_tune(result))
        if result.found and args.out:
            console().print(f"wrote {args.out}")
    return EXIT_OK if result.found else EXIT_DOES_NOT_FIT


def _add_explore_commands(commands) -> None:
    target_help = (f"where to plan for (default: memory.target): {', '.join(TARGET_NAMES)}, a MIG slice such "
                   "as h100-sxm-mig-3g.40gb, or a TPU slice such as v5p-64")  # fmt: skip
    p = commands.add_parser(
        "sweep",
        help="plan every combination of a grid of overrides: memory against compute",
        description="Plans every combination of the --grid values (in parallel worker processes) and "
        "tabulates peak memory per device, fit and margin, FLOPs per step, recomputation, host-offloaded "
        "bytes and collective traffic. Writes sweep.csv, sweep.json and sweep.png (peak memory against "
        "FLOPs or step time, budget line, Pareto front) to --out. A candidate that fails is a row with "
        "its error. Exit 0: a candidate fits; 5: none fits but one is tight; 3: no candidate fits; 2: "
        "config or usage error (in any candidate too), or every candidate failed.",
    )
    _config_args(p)
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...", required=True,
                   help="values to try for a config key (YAML), e.g. remat.policy=none,full")  # fmt: skip
    p.add_argument("--target", type=_target, metavar="TARGET", help=target_help)
    p.add_argument("--jobs", type=int, help="worker processes (default: CPUs, at most one per candidate)")
    p.add_argument("--measure", action="store_true",
                   help="also run real steps (target local or cpu): step time, peak memory")  # fmt: skip
    p.add_argument("--steps", type=int, help="timed steps per candidate with --measure (default 5)")
    p.add_argument("--out", help="directory for sweep.csv/json/png (default: sweep-<config name>)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    p.set_defaults(run=cmd_sweep)

    p = commands.add_parser(
        "tune",
        help="find the cheapest remat plan, largest batch, fewest micro-batches, fastest layout or the "
        "fine-tuning settings that fit",
        description="Searches with few compiles (analytic estimates order the candidates, compiles "
        "confirm, monotonicity prunes) and explains the choice against the rejected alternatives. "
        "Exit 0: found (written to --out); 3: nothing fits; 2: config error.",
    )
    _config_args(p)
    p.add_argument("--target", type=_target, metavar="TARGET", help=target_help)
    p.add_argument("--search", choices=("remat", "batch", "micro_batches", "layout", "finetune", "serve"),
                   help="what to tune (default: finetune for a config with a finetune section, else remat); "
                   "layout: the mesh, micro-batches, remat and ZeRO-1 with the shortest predicted step "
                   "time; finetune: LoRA rank, base quantization, remat, micro-batches (and sequence "
                   "length with --min-seq-len), with what each costs; serve: the reference decoder's serving "
                   "program's tensor degree and KV dtype (and batch, for throughput)")  # fmt: skip
    p.add_argument("--min-seq-len", type=int, metavar="N",
                   help="--search finetune may halve model.seq_len down to N (default: never)")  # fmt: skip
    p.add_argument("--objective", choices=("step_time", "throughput", "latency"),
                   help="--search layout ranks by predicted step time (default), or by tokens/s per device "
                   "at the largest batch that fits (throughput); --search serve by the static batch's "
                   "time (latency, default) or by output tokens/s at the largest batch that fits "
                   "(throughput)")  # fmt: skip
    p.add_argument(
        "--jobs", type=int, help="--search layout: worker processes for its compiles (default: CPUs)"
    )
    p.add_argument("--out", help="write the tuned config as YAML that plan and train accept")
    p.add_argument("--no-offload", action="store_true",
                   help="--search remat or layout: never move activations to host memory")  # fmt: skip
    p.add_argument("--max-compiles", type=int,
                   help="compile budget of the search, at least 2 (default: 12; for --search layout 40, "
                   "at least 3, the best layout of each family counted in it; for --search finetune "
                   "16)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.set_defaults(run=cmd_tune)


def cmd_policies(args) -> int:
    from shardmem.models.llama import PRESETS
    from shardmem.planning.targets import GPU_TARGETS, MIG_PROFILES, TPU_TARGETS

    out = console()
    out.print("[bold]remat policies[/bold]")
    for name, text in DESCRIPTIONS.items():  # A long description wraps under itself, not to column 0.
        out.print(textwrap.fill(text, out.width, initial_indent=f"  {name:<14} ", subsequent_indent=" " * 17),
                  markup=False, highlight=False)  # fmt: skip
    out.print("[bold]model presets[/bold]")
    for name, model in PRESETS.items():
        out.print(f"  {name:<14} {model.param_count():>15,} parameters")
    out.print("[bold]targets[/bold]")
    out.print("  cpu            simulated CPU devices (approximate)")
    out.print("  local          the attached accelerators")
    for name, spec in GPU_TARGETS.items():
        out.print(f"  {name:<14} {spec.description}, deviceless")
    for gpu, profiles in MIG_PROFILES.items():
        out.print(f"  {gpu}-mig-PROFILE  a MIG slice of the {GPU_TARGETS[gpu].description}, deviceless; "
                  f"PROFILE: {', '.join(profiles)}", soft_wrap=True)  # fmt: skip
    for name, tpu in TPU_TARGETS.items():
        example = f"{tpu.generation}-{8 * tpu.cores_per_chip}"
        out.print(f"  {name:<14} Cloud {tpu.description}, deviceless (libtpu); slices such as {example}, "
                  f"2x{example}")  # fmt: skip
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # With --json an error is a JSON object on stdout too ({"error": ..., "exit_code": ...}), so that a
    # script reading stdout always parses it; the message stays on stderr.
    wants_json = "--json" in argv[: argv.index("--")] if "--" in argv else "--json" in argv
    if not wants_json:
        args = parser.parse_args(argv)
    else:
        captured = io.StringIO()
        try:
            with contextlib.redirect_stderr(captured):
                args = parser.parse_args(argv)
        except SystemExit as e:
            if e.code:  # argparse's own errors: usage, then "shardmem ...: error: ..." last.
                said = captured.getvalue().strip().splitlines()
                print(json.dumps({"error": said[-1] if said else "", "exit_code": e.code}))
            raise
        finally:
            sys.stderr.write(captured.getvalue())
    try:
        return args.run(args)
    except ShardmemError as e:
        print(f"shardmem: error: {e}", file=sys.stderr)
        code = getattr(e, "exit_code", EXIT_USAGE)  # DoesNotFit is a verdict: 3.
        if wants_json:
            print(json.dumps({"error": str(e), "exit_code": code}))
        return code
    except KeyboardInterrupt:
        print("shardmem: interrupted", file=sys.stderr)
        return 130
