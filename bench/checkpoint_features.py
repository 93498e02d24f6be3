"""Checkpoint features against transformers' own PyTorch models (BENCHMARKS.md, issue 40).

transformers' PyTorch models make random tiny checkpoints with each feature (Llama 3.1/3.2 rope scaling,
linear, dynamic and YaRN scalings, Mistral's sliding window, tied and untied heads, a sharded folder with an
index and a stray consolidated file, Gemma, Qwen3's head norms, Gemma 2's caps, scale, four norms a layer and
window on every other layer, Gemma 3's head norms and its sliding layers' own RoPE base, and a multimodal
Gemma 3's text model) with their own
``save_pretrained``, and their logits (each model's eager attention, its definition: transformers' SDPA
attention drops Gemma 2's cap of the scores); shardmem loads each folder knowing only ``seq_len`` (the rest
from config.json) and compares its float32 logits. Then shardmem exports a LoRA fine-tune of the Llama 3.1
one, merged and as adapters, and one each of the Gemma 2 and Gemma 3 ones, merged, and transformers (and
PEFT, where installed) load those folders as they are. And each checkpoint generates: transformers' greedy
``generate`` with its KV cache (each prompt alone, and both together, left-padded) records every step's
logits, and shardmem's serving program (prefill, then decode steps fed transformers' tokens) is compared
step by step; the dynamic RoPE case's prompts and generations pass its ``max_position_embeddings``, where
transformers' cache keeps each key as it was rotated. Three steps, two
Pythons (PyTorch is not in shardmem's environment):

    /work/venv-torch/bin/python bench/checkpoint_features.py make OUT     # torch: checkpoints and logits
    PYTHONPATH=. .venv/bin/python bench/checkpoint_features.py check OUT  # shardmem: load, compare, export
    /work/venv-torch/bin/python bench/checkpoint_features.py reload OUT   # torch: load shardmem's exports
"""

import json
import sys
from pathlib import Path

import numpy as np

SEQ = 64
TOKENS = np.random.default_rng(0).integers(0, 256, (2, SEQ))
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-6)  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # fmt: skip
# name -> (config class, its options, shardmem's model keys beyond seq_len)
CASES = {
    "llama3.1 rope scaling": ("LlamaConfig", dict(rope_scaling=LLAMA3, rope_theta=500000.0), {}),
    "llama3.2 tied + rope scaling": ("LlamaConfig", dict(rope_scaling=LLAMA3, tie_word_embeddings=True), {}),
    "linear rope scaling": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 4.0}), {}),
    "dynamic rope scaling": ("LlamaConfig", dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0},
                                                 max_position_embeddings=32), {}),
    "qwen2 yarn": ("Qwen2Config", dict(rope_scaling={"type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 16}), {}),
    "yarn with mscale": ("LlamaConfig", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 16,
                                                          "mscale": 0.707, "mscale_all_dim": 1.0}), {}),
    "qwen2 window null": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=None), {}),
    "qwen2 window, upper layer": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=16,
                                                      max_window_layers=1), {"attention": "xla"}),
    "mistral window, xla": ("MistralConfig", dict(sliding_window=16), {"attention": "xla"}),
    "mistral window, chunked": ("MistralConfig", dict(sliding_window=16), {"attention": "chunked",
                                                                         "attention_chunk": 16}),
    "sharded + index + stray file": ("LlamaConfig", dict(), {}),
    "gemma": ("GemmaConfig", dict(head_dim=32, hidden_activation="gelu_pytorch_tanh"), {}),
    "qwen3 head norms": ("Qwen3Config", dict(head_dim=32), {}),  # Heads wider than hidden / heads (16).
    "qwen3 tied + window": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True,
                                               use_sliding_window=True, sliding_window=16,
                                               max_window_layers=0), {"attention": "xla"}),
    # Caps that bite on these weights, a scale not 1 / sqrt(head_dim); a window as long as the sequences.
    "gemma2": ("Gemma2Config", dict(head_dim=32, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=5.0, sliding_window=SEQ), {}),
    "gemma2 defaults, window 16": ("Gemma2Config", dict(head_dim=32, sliding_window=16), {}),  # Active.
    # Gemma 3: a window of 16 on the first layer, its RoPE base 100 unscaled, the second's scaled by 8.
    "gemma3": ("Gemma3TextConfig", dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
                                        sliding_window_pattern=2, rope_local_base_freq=100.0,
                                        rope_scaling={"rope_type": "linear", "factor": 8.0},
                                        final_logit_softcapping=5.0), {}),
    # Its defaults on two layers: both slide, with the local base.
    "gemma3 defaults, window 16": ("Gemma3TextConfig", dict(head_dim=32, sliding_window=16), {}),
    # Gemma 3 with a vision tower (Gemma3ForConditionalGeneration, as 4B and larger): its text model.
    "gemma3 multimodal": ("Gemma3Config", dict(head_dim=32, sliding_window=16, sliding_window_pattern=2), {}),
}  # fmt: skip
#: A tiny vision tower for the multimodal case (SigLIP's; the text model never runs it).
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)  # fmt: skip
#: Models whose norms multiply by 1 + their weights.
ONE_PLUS = ("GemmaConfig", "Gemma2Config", "Gemma3TextConfig", "Gemma3Config")


