"""Generating tokens with a serving program: prefill the prompts, then decode one token per step.

    program = serving_program(config, build_mesh(config.mesh.axes, jax.devices()))
    result = generate(program, program.init(), [[1, 2, 3], [4, 5]], max_new_tokens=16,
                      sampling=Sampling(temperature=0.8, top_p=0.9, seed=0), eos=(2,),
                      on_step=lambda step, tokens: print(step, tokens))
    result.tokens       # each prompt's new tokens, up to and including its EOS

The prompts are one static batch of ``serve.batch`` rows (fewer are padded with placeholder rows whose
tokens are dropped), right-padded to ``serve.prompt_len``. Each step samples every sequence's next token
(:mod:`shardmem.run.sampling`), hands it to ``on_step`` as it comes and decodes it into the KV cache at
that sequence's own position; a sequence that draws one of the ``eos`` ids is finished, and the loop ends
when every one is or after ``max_new_tokens``. The mesh may span processes (``shardmem launch -- generate``,
:func:`shardmem.run.distributed.start`): each one calls ``generate`` with the same prompts, puts its own
devices' part of them, and reads every token back (they are gathered to each device), so all draw the
same tokens. It takes token ids (:func:`checkpoint_eos` reads the ids a Hugging Face checkpoint ends
with); ``shardmem generate --prompt TEXT`` encodes text, and decodes the new tokens, with the
checkpoint's own tokenizer (:func:`load_tokenizer`, :class:`TextStream`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np
import yaml
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardmem.errors import ConfigError
from shardmem.program.serving import ServingProgram
from shardmem.run.sampling import Sampling, sample


@dataclasses.dataclass(frozen=True)
class Generation:
    """What :func:`generate` made: each prompt's new ``tokens`` (its EOS last where it drew one), and
    whether it ``finished`` (drew ``eos``) before ``max_new_tokens``."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    finished: list[bool]
    steps: int  # Tokens sampled per sequence: max_new_tokens, or fewer when every sequence finished.

    def to_json(self) -> dict:
        """Returns the generation as plain JSON-ready data (``shardmem generate --json``)."""
        return dataclasses.asdict(self)


def parse_prompt_ids(text: str, where: str = "--prompt-ids") -> list[int]:
    """Returns the token ids of a comma- (or space-) separated list such as ``1,2,3``; ConfigError
    naming ``where`` for anything else."""
    parts = [p for p in text.replace(",", " ").split() if p]
    if not parts:
        raise ConfigError(f"{where} is empty: give token ids such as 1,2,3")
    # Plain ASCII integers only: int() also takes "1_0", "²" and other digits, which are typing mistakes.
    bad = next((p for p in parts if not re.fullmatch(r"-?[0-9]+", p)), None)
    if bad is not None:
        raise ConfigError(f"{where}: {bad!r} is not a token id; give integers such as 1,2,3")
    return [int(p) for p in parts]


