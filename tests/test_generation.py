"""Generating tokens (shardmem.run.generation, shardmem.run.sampling and `shardmem generate`): greedy output
of random transformers Flax Llama and Mistral checkpoints equals transformers' own `generate`, and with an
active sliding window (and Gemma's and Qwen2's layouts) a numpy forward's; sampling filters as transformers
does; the command streams, repeats itself for a seed and stops at EOS."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import hf_reference as hf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from shardmem import ConfigError, build_mesh, config_from_dict
from shardmem.cli import main
from shardmem.program import serving_program
from shardmem.run.generation import check_prompts, generate
from shardmem.run.sampling import Sampling, sample

ROOT = Path(__file__).parent.parent
PROMPTS = [[5, 17, 99, 3, 200, 41], [7, 8], [250]]  # Different lengths, one batch.
NEW_TOKENS = 10
SMALL = ["--set", "serve.prompt_len=8", "--set", "serve.max_len=32"]  # The CLI tests' serve section.


def _generated(folder, *, devices: int = 1, max_new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """shardmem's greedy tokens for PROMPTS from the checkpoint in ``folder`` (its config.json the model)."""
    config = config_from_dict({"model": {"seq_len": 64}, "mesh": {"axes": {"data": devices}},
                               "precision": {"compute": "float32"},
                               "serve": {"batch": 4, "prompt_len": 8, "max_len": 24},
                               "finetune": {"init_from": str(folder)}})  # fmt: skip
    program = serving_program(config, build_mesh(config.mesh.axes, jax.devices()[:devices]))
    return generate(program, program.init(), PROMPTS, max_new_tokens=max_new_tokens).tokens


@pytest.mark.newest
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_greedy_output_equals_transformers_generate(name, tmp_path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # Everything is local; never ask the Hub.
    transformers = pytest.importorskip("transformers", "4", reason="needs transformers<5 (its Flax models)")
    if not hasattr(transformers, "FlaxLlamaForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Flax models")
    # Weights of 0.2 for logits of order 1, so that no greedy choice is a near tie. Mistral's default
    # window (4,096) is longer than these sequences: transformers' Flax Mistral masks a window of one
    # position more than its PyTorch model (and shardmem) does, so the active window is checked below.
    common = dict(vocab_size=hf.V, hidden_size=hf.D, intermediate_size=hf.F, num_hidden_layers=hf.L,
                  num_attention_heads=hf.H, num_key_value_heads=hf.G, rms_norm_eps=1e-6,
                  max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=False)  # fmt: skip
    model_class, config_class = {"llama": (transformers.FlaxLlamaForCausalLM, transformers.LlamaConfig),
                                 "mistral": (transformers.FlaxMistralForCausalLM,
                                             transformers.MistralConfig)}[name]  # fmt: skip
    model = model_class(config_class(**common), seed=0, dtype=jnp.float32)
    model.save_pretrained(tmp_path, safe_serialization=True)  # Flax layout, with its config.json.
    width = max(map(len, PROMPTS))  # transformers pads on the left, shardmem on the right.
    ids = np.array([[0] * (width - len(p)) + p for p in PROMPTS], np.int32)
    mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS], np.int32)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    expected = np.asarray(out.sequences)[:, width:].tolist()
    assert _generated(tmp_path) == expected


def _numpy_greedy(config: dict, tensors: dict) -> list[list[int]]:
    """Greedy decoding by transformers' PyTorch forward ported to numpy (tests/hf_reference.py), the whole
    sequence again at every step: no cache to share a mistake with."""
    out = []
    for prompt in PROMPTS:
        sequence = list(prompt)
        for _ in range(NEW_TOKENS):
            sequence.append(int(np.argmax(hf.logits(config, tensors, np.array([sequence]))[0, -1])))
        out.append(sequence[len(prompt) :])
    return out


