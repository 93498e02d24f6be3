"""Checkpoint features against transformers' own PyTorch models (BENCHMARKS.md, issue 40).

transformers' PyTorch models make random tiny checkpoints with each feature (Llama 3.1/3.2 rope scaling,
linear, dynamic and YaRN scalings, Mistral's sliding window, tied and untied heads, a sharded folder with an
index and a stray consolidated file, Gemma) with their own ``save_pretrained``, and their logits; shardmem
loads each folder knowing only ``seq_len`` (the rest from config.json) and compares its float32 logits.
Then shardmem exports a LoRA fine-tune of one of them, merged and as adapters, and transformers (and PEFT,
where installed) load those folders as they are. Three steps, two Pythons (PyTorch is not in shardmem's
environment):

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
    "mistral window, xla": ("MistralConfig", dict(sliding_window=16), {"attention": "xla"}),
    "mistral window, chunked": ("MistralConfig", dict(sliding_window=16), {"attention": "chunked",
                                                                         "attention_chunk": 16}),
    "sharded + index + stray file": ("LlamaConfig", dict(), {}),
    "gemma": ("GemmaConfig", dict(head_dim=32, hidden_activation="gelu_pytorch_tanh"), {}),
}  # fmt: skip


def make(out: Path) -> None:
    import torch
    import transformers

    for i, (name, (config_class, options, _)) in enumerate(CASES.items()):
        folder = out / _slug(name)
        if name.startswith("mistral window, chunked"):
            continue  # The xla case's checkpoint.
        torch.manual_seed(i)
        config = getattr(transformers, config_class)(**{**COMMON, **options})
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            for parameter in model.parameters():  # Weights of 0.1: logits of order 1 to 10.
                parameter.normal_(0, 0.1)
            if config_class != "GemmaConfig":  # Gemma multiplies by 1 + its norms' weights.
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
        print(f"{name}: {sorted(p.name for p in folder.iterdir())}")


def check(out: Path) -> None:
    import jax
    from flax import nnx

    from shardmem import build_mesh, build_program, config_from_dict

    rows = []
    for name, (_, _, model) in CASES.items():
        folder = out / _slug(name.replace(", chunked", ", xla"))
        config = config_from_dict({"model": {"seq_len": SEQ, **model}, "mesh": {"axes": {"data": 1}},
                                   "precision": {"compute": "float32"}, "train": {"global_batch": 2},
                                   "finetune": {"init_from": str(folder)}})  # fmt: skip
        program = build_program(config, build_mesh({"data": 1}, jax.devices()[:1]))
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
    _export(out)


def _export(out: Path) -> None:
    """A LoRA fine-tune of the Llama 3.1 case (its B non-zero), exported merged and as PEFT adapters, with
    shardmem's own merged logits for reload to compare with."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from shardmem import build_mesh, build_program, config_from_dict
    from shardmem.finetune.export import export_safetensors

    base = out / _slug("llama3.1 rope scaling")
    lora = {"rank": 4, "alpha": 8, "targets": ["layers/wq", "layers/wv", "embedding", "lm_head"]}
    finetune = {"init_from": str(base), "base_dtype": "float32", "lora": lora}
    config = config_from_dict({"model": {"seq_len": SEQ}, "mesh": {"axes": {"data": 1}},
                               "precision": {"compute": "float32"}, "train": {"global_batch": 2},
                               "finetune": finetune})  # fmt: skip
    program = build_program(config, build_mesh({"data": 1}, jax.devices()[:1]))
    state = program.init()
    for i, path in enumerate((("layers", "wq"), ("layers", "wv"), ("embedding",), ("lm_head",))):
        adapters = state["params"]
        for key in path:
            adapters = adapters[key]
        b = adapters["lora_b"]
        adapters["lora_b"] = 0.05 * jax.random.normal(jax.random.key(i), b.shape, b.dtype)

    @jax.jit
    def forward(trainable, frozen, tokens):
        with program.rules.activate(program.mesh):
            return nnx.merge(program.graphdef, program.finetune.assemble(trainable, frozen))(tokens)

    np.save(
        out / "lora_logits.npy",
        np.asarray(forward(state["params"], state["frozen"], TOKENS.astype(np.int32))),
    )
    export_safetensors(program, state, out / "exported-merged", dtype=jnp.float32, force=True)
    export_safetensors(
        program, state, out / "exported-adapters", dtype=jnp.float32, adapters_only=True, force=True
    )
    print(f"exported to {out / 'exported-merged'} and {out / 'exported-adapters'}")


def reload(out: Path) -> None:
    import torch
    import transformers

    expected = np.load(out / "lora_logits.npy")
    tokens = torch.tensor(TOKENS)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "exported-merged", dtype=torch.float32)
    with torch.no_grad():
        got = merged(tokens).logits.numpy()
    print(f"merged export in transformers: max error {np.abs(got - expected).max():.2e} (|logit| <= "
          f"{np.abs(expected).max():.2f})")  # fmt: skip
    try:
        from peft import AutoPeftModelForCausalLM
    except ImportError:
        print("peft is not installed: adapters not checked")
        return
    adapted = AutoPeftModelForCausalLM.from_pretrained(out / "exported-adapters", dtype=torch.float32)
    with torch.no_grad():
        got = adapted(tokens).logits.numpy()
    print(f"adapters in PEFT on the base it names: max error {np.abs(got - expected).max():.2e}")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name)


if __name__ == "__main__":
    step, out = sys.argv[1], Path(sys.argv[2])
    {"make": make, "check": check, "reload": reload}[step](out)