# Generation: two prompts (40 and 29 tokens) and 24 new tokens each, past the dynamic case's 32 positions.
PROMPTS = (TOKENS[0, :40].tolist(), TOKENS[1, :29].tolist())
NEW_TOKENS = 24


def make(out: Path) -> None:
    import torch
    import transformers

    for i, (name, (config_class, options, _)) in enumerate(CASES.items()):
        folder = out / _slug(name)
        if name.startswith("mistral window, chunked"):
            continue  # The xla case's checkpoint.
        torch.manual_seed(i)
        config = getattr(transformers, config_class)(**{**COMMON, **options})
        if config_class == "Gemma3Config":  # The sizes are its text model's.
            config = transformers.Gemma3Config(text_config={**COMMON, **options}, vision_config=VISION,
                                               mm_tokens_per_image=4)  # fmt: skip
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                              attn_implementation="eager").eval()  # fmt: skip
        with torch.no_grad():
            for parameter in model.parameters():  # Weights of 0.1: logits of order 1 to 10.
                parameter.normal_(0, 0.1)
            if config_class not in ONE_PLUS:  # Gemma multiplies by 1 + its norms' weights.
                for module_name, parameter in model.named_parameters():
                    if "norm" in module_name:
                        parameter.add_(1.0)
        sharded = name.startswith("sharded")
        model.save_pretrained(folder, safe_serialization=True, max_shard_size="100KB" if sharded else "10GB")
        if sharded:  # Mistral's Hub layout: the same weights under other names, not in the index.
            from safetensors.torch import save_file

            save_file({"layers.0.attention.wq.weight": model.model.layers[0].self_attn.q_proj.weight.clone()},
                      str(folder / "consolidated.safetensors"))  # fmt: skip
        with torch.no_grad():
            logits = model(torch.tensor(TOKENS)).logits.numpy()
        np.save(folder / "logits.npy", logits)
        _generate_in_transformers(folder)
        print(f"{name}: {sorted(p.name for p in folder.iterdir())}")


def _generate_in_transformers(folder: Path) -> None:
    """Greedy ``generate`` with the KV cache, each prompt alone and the two together (left-padded, as
    transformers pads for generation): its tokens and every step's logits, ``generate-*.npz``. Each run
    loads the model afresh: dynamic RoPE's module keeps the frequencies of the longest forward it ran
    until one shorter than max_position_embeddings (the logits' 64 tokens would set every later run's)."""
    import torch
    import transformers

    runs = {f"alone{i}": [prompt] for i, prompt in enumerate(PROMPTS)} | {"together": list(PROMPTS)}
    for run, prompts in runs.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        model.generation_config.eos_token_id = None  # Every sequence runs NEW_TOKENS steps.
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            made = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                  pad_token_id=0, output_logits=True,
                                  return_dict_in_generate=True)  # fmt: skip
        np.savez(folder / f"generate-{run}.npz", tokens=made.sequences[:, width:].numpy(),
                 logits=torch.stack(made.logits).numpy())  # fmt: skip