@pytest.mark.newest
@pytest.mark.parametrize("model_type, options", [
    ("mistral", {"sliding_window": 4}),  # Shorter than most of these sequences: the window is active.
    pytest.param("gemma", {}, marks=pytest.mark.slow),
    pytest.param("qwen2", {}, marks=pytest.mark.slow),
    pytest.param("qwen3", {}, marks=pytest.mark.slow),
    pytest.param("gemma2", {}, marks=pytest.mark.slow),  # Its caps, scale and four norms a layer.
    ("gemma2", {"sliding_window": 4}),  # A window on the first layer only, active: each layer picks its own.
    ("gemma3_text", {"sliding_window": 4}),  # And its own RoPE base; the other's scaled (linear, 8).
])  # fmt: skip
def test_greedy_output_equals_transformers_forward_with_a_sliding_window_gemma_and_qwens(
    model_type, options, tmp_path
):
    # An untied head: Gemma's tied one, reading back an embedding scaled by sqrt(width) that dominates the
    # residual stream, repeated the last token at every step, whatever the layers did.
    config = hf.hf_config(model_type, **{"tie_word_embeddings": False, **options})
    tensors = hf.random_tensors(config, seed=5)
    tensors = {name: t * 2 for name, t in tensors.items()}  # Logits of order 1 (their weights are 0.1).
    hf.save(tmp_path, config, tensors)
    expected = _numpy_greedy(config, tensors)
    assert all(len(set(tokens)) > 1 for tokens in expected)  # Not one token over and over.
    assert len({token for tokens in expected for token in tokens}) > NEW_TOKENS
    assert _generated(tmp_path, devices=2) == expected


DYNAMIC = {"rope_type": "dynamic", "factor": 4.0}
LONG_PROMPTS = [[9, 4, 250, 31, 77, 5, 18, 201, 66, 3, 140, 12], [7, 8, 9]]  # Longer than 8, and not.


@pytest.mark.newest
@pytest.mark.parametrize("longest, prompts, steps, devices", [
    (8, PROMPTS, 10, 2),            # Past max_position_embeddings in decode.
    (8, LONG_PROMPTS, 6, 2),        # Past it from the prefill on; the short prompt's positions too.
    (8, LONG_PROMPTS[:1], 6, 1),    # One sequence.
    (32, PROMPTS, 6, 2),            # Below it throughout (the cache's room, 40, is not).
])  # fmt: skip
def test_dynamic_rope_prefill_and_decode_give_the_logits_of_transformers_generate(
    longest, prompts, steps, devices, tmp_path
):
    config = hf.hf_config("llama", rope_scaling=DYNAMIC, max_position_embeddings=longest)
    tensors = {name: t * 2 for name, t in hf.random_tensors(config, seed=3).items()}
    hf.save(tmp_path, config, tensors)
    expected_NxBxV = hf.generate_logits(config, tensors, prompts, steps)
    plain = {k: v for k, v in config.items() if k != "rope_scaling"}
    if longest == 8:  # The cache's keys keep their rotation: recomputing every step would differ.
        drawn = expected_NxBxV[:-1, 0].argmax(-1).tolist()
        again = hf.logits(config, tensors, np.array([prompts[0] + drawn]))[0, -1]
        assert np.abs(again - expected_NxBxV[-1, 0]).max() > 0.01
        assert np.abs(hf.generate_logits(plain, tensors, prompts, steps) - expected_NxBxV).max() > 0.05
    batch = len(prompts) + len(prompts) % devices
    shardmem_config = config_from_dict({"model": {"seq_len": 64}, "mesh": {"axes": {"data": devices}},
                                        "precision": {"compute": "float32"},
                                        "serve": {"batch": batch, "prompt_len": 16, "max_len": 40},
                                        "finetune": {"init_from": str(tmp_path)}})  # fmt: skip
    program = serving_program(shardmem_config, build_mesh(shardmem_config.mesh.axes, jax.devices()[:devices]))
    weights = program.init()
    prompts_BxP, lengths_B = np.zeros((batch, 16), np.int32), np.ones(batch, np.int32)
    for i, prompt in enumerate(prompts):
        prompts_BxP[i, : len(prompt)], lengths_B[i] = prompt, len(prompt)
    logits_BxV, cache = program.prefill(weights, program.new_cache(), prompts_BxP, lengths_B)
    for step, expected_BxV in enumerate(expected_NxBxV):
        np.testing.assert_allclose(np.asarray(logits_BxV)[: len(prompts)], expected_BxV, atol=1e-4, rtol=1e-4)
        tokens_B = np.zeros(batch, np.int32)
        tokens_B[: len(prompts)] = expected_BxV.argmax(-1)  # transformers' greedy choice, fed back.
        logits_BxV, cache = program.decode(weights, cache, tokens_B, lengths_B + step)