def read_prompts(path: str | Path, flag: str = "--prompt-file") -> list[list[int]]:
    """Returns the prompts of a file of token-id lines (``1 2 3`` or ``1,2,3`` per line; blank lines
    skipped)."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or "not a text file"
        raise ConfigError(f"{flag} {str(path)!r}: cannot read it ({reason}); give a file of token-id lines "
                          "such as 1 2 3") from None  # fmt: skip
    prompts = [parse_prompt_ids(line, f"{flag} {path} line {i}")
               for i, line in enumerate(lines, 1) if line.strip()]  # fmt: skip
    if not prompts:
        raise ConfigError(f"{flag} {str(path)!r} has no prompts: write one line of token ids per prompt")
    return prompts


def generate(
    program: ServingProgram,
    weights,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    eos: Sequence[int] = (),
    on_step: Callable[[int, list[int | None]], None] | None = None,
) -> Generation:
    """Returns ``max_new_tokens`` (fewer after ``eos``) new tokens for each of ``prompts`` from the serving
    ``program`` with ``weights`` (``program.init()``), greedy unless ``sampling`` says otherwise.
    ``on_step(step, tokens)`` sees each step's tokens as they come, one per prompt (None for a prompt
    finished before). Raises ConfigError for prompts or lengths the program's ``serve`` section has no
    room for, naming the key to raise."""
    sampling = sampling or Sampling()
    serving = program.serving
    check_prompts(program.config, prompts, max_new_tokens, eos, vocab=serving.vocab)
    rows = len(prompts)
    prompts_BxP = np.zeros((serving.batch, serving.prompt_len), np.int32)
    lengths_B = np.ones(serving.batch, np.int32)  # Placeholder rows: one token each, dropped.
    for i, prompt in enumerate(prompts):
        prompts_BxP[i, : len(prompt)] = prompt
        lengths_B[i] = len(prompt)
    # The tokens twice: as decode takes them, and replicated, which every process can read whole.
    replicated = NamedSharding(serving.rows.mesh, P())
    choose = jax.jit(functools.partial(_choose, sampling=sampling), in_shardings=(serving.logits, replicated),
                     out_shardings=(serving.rows, replicated))  # fmt: skip
    prompts_BxP, lengths_B = _global(prompts_BxP, serving.tokens), _global(lengths_B, serving.rows)
    logits_BxV, cache = program.prefill(weights, program.new_cache(), prompts_BxP, lengths_B)
    positions_B = lengths_B  # Each sequence's first new token goes at its prompt's length.
    new: list[list[int]] = [[] for _ in range(rows)]
    finished = [False] * rows
    step = 0
    while True:
        tokens_B, everywhere_B = choose(logits_BxV, _global(np.int32(step), replicated))
        drawn = np.asarray(everywhere_B.addressable_data(0))[:rows].tolist()
        shown: list[int | None] = []
        for i, token in enumerate(drawn):
            shown.append(None if finished[i] else token)
            if not finished[i]:
                new[i].append(token)
                finished[i] = token in eos
        step += 1
        if on_step is not None:
            on_step(step - 1, shown)
        if step == max_new_tokens or all(finished):
            break
        logits_BxV, cache = program.decode(weights, cache, tokens_B, positions_B)
        positions_B = positions_B + 1
    return Generation([list(p) for p in prompts], new, finished, step)


def _choose(logits_BxV, step, sampling: Sampling):
    """Samples each sequence's next token with step ``step``'s key; returns it twice (two shardings)."""
    tokens_B = sample(logits_BxV, jax.random.fold_in(sampling.key(), step), sampling=sampling)
    return tokens_B, tokens_B


def _global(values: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """``values``, which every process holds the same of, as one array over the sharding's mesh: each
    process puts its own devices' parts (the mesh may span processes, whose devices it cannot reach)."""
    return jax.make_array_from_callback(values.shape, sharding, lambda index: values[index])