def check(out: Path) -> None:
    import jax
    from flax import nnx

    from shardmem import ConfigError, build_mesh, build_program, config_from_dict

    rows = []
    for name, (_, _, model) in CASES.items():
        folder = out / _slug(name.replace(", chunked", ", xla"))
        try:
            config = config_from_dict({"model": {"seq_len": SEQ, **model}, "mesh": {"axes": {"data": 1}},
                                       "precision": {"compute": "float32"}, "train": {"global_batch": 2},
                                       "finetune": {"init_from": str(folder)}})  # fmt: skip
            program = build_program(config, build_mesh({"data": 1}, jax.devices()[:1]))
        except ConfigError as e:  # Refused with a reason: never loaded with wrong logits.
            rows.append({"case": name, "refused": str(e)})
            print(f"{name:32s} refused: {str(e).replace(str(folder / 'config.json'), 'config.json')}")
            continue
        params = program.init()["params"]

        @jax.jit
        def forward(params, tokens, program=program):
            with program.rules.activate(program.mesh):
                return nnx.merge(program.graphdef, params)(tokens)

        got = np.asarray(forward(params, TOKENS.astype(np.int32)))
        expected = np.load(folder / "logits.npy")
        error = np.abs(got - expected)
        row = {"case": name, "max_abs_logit": float(np.abs(expected).max()), "max_error": float(error.max()),
               "of_tolerance": float((error / (1e-4 + 1e-4 * np.abs(expected))).max())}  # fmt: skip
        rows.append(row)
        print(f"{name:32s} |logit| <= {row['max_abs_logit']:6.2f}  max error {row['max_error']:.2e}  "
              f"{row['of_tolerance']:.2f} of 1e-4 + 1e-4|ref|")  # fmt: skip
    (out / "check.json").write_text(json.dumps(rows, indent=2))
    _check_generation(out)
    _export(out)


def _check_generation(out: Path) -> None:
    """shardmem's serving program on transformers' generations: the prompts prefilled (right-padded, each
    with its length), then each step decoded with the token transformers chose; every step's logits
    against transformers' (``generate.json``)."""
    import jax

    from shardmem import build_mesh, config_from_dict, serving_program

    rows = []
    refused = {row["case"] for row in json.loads((out / "check.json").read_text()) if "refused" in row}
    for name, (_, _, model) in CASES.items():
        folder = out / _slug(name.replace(", chunked", ", xla"))
        for run in ("alone0", "alone1", "together") if name not in refused else ():
            prompts = [PROMPTS[int(run[-1])]] if run.startswith("alone") else list(PROMPTS)
            made = np.load(folder / f"generate-{run}.npz")
            serve = {"batch": len(prompts), "prompt_len": max(len(p) for p in prompts), "max_len": 64,
                     "kv_dtype": "float32"}  # fmt: skip
            config = config_from_dict({"model": {"seq_len": SEQ, **model}, "mesh": {"axes": {"data": 1}},
                                       "precision": {"compute": "float32"}, "serve": serve,
                                       "finetune": {"init_from": str(folder)}})  # fmt: skip
            program = serving_program(config, build_mesh({"data": 1}, jax.devices()[:1]))
            weights = program.init()
            prompts_BxP = np.zeros((len(prompts), serve["prompt_len"]), np.int32)
            for i, prompt in enumerate(prompts):
                prompts_BxP[i, : len(prompt)] = prompt
            lengths_B = np.array([len(p) for p in prompts], np.int32)
            logits_BxV, cache = program.prefill(weights, program.new_cache(), prompts_BxP, lengths_B)
            got = [np.asarray(logits_BxV)]
            for step in range(NEW_TOKENS - 1):
                tokens_B = made["tokens"][:, step].astype(np.int32)
                logits_BxV, cache = program.decode(weights, cache, tokens_B, lengths_B + step)
                got.append(np.asarray(logits_BxV))
            expected = made["logits"]
            error = np.abs(np.stack(got) - expected)
            worst = error.reshape(NEW_TOKENS, -1).max(axis=1)
            row = {"case": name, "run": run, "max_abs_logit": float(np.abs(expected).max()),
                   "max_error": float(error.max()), "first_step_over": _first(worst > 1e-3),
                   "of_tolerance": float((error / (1e-4 + 1e-4 * np.abs(expected))).max())}  # fmt: skip
            rows.append(row)
            print(f"generate {name:28s} {run:8s} max error {row['max_error']:.2e}  "
                  f"{row['of_tolerance']:.2f} of 1e-4 + 1e-4|ref|"
                  + (f"  (from step {row['first_step_over']})" if row["first_step_over"] is not None
                     else ""))  # fmt: skip
    (out / "generate.json").write_text(json.dumps(rows, indent=2))