@pytest.mark.newest
def test_sampling_keeps_the_top_k_and_top_p_tokens_transformers_keeps():
    probs = np.array([0.5, 0.3, 0.1, 0.06, 0.04], np.float32)
    logits_NxV = jnp.log(jnp.asarray(np.tile(probs, (2000, 1))))
    key = jax.random.key(0)

    def drawn(sampling):
        return set(np.asarray(sample(logits_NxV, key, sampling)).tolist())

    assert drawn(Sampling()) == {0}  # Greedy: the largest logit, whatever the key.
    assert drawn(Sampling(temperature=1.0)) == {0, 1, 2, 3, 4}
    assert drawn(Sampling(temperature=1.0, top_k=3)) == {0, 1, 2}
    assert drawn(Sampling(temperature=1.0, top_p=0.75)) == {0, 1}  # 0.5 + 0.3 reach 0.75 first.
    assert drawn(Sampling(temperature=1.0, top_p=0.2)) == {0}  # The likeliest is always kept.
    assert drawn(Sampling(temperature=1.0, top_k=4, top_p=0.85)) == {0, 1, 2}
    other = np.asarray(sample(logits_NxV, jax.random.key(1), Sampling(temperature=1.0)))
    assert (other != np.asarray(sample(logits_NxV, key, Sampling(temperature=1.0)))).any()  # Another seed.
    # A temperature flattens the distribution: token 4 (4%) comes up more often at 5 than at 1.
    hot = np.asarray(sample(logits_NxV, key, Sampling(temperature=5.0)))
    cold = np.asarray(sample(logits_NxV, key, Sampling(temperature=1.0)))
    assert (hot == 4).mean() > 2 * (cold == 4).mean()
    with pytest.raises(ConfigError, match=r"top_p=1.5 \(--top-p\): use a probability in \(0, 1\]"):
        Sampling(temperature=1.0, top_p=1.5)


@pytest.mark.parametrize("prompts, new, message", [
    ([list(range(1, 10))], 4, "prompt 0 has 9 tokens, over serve.prompt_len=8; set serve.prompt_len=9"),
    ([[1]] * 5, 4, "5 prompts, but serve.batch=4 sequences are decoded together; set serve.batch=8 (a "
                   "multiple of the 8 devices rules.batch splits it over)"),  # The default mesh: fsdp over 8.
    ([[1, 256]], 4, "prompt 0 has token id 256, outside the model's vocabulary of model.vocab_size=256"),
    ([[1, 2, 3]], 23, "--max-new-tokens=23 after a prompt of 3 tokens needs 25 positions in the KV cache, "
                      "over serve.max_len=24; set serve.max_len=25 (--set serve.max_len=25) or generate 22"),
    ([[]], 4, "prompt 0 is empty"),
])  # fmt: skip
def test_prompts_the_serve_section_has_no_room_for_are_one_line_naming_the_key(prompts, new, message):
    serve = {"batch": 4, "prompt_len": 8, "max_len": 24}
    config = config_from_dict({"model": {"preset": "tiny"}, "serve": serve})
    with pytest.raises(ConfigError) as error:
        check_prompts(config, prompts, new)
    assert message in str(error.value) and "\n" not in str(error.value)