def check_prompts(config, prompts, max_new_tokens: int, eos: Sequence[int] = (), *,
                  vocab: int | None = None, tokenizer: str | None = None) -> None:  # fmt: skip
    """Raises ConfigError for prompts (and ``eos`` ids) the config's model and ``serve`` section cannot
    take, or a ``max_new_tokens`` the KV cache has no room for, naming the key to change: before anything
    is built. ``vocab``: the model's vocabulary (default: ``model.vocab_size``; a model of your own's is
    known once its program is, ``program.serving.vocab``, and unchecked without it). ``tokenizer``: which
    tokenizer encoded text prompts (``--tokenizer 'x/tokenizer.json'``), named where their ids do not fit
    the model."""
    serving = config.serve
    vocab = vocab if vocab is not None else getattr(config.model, "vocab_size", None)
    # The reference model's vocabulary is a key; a model of your own's is its logits' last axis.
    size = f"model.vocab_size={vocab}" if hasattr(config.model, "vocab_size") else f"{vocab} tokens"
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={max_new_tokens}: generate at least 1 token")
    if not prompts:
        raise ConfigError("no prompts: give --prompt-ids 1,2,3 or a --prompt-file of token-id lines")
    if len(prompts) > serving.batch:
        n, shards = len(prompts), _batch_shards(config)
        batch = -(-n // shards) * shards  # The batch splits over the devices rules.batch names.
        why = f" (a multiple of the {shards} devices rules.batch splits it over)" if batch != n else ""
        raise ConfigError(f"{n} prompts, but serve.batch={serving.batch} sequences are decoded together; "
                          f"set serve.batch={batch}{why} (--set serve.batch={batch}) or give fewer "
                          "prompts")  # fmt: skip
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ConfigError(f"prompt {i} is empty: give it at least one token id")
        if len(prompt) > serving.prompt_len:
            n = len(prompt)
            raise ConfigError(f"prompt {i} has {n} tokens, over serve.prompt_len={serving.prompt_len}; set "
                              f"serve.prompt_len={n} (--set serve.prompt_len={n})")  # fmt: skip
        bad = [t for t in prompt if vocab is not None and not 0 <= t < vocab]
        if bad and tokenizer is not None:
            raise ConfigError(f"prompt {i} encodes with {tokenizer} to token id {bad[0]}, outside the "
                              f"model's vocabulary of {size} (0 to {vocab - 1}): the tokenizer is not this "
                              "model's; give the model's own with --tokenizer PATH")  # fmt: skip
        if bad:
            raise ConfigError(f"prompt {i} has token id {bad[0]}, outside the model's vocabulary of "
                              f"{size} (0 to {vocab - 1})")  # fmt: skip
    longest = max(len(p) for p in prompts)
    needed = longest + max_new_tokens - 1  # The last token drawn is never written to the cache.
    if needed > serving.max_len:
        raise ConfigError(f"--max-new-tokens={max_new_tokens} after a prompt of {longest} tokens needs "
                          f"{needed} positions in the KV cache, over serve.max_len={serving.max_len}; set "
                          f"serve.max_len={needed} (--set serve.max_len={needed}) or generate "
                          f"{serving.max_len - longest + 1} tokens at most")  # fmt: skip
    for token in eos:
        if vocab is not None and not 0 <= token < vocab:
            raise ConfigError(f"--eos {token}: outside the model's vocabulary of {size} (0 to {vocab - 1})")


def _batch_shards(config) -> int:
    """The devices a serving batch splits over (the mesh axes ``rules.batch`` names), the mesh as a plan
    lays it out (a -1 axis takes the devices :meth:`~shardmem.config.MeshConfig.device_count` leaves)."""
    from shardmem.parallel.rules import Rules

    axes = dict(config.mesh.axes)
    fixed = math.prod(size for size in axes.values() if size > 0)
    axes = {axis: config.mesh.device_count() // fixed if size == -1 else size for axis, size in axes.items()}
    try:
        batch_axes = Rules.from_config(config.rules, list(axes)).mesh_axes("batch") or ()
    except ConfigError:
        return 1  # Rules the program will name when it is built.
    return math.prod(axes[axis] for axis in batch_axes)


def weights_note(config, config_path: str | Path | None = None) -> str | None:
    """A note for ``generate`` whose weights are likely not the ones meant: the serving program loads
    ``finetune.init_from``, else initialises from ``train.seed``; it never reads a run of the config
    (``train`` writes the trained weights there, and ``init_from`` must name it). ``config_path`` is the
    config file given, which may be a run's own ``config.yaml``. None where ``init_from`` names a run."""
    from shardmem.finetune.hf_config import run_folder

    finetune = config.finetune
    if finetune.init_from is not None and run_folder(Path(finetune.init_from).expanduser()) is not None:
        return None
    weights = f"finetune.init_from's ({finetune.init_from})" if finetune.init_from else (
        f"random (train.seed={config.train.seed})")  # fmt: skip
    path = Path(config_path).expanduser() if config_path is not None else None
    run = run_folder(path.parent) if path is not None and path.name == "config.yaml" else None
    if run is not None:
        return (f"note: {config_path} is run {run}'s config, but the weights are {weights}, not the run's: "
                f"to generate with what it trained, --set finetune.init_from={run}")  # fmt: skip
    if finetune.init_from is None:
        return (f"note: the weights are {weights}: nothing is loaded; to generate with a trained run, "
                f"--set finetune.init_from=RUN_DIR (e.g. runs/{config.name})")  # fmt: skip
    if finetune.lora is None and not finetune.freeze:
        return None  # A checkpoint to generate with as it is.
    return (
        f"note: the weights are {weights}, without the fine-tune: finetune.lora and freeze describe "
        f"training; to generate with a fine-tuned run, --set finetune.init_from=RUN_DIR (e.g. "
        f"runs/{config.name})"
    )


def checkpoint_eos(config) -> tuple[int, ...]:
    """Returns the end-of-sequence ids ``transformers``' ``generate`` stops at for ``finetune.init_from``'s
    Hugging Face checkpoint: ``eos_token_id`` (one id or a list) of its ``generation_config.json`` where
    that gives one, as ``from_pretrained`` reads it (Llama 3 Instruct's adds ``<|eot_id|>`` to the
    ``config.json``'s), else of its ``config.json``; or none. A shardmem run (fine-tuned from such a
    checkpoint) has neither file: its base's, the run's own ``finetune.init_from``, are taken
    (:func:`run_base_note` says so)."""
    from shardmem.finetune.hf_config import pretrained_model

    given = _checkpoint(config)
    if given is None or not Path(given).expanduser().exists():
        return ()  # A base that is gone: run_base_note says generate goes on without an EOS.
    source = pretrained_model(given)
    if source is None or source.hf is None:
        return ()
    eos = source.hf.get("eos_token_id")
    try:
        generation = json.loads((Path(source.where).parent / "generation_config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        generation = None  # None there, or unreadable: transformers too falls back to config.json.
    if isinstance(generation, dict) and generation.get("eos_token_id") is not None:
        eos = generation["eos_token_id"]
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


def _checkpoint(config) -> str | None:
    """``finetune.init_from``, or for a run fine-tuned from a checkpoint, that checkpoint
    (:func:`run_base`)."""
    base = run_base(config.finetune.init_from)
    return config.finetune.init_from if base is None else base[1]


#: The file of a Hugging Face fast tokenizer (every checkpoint shardmem loads ships one).
TOKENIZER_FILE = "tokenizer.json"


def tokenizer_file(config, given: str | Path | None = None) -> Path:
    """Returns the ``tokenizer.json`` that ``shardmem generate --prompt`` encodes text with and decodes the
    new tokens with: ``given`` (``--tokenizer``: the file, or a folder that holds one), else the one beside
    ``finetune.init_from``'s weights (a fine-tuned run's base's, as :func:`checkpoint_eos` finds it).
    Raises ConfigError, naming where it looked and what to give."""
    if given is not None:
        path, where = Path(given).expanduser(), f"--tokenizer {given}"
    else:
        checkpoint = _checkpoint(config)
        if checkpoint is None:
            raise ConfigError("--prompt needs a tokenizer, and finetune.init_from names no checkpoint to "
                              "take it from (the weights are random); give --tokenizer PATH (a "
                              "tokenizer.json or its folder), or token ids with --prompt-ids")  # fmt: skip
        path = Path(checkpoint).expanduser()
        path = path if path.is_dir() else path.parent
        where = f"finetune.init_from={checkpoint}"
    if not path.exists():
        gone = "is not there" if given is not None else "is not there (a fine-tuned run's base checkpoint)"
        raise ConfigError(f"--prompt needs a tokenizer, and {where} {gone}; give --tokenizer PATH (a "
                          "tokenizer.json or its folder), or token ids with --prompt-ids")  # fmt: skip
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        also = " (it has tokenizer.model: a slow tokenizer, not read here)" if (
            file.parent / "tokenizer.model").is_file() else ""  # fmt: skip
        raise ConfigError(f"--prompt needs a tokenizer, and {where} has no {file}{also}; give "
                          "--tokenizer PATH (a tokenizer.json or its folder), or token ids with "
                          "--prompt-ids")  # fmt: skip
    return file


def load_tokenizer(file: Path):
    """Returns the ``tokenizers.Tokenizer`` of ``file`` (:func:`tokenizer_file`); raises ConfigError for
    one it cannot read."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # A dependency of shardmem's; only an environment without it gets here.
        raise ConfigError("--prompt needs the tokenizers package: pip install tokenizers, or give token "
                          "ids with --prompt-ids") from None  # fmt: skip
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own exception type for a file it cannot parse.
        raise ConfigError(f"--prompt: {file} is not a tokenizer.json tokenizers can read ({e}); download it "
                          "again, or give --tokenizer PATH") from None  # fmt: skip


#: Where a Hugging Face checkpoint keeps its chat template (``chat_template``) and special tokens.
TOKENIZER_CONFIG = "tokenizer_config.json"


def chat_text(file: Path, text: str) -> str:
    """Returns ``text`` as one user message in the chat template beside the tokenizer ``file``
    (``tokenizer_config.json``'s ``chat_template``, or its ``default`` among named ones), ready for the
    assistant's answer: what transformers' ``apply_chat_template(messages, add_generation_prompt=True,
    tokenize=False)`` renders, in the same sandboxed Jinja environment. Encode it without special tokens
    (the template writes them). Raises ConfigError for a checkpoint without one."""
    import datetime

    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    where = file.parent / TOKENIZER_CONFIG
    try:
        settings = json.loads(where.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        settings = None
    template = settings.get("chat_template") if isinstance(settings, dict) else None
    if isinstance(template, list):  # Named templates: [{"name": "default", "template": ...}, ...].
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        raise ConfigError(f"--chat: {where} has no chat_template (a base model, not an instruct one?); "
                          "drop --chat to give the prompt as it is")  # fmt: skip

    def raise_exception(message):
        raise TemplateError(message)

    def token(name):  # A special token as tokenizer_config.json writes it: its text, or {"content": ...}.
        value = settings.get(name)
        return value.get("content") if isinstance(value, dict) else value

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])  # fmt: skip
    environment.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    environment.globals.update(raise_exception=raise_exception,
                               strftime_now=lambda f: datetime.datetime.now().strftime(f))  # fmt: skip
    try:
        return environment.from_string(template).render(
            messages=[{"role": "user", "content": text}], add_generation_prompt=True,
            **{name: token(name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")},
        )  # fmt: skip
    except TemplateError as e:
        raise ConfigError(f"--chat: {where}'s chat_template did not render: {e}") from None


class TextStream:
    """A prompt's new tokens as text, as they come: :meth:`step` returns what a token adds to the text of
    the ``prompt`` (token ids) and the tokens before it (empty while a character's bytes are incomplete,
    or for a special token). Decoded after its prompt, the first new word keeps its space ("fox" +
    " jumps", not "foxjumps"). ``tokenizers``' incremental decoding does it, until it raises on a sequence
    it cannot follow ("Invalid prefix encountered", byte-fallback tokens: vllm #17448); from then on each
    step decodes the whole sequence and returns what it adds to the text so far."""

    def __init__(self, tokenizer, prompt: Sequence[int]):
        from tokenizers.decoders import DecodeStream

        self.tokenizer, self.ids, self.prompt, self.text = tokenizer, list(prompt), len(prompt), ""
        self.stream = DecodeStream(skip_special_tokens=True)
        self.prompt_text: str | None = None  # Decoded once the stream gives up.
        for token in prompt:
            self._streamed(token)

    def step(self, token: int) -> str:
        self.ids.append(token)
        piece = self._streamed(token)
        if piece is None:
            if self.prompt_text is None:
                self.prompt_text = self.tokenizer.decode(self.ids[: self.prompt], skip_special_tokens=True)
            whole = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            new = whole[len(self.prompt_text) :] if whole.startswith(self.prompt_text) else whole
            complete = new.startswith(self.text) and not new.endswith("\ufffd")  # A character's bytes done.
            piece = new[len(self.text) :] if complete else ""
        self.text += piece
        return piece

    def _streamed(self, token: int) -> str | None:
        """The stream's piece for ``token``, or None where it has given up."""
        if self.stream is None:
            return None
        try:
            return self.stream.step(self.tokenizer, token) or ""
        except Exception:  # tokenizers raises a bare Exception for a prefix it cannot follow.
            self.stream = None
            return None


#: Runs fine-tuned from runs: how many ``init_from`` links :func:`run_base` follows to a checkpoint.
_MAX_RUN_LINKS = 8


def run_base(init_from) -> tuple[Path, str] | None:
    """Returns, for a ``finetune.init_from`` that is a shardmem run, the run whose ``config.yaml`` names
    the weights it started from and that ``finetune.init_from`` (through runs fine-tuned from runs, to
    the first that is not one); None for anything else (a checkpoint, a run trained from scratch)."""
    from shardmem.finetune.hf_config import run_folder

    if not isinstance(init_from, str) or not init_from:
        return None
    found, seen = None, set()
    for _ in range(_MAX_RUN_LINKS):
        path = Path(init_from).expanduser()
        if ((path if path.is_dir() else path.parent) / "config.json").is_file():
            break  # A Hugging Face checkpoint, even one exported into a run's folder, is read as one.
        run = run_folder(path)
        if run is None or run.resolve() in seen:
            break
        seen.add(run.resolve())
        try:
            finetune = (yaml.safe_load((run / "config.yaml").read_text()) or {}).get("finetune") or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
            break  # Loading the run's weights names what is wrong with its config.yaml.
        base = finetune.get("init_from") if isinstance(finetune, dict) else None
        if not isinstance(base, str) or not base:
            break
        found, init_from = (run, base), base
    return found


def run_base_note(config, eos: tuple[int, ...]) -> str | None:
    """A note for ``generate`` from a shardmem run without ``--eos``: the default ``eos`` ids are its base's
    (:func:`checkpoint_eos`), or, the base gone, there are none and each prompt runs to
    ``--max-new-tokens``. None where ``finetune.init_from`` is not a fine-tuned run."""
    base = run_base(config.finetune.init_from)
    if base is None:
        return None
    run, given = base
    where = f"finetune.init_from={given!r} in {run / 'config.yaml'}"
    if not Path(given).expanduser().exists():
        if not Path(given).expanduser().is_absolute():
            where += f" (a relative path is from {Path.cwd()})"
        return (f"note: no default EOS: the run's base checkpoint, {where}, is not there, so each prompt "
                "runs to --max-new-tokens; give --eos IDS (its generation_config.json's eos_token_id), or "
                "put the base back")  # fmt: skip
    if not eos:
        return f"note: no default EOS: the run's base, {where}, gives no eos_token_id; give --eos IDS"
    ids = ",".join(map(str, eos))
    return f"note: EOS {ids} (the default) from the run's base, {where}"