def _first(flags) -> int | None:
    hits = np.flatnonzero(flags)
    return int(hits[0]) if hits.size else None


def _export(out: Path) -> None:
    """LoRA fine-tunes (their B non-zero) of the Llama 3.1 case, exported merged and as PEFT adapters, and
    of the Gemma 2 and Gemma 3 cases, merged, with shardmem's logits of each for reload to compare with."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from shardmem import build_mesh, build_program, config_from_dict
    from shardmem.finetune.export import export_safetensors

    for case, targets, adapters_too in (
        ("llama3.1 rope scaling", ["layers/wq", "layers/wv", "embedding", "lm_head"], True),
        ("gemma2", ["layers/wq", "layers/wv", "layers/w_down"], False),
        ("gemma3", ["layers/wq", "layers/wk", "layers/w_up"], False),
    ):
        lora = {"rank": 4, "alpha": 8, "targets": targets}
        finetune = {"init_from": str(out / _slug(case)), "base_dtype": "float32", "lora": lora}
        config = config_from_dict({"model": {"seq_len": SEQ}, "mesh": {"axes": {"data": 1}},
                                   "precision": {"compute": "float32"}, "train": {"global_batch": 2},
                                   "finetune": finetune})  # fmt: skip
        program = build_program(config, build_mesh({"data": 1}, jax.devices()[:1]))
        state = program.init()
        for i, target in enumerate(targets):
            adapted = state["params"]
            for key in target.split("/"):
                adapted = adapted[key]
            b = adapted["lora_b"]
            adapted["lora_b"] = 0.05 * jax.random.normal(jax.random.key(i), b.shape, b.dtype)

        @jax.jit
        def forward(trainable, frozen, tokens, program=program):
            with program.rules.activate(program.mesh):
                return nnx.merge(program.graphdef, program.finetune.assemble(trainable, frozen))(tokens)

        name = _export_name(case)
        logits = forward(state["params"], state["frozen"], TOKENS.astype(np.int32))
        np.save(out / f"{name}-logits.npy", np.asarray(logits))
        export_safetensors(program, state, out / f"{name}-merged", dtype=jnp.float32, force=True)
        if adapters_too:
            export_safetensors(
                program, state, out / f"{name}-adapters", dtype=jnp.float32, adapters_only=True, force=True
            )
        print(f"exported {case} to {out / f'{name}-merged'}" + (" and -adapters" if adapters_too else ""))


def _export_name(case: str) -> str:
    return "exported" if case.startswith("llama") else f"exported-{_slug(case)}"


def reload(out: Path) -> None:
    import torch
    import transformers

    tokens = torch.tensor(TOKENS)
    for case in ("llama3.1 rope scaling", "gemma2", "gemma3"):
        name = _export_name(case)
        expected = np.load(out / f"{name}-logits.npy")
        merged, info = transformers.AutoModelForCausalLM.from_pretrained(
            out / f"{name}-merged", dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
        with torch.no_grad():
            got = merged.eval()(tokens).logits.numpy()
        print(f"{case} merged export in transformers ({type(merged).__name__}, missing keys "
              f"{info['missing_keys']}, unexpected {info['unexpected_keys']}): max error "
              f"{np.abs(got - expected).max():.2e} (|logit| <= {np.abs(expected).max():.2f})")  # fmt: skip
    try:
        from peft import AutoPeftModelForCausalLM
    except ImportError:
        print("peft is not installed: adapters not checked")
        return
    expected = np.load(out / "exported-logits.npy")
    adapted = AutoPeftModelForCausalLM.from_pretrained(out / "exported-adapters", dtype=torch.float32)
    with torch.no_grad():
        got = adapted(tokens).logits.numpy()
    print(f"adapters in PEFT on the base it names: max error {np.abs(got - expected).max():.2e}")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name)


if __name__ == "__main__":
    step, out = sys.argv[1], Path(sys.argv[2])
    {"make": make, "check": check, "reload": reload}[step](out)