def _shardmem_generate(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardmem", "generate", "configs/tiny.yaml", *SMALL, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip


def test_generate_streams_repeats_itself_for_a_seed_and_stops_at_eos(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3\n\n40,41\n")
    sampled = ["--prompt-file", str(prompts), "--max-new-tokens", "6", "--temperature", "1.0",
               "--top-k", "40", "--seed", "7"]  # fmt: skip
    first = _shardmem_generate(*sampled, "--json")
    assert first.returncode == 0, first.stderr
    result = json.loads(first.stdout)  # stdout holds the JSON object alone; the steps stream to stderr.
    assert result["prompts"] == [[1, 2, 3], [40, 41]] and result["steps"] == 6
    tokens = result["tokens"]
    assert [len(t) for t in tokens] == [6, 6] and result["finished"] == [False, False]
    streamed = [line.split() for line in first.stderr.splitlines() if line and line[0].isdigit()]
    assert streamed == [[str(a), str(b)] for a, b in zip(*tokens, strict=True)]  # One line per step.
    # The same seed in another process: the same tokens, until the first prompt's third one, made its EOS.
    eos = tokens[0][2]
    again = _shardmem_generate(*sampled, "--eos", str(eos))
    assert again.returncode == 0, again.stderr
    lines = [line.split() for line in again.stdout.splitlines()]
    first_prompt = [line[0] for line in lines]
    stop = tokens[0].index(eos) + 1
    assert first_prompt[:stop] == [str(t) for t in tokens[0][:stop]] and set(first_prompt[stop:]) <= {"-"}
    if tokens[1][:stop].count(eos) == 0:  # The second prompt goes on (unless it drew that token too).
        assert [line[1] for line in lines][:stop] == [str(t) for t in tokens[1][:stop]]
    assert "generated" in again.stderr and "Traceback" not in again.stderr


@pytest.mark.parametrize(
    "config_eos, generation, expected",
    [
        (2, None, (2,)),
        ([2, 3], None, (2, 3)),
        (128001, {"eos_token_id": [128001, 128009]}, (128001, 128009)),  # Llama 3 Instruct's files.
        (2, {"max_length": 64}, (2,)),  # A generation_config.json without one: config.json's.
        (2, "{broken", (2,)),
        (None, None, ()),
    ],
)
def test_the_default_eos_is_the_one_transformers_generate_stops_at(tmp_path, config_eos, generation,
                                                                   expected):  # fmt: skip
    """``from_pretrained`` reads generation_config.json's eos_token_id over config.json's: taking only
    config.json's, generate ran past Llama 3 Instruct's end of turn (<|eot_id|>, 128009)."""
    from shardmem.run.generation import checkpoint_eos

    config = hf.hf_config("llama", eos_token_id=config_eos)
    hf.save(tmp_path, config, hf.random_tensors(config))
    if generation is not None:
        text = generation if isinstance(generation, str) else json.dumps(generation)
        (tmp_path / "generation_config.json").write_text(text)
    loaded = config_from_dict({"model": {"seq_len": 16}, "finetune": {"init_from": str(tmp_path)}})
    assert checkpoint_eos(loaded) == expected


def _fine_tuned_run(root: Path, eos: list[int]) -> tuple[Path, Path]:
    """A run fine-tuned from a Hugging Face folder whose generation_config.json ends at ``eos`` (its
    checkpoint the base's weights): ``(run folder, base folder)``. The run holds neither JSON file."""
    from shardmem.program import build_program
    from shardmem.run.checkpoint import Checkpointer

    base = root / "base"
    hf.save(base, hf.hf_config("llama"), hf.random_tensors(hf.hf_config("llama")))
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    config = config_from_dict({"name": "tuned", "model": {"seq_len": 16}, "mesh": {"axes": {"data": 1}},
                               "precision": {"compute": "float32"}, "train": {"global_batch": 8},
                               "finetune": {"init_from": str(base)}})  # fmt: skip
    program = build_program(config, build_mesh(config.mesh.axes, jax.devices()[:1]))
    (root / "run").mkdir()
    (root / "run" / "config.yaml").write_text(config.to_yaml())
    with Checkpointer(root / "run" / "checkpoints", every=1, keep=1) as checkpointer:
        checkpointer.save(2, program.init(), force=True)
    return root / "run", base


def test_the_default_eos_of_a_fine_tuned_run_is_its_bases_and_without_the_base_generate_says_so(tmp_path):
    """A run's folder has no config.json nor generation_config.json (only its exports do): generate from
    it ran to --max-new-tokens, past the EOS of the checkpoint it was fine-tuned from."""
    from shardmem.run.generation import checkpoint_eos, run_base, run_base_note

    run, base = _fine_tuned_run(tmp_path, [7, 9])
    (tmp_path / "again" / "checkpoints").mkdir(parents=True)  # A run fine-tuned from that run.
    again = yaml.safe_load((run / "config.yaml").read_text())
    (tmp_path / "again" / "config.yaml").write_text(
        yaml.safe_dump({**again, "finetune": {"init_from": str(run)}})
    )
    for init_from in (run, run / "checkpoints", tmp_path / "again"):
        config = config_from_dict({"model": {"seq_len": 16}, "finetune": {"init_from": str(init_from)}})
        assert checkpoint_eos(config) == (7, 9) and run_base(str(init_from))[1] == str(base)
    said = f"note: EOS 7,9 (the default) from the run's base, finetune.init_from={str(base)!r} in {run}"
    assert run_base_note(config, (7, 9)) == f"{said}/config.yaml"
    assert (
        run_base(str(base)) is None
        and run_base_note(config.replace(f"finetune.init_from={base}"), ()) is None
    )

    # With every id an EOS, each prompt's first token ends it: one step, where --max-new-tokens is 6.
    run, base = _fine_tuned_run(tmp_path / "all", list(range(hf.V)))
    args = ["generate", str(run / "config.yaml"), "--set", f"finetune.init_from={run}", *SMALL,
            "--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--json"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "shardmem", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["steps"] == 1 and "note: EOS 0,1,2," in done.stderr
    shutil.rmtree(base)  # The base is gone: generate says so, and goes on without an EOS.
    done = subprocess.run([sys.executable, "-m", "shardmem", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["steps"] == 6
    said = f"note: no default EOS: the run's base checkpoint, finetune.init_from={str(base)!r} in "
    assert said in done.stderr and "is not there, so each prompt runs to --max-new-tokens" in done.stderr


def test_generate_says_when_its_weights_are_not_a_trained_runs(tmp_path):
    """generate read init_from's base, or random weights, silently: on the config a LoRA run trained with
    (its adapters are in the run, which init_from must name), on a run's own config.yaml (the run's
    weights are never read from it), on a config that loads nothing."""
    from shardmem.run.generation import weights_note

    config = hf.hf_config("llama")
    hf.save(tmp_path / "base", config, hf.random_tensors(config))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    plain = config_from_dict({"model": {"seq_len": 16}, "finetune": {"init_from": str(tmp_path / "base")}})
    (tmp_path / "run" / "config.yaml").write_text(plain.to_yaml())  # A run trained from it.
    lora = {"rank": 2, "targets": ["layers/wq"]}

    def note(path=None, **finetune):
        raw = {"name": "mine", "model": {"seq_len": 16}, "finetune": finetune}
        return weights_note(config_from_dict(raw), path)

    said = note(init_from=str(tmp_path / "base"), lora=lora)
    assert said.startswith(f"note: the weights are finetune.init_from's ({tmp_path / 'base'}), without")
    assert "--set finetune.init_from=RUN_DIR (e.g. runs/mine)" in said
    assert note(init_from=str(tmp_path / "base")) is None  # Nothing fine-tuned: the checkpoint is the model.
    assert note(init_from=str(tmp_path / "run"), lora=lora) is None  # The run's merged model.
    assert note(init_from=str(tmp_path / "run" / "checkpoints"), lora=lora) is None
    own = tmp_path / "run" / "config.yaml"
    assert note(own, init_from=str(tmp_path / "base")) == (
        f"note: {own} is run {tmp_path / 'run'}'s config, but the weights are finetune.init_from's "
        f"({tmp_path / 'base'}), not the run's: to generate with what it trained, --set "
        f"finetune.init_from={tmp_path / 'run'}"
    )
    random = config_from_dict({"name": "mine", "model": {"preset": "tiny"}})
    tiny = weights_note(random, tmp_path / "mine.yaml")
    assert tiny == (
        "note: the weights are random (train.seed=0): nothing is loaded; to generate with a trained run, "
        "--set finetune.init_from=RUN_DIR (e.g. runs/mine)"
    )


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "1,x"], "--prompt-ids: 'x' is not a token id; give integers such as 1,2,3"),
    (["--prompt-ids", ",".join(["1"] * 9)], "prompt 0 has 9 tokens, over serve.prompt_len=8"),
    (["--prompt-file", "missing.txt"], "--prompt-file 'missing.txt': cannot read it"),
    (["--prompt-ids", "1,--1"], "--prompt-ids: '--1' is not a token id"),  # int() would take "1_0", "²"
    (["--prompt-ids", "1", "--temperature", "1", "--top-p", "0"], "top_p=0.0 (--top-p): use a probability"),
    (["--prompt-ids", "1", "--top-k", "5"], "--top-k only applies to sampling, and --temperature 0 decodes"),
    (["--prompt-ids", "1", "--temperature", "1", "--seed", str(1 << 32)],
     "seed=4294967296 (--seed): use an integer from 0 to 4294967295"),  # jax.random.key's 32 bits
    (["--prompt-ids", "1", "--temperature", "inf"], "temperature=inf (--temperature): use 0 (greedy)"),
    (["--prompt-ids", "1", "--tokenizer", "tok.json"], "--tokenizer only applies to text prompts (--prompt "),
    (["--prompt-ids", "1", "--chat"], "--chat only applies to text prompts (--prompt TEXT); token ids need"),
    (["--prompt", "hello"], "--prompt needs a tokenizer, and finetune.init_from names no checkpoint to take"),
    (["--prompt", "hi", "--tokenizer", "no/"], "--prompt needs a tokenizer, and --tokenizer no/ is not"),
])  # fmt: skip
def test_generate_errors_exit_2_with_one_line_before_anything_is_built(args, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["generate", "configs/tiny.yaml", *SMALL, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_generate_out_of_device_memory_names_the_cache_and_its_keys(capsys, monkeypatch):
    import jax

    from shardmem.run import generation

    def exhausted(*args, **kwargs):  # What the allocator raises for a cache the devices cannot hold.
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 51200000000 bytes.")

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(generation, "generate", exhausted)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert main(["generate", "configs/tiny.yaml", *SMALL, "--prompt-ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert "out of memory on the cpu devices: the KV cache takes" in err and "serve.max_len" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    # A GPU's allocator would hold memory.usable_fraction, as plan --serve --target local budgets (not 75%).
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"


def _tokenizer(vocab: int):
    """A byte-pair tokenizer of exactly ``vocab`` entries (a checkpoint's vocabulary), SentencePiece's
    word boundaries (``▁``, as Llama 2's) and a BOS it adds: trained on made-up words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rng = np.random.default_rng(0)
    letters = list("abcdefghijklmnopqrstuvwxyzé")
    words = ["".join(rng.choice(letters, rng.integers(2, 8))) for _ in range(4000)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator([" ".join(words[i : i + 10]) for i in range(0, len(words), 10)], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert tokenizer.get_vocab_size() == vocab
    return tokenizer


def _text_checkpoint(tmp_path: Path, prompt_len: int = 16):
    """A random Llama checkpoint with a tokenizer.json of its vocabulary, and a config generating from it:
    ``(config file, checkpoint folder, tokenizer)``."""
    checkpoint = tmp_path / "checkpoint"
    config = hf.hf_config("llama", eos_token_id=2)
    hf.save(checkpoint, config, hf.random_tensors(config))
    tokenizer = _tokenizer(hf.V)
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    yaml_file = tmp_path / "generate.yaml"
    yaml_file.write_text(yaml.safe_dump({"model": {"seq_len": 64}, "mesh": {"axes": {"data": -1}},
                                         "precision": {"compute": "float32"},
                                         "serve": {"batch": 8, "prompt_len": prompt_len, "max_len": 64},
                                         "finetune": {"init_from": str(checkpoint)}}))  # fmt: skip
    return yaml_file, checkpoint, tokenizer


def test_text_prompts_are_encoded_and_the_new_tokens_printed_with_the_checkpoints_tokenizer(tmp_path, capsys):
    yaml_file, _, tokenizer = _text_checkpoint(tmp_path)
    texts = ["the lazy fox", "héllo"]
    args = ["generate", str(yaml_file), "--max-new-tokens", "12"]
    assert main([*args, *(a for text in texts for a in ("--prompt", text)), "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["prompts"] == [tokenizer.encode(text).ids for text in texts]  # With the BOS (1) first.
    assert [p[0] for p in result["prompts"]] == [1, 1]
    for prompt, new, text in zip(result["prompts"], result["tokens"], result["text"], strict=True):
        # Decoded after its prompt: the text the whole sequence decodes to, past the prompt's.
        whole, before = tokenizer.decode(prompt + new), tokenizer.decode(prompt)
        assert whole.startswith(before) and text == whole[len(before) :] and text.strip()
    assert f"[1] {result['text'][1]}" in err.splitlines()  # Several prompts: each at the end.
    # Token ids give the same tokens; one text prompt streams its text on stdout, its line ended.
    assert main([*args, "--prompt-ids", ",".join(map(str, result["prompts"][0])), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"][0] == result["tokens"][0]
    assert main([*args, "--prompt", texts[0]]) == 0
    assert capsys.readouterr().out == result["text"][0] + "\n"


def _byte_fallback_tokenizer():
    """Llama 2's and Gemma's kind of tokenizer: SentencePiece's word boundaries (``▁``), and a character
    outside the vocabulary as the tokens of its UTF-8 bytes (``<0xE6>``), fused back when decoded."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "a", "b", "▁a", "▁b", "ab", "▁ab"):
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    return tokenizer


def test_text_streams_after_its_prompt_and_survives_byte_sequences_the_stream_cannot_follow():
    from shardmem.run.generation import TextStream

    tokenizer = _byte_fallback_tokenizer()
    prompt = tokenizer.encode("ab a").ids
    new = tokenizer.encode("b héllo 日本 ab", add_special_tokens=False).ids  # Bytes for é, 日 and 本.
    stream = TextStream(tokenizer, prompt)
    assert "".join(stream.step(token) for token in new) == " b héllo 日本 ab"
    # Random tokens (a random model's): tokenizers' incremental decoding raises on some byte sequences
    # ("Invalid prefix encountered"), and the stream goes on decoding the whole sequence instead.
    rng = np.random.default_rng(0)
    gave_up = 0
    for _ in range(50):
        stream = TextStream(tokenizer, prompt)
        for token in rng.integers(0, tokenizer.get_vocab_size(), 30).tolist():
            assert isinstance(stream.step(token), str)
        gave_up += stream.stream is None
    assert gave_up > 0


def test_a_text_prompt_that_encodes_to_nothing_or_a_folder_without_a_tokenizer_is_one_line(tmp_path, capsys):
    _byte_fallback_tokenizer().save(str(tmp_path / "tokenizer.json"))  # It adds no BOS.
    args = ["generate", str(ROOT / "configs" / "tiny.yaml"), *SMALL]
    assert main([*args, "--prompt", "", "--tokenizer", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--prompt '' encodes to no tokens (its tokenizer adds no BOS); give it some text" in err
    # Read (a file given as it is), its ids past the tiny model's 256 (its "▁" is 259): the prompt says so,
    # naming the file.
    file = tmp_path / "tokenizer.json"
    assert main([*args, "--prompt", "日", "--tokenizer", str(file)]) == 2
    assert (f"prompt 0 encodes with --tokenizer {str(file)!r} to token id 259, outside the model's "
            "vocabulary of model.vocab_size=256 (0 to 255): the tokenizer is not this model's; give the "
            "model's own with --tokenizer PATH") in capsys.readouterr().err  # fmt: skip
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.model").write_bytes(b"")
    assert main([*args, "--prompt", "ab", "--tokenizer", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "(it has tokenizer.model: a slow tokenizer, not read here)" in err and len(err.splitlines()) == 1


#: A chat template as instruct checkpoints ship it (Zephyr's shape): role headers, an EOS after each turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('no such role') }}{% endif %}{{ '<|' + message['role'] + '|>' + message['content'] "
    "+ eos_token }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def test_chat_prompts_are_rendered_as_transformers_apply_chat_template_renders_them(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    yaml_file, checkpoint, tokenizer = _text_checkpoint(tmp_path, prompt_len=48)
    settings = {"chat_template": CHAT_TEMPLATE, "eos_token": "</s>",  # Llama 2's files write the BOS so:
                "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
                              "rstrip": False, "single_word": False}}  # fmt: skip
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(settings))
    text = "the lazy fox"
    assert main(["generate", str(yaml_file), "--prompt", text, "--chat", "--max-new-tokens", "2",
                 "--json"]) == 0  # fmt: skip
    prompt = json.loads(capsys.readouterr().out)["prompts"][0]
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(checkpoint))
    expected = theirs.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    assert prompt == list(expected) and prompt.count(1) == 1  # One BOS: the template's, not another.
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert main(["generate", str(yaml_file), "--prompt", text, "--chat"]) == 2
    err = capsys.readouterr().err
    assert "--chat: " in err and "has no chat_template (a base model, not an instruct one?)" in err
