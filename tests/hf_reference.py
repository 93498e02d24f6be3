"""Hugging Face checkpoints made here, and the forward pass ``transformers`` runs on them, ported to numpy
float64 from its PyTorch models (``modeling_llama.py``, ``modeling_mistral.py``, ``modeling_qwen2.py``,
``modeling_qwen3.py``, ``modeling_gemma.py``, ``modeling_gemma2.py``, ``modeling_gemma3.py``,
``modeling_rope_utils.py``,
``masking_utils.py`` of transformers 4.57): the independent reference shardmem's logits are compared with,
written without shardmem's code.

    config = hf_config("llama", rope_scaling={"rope_type": "llama3", ...})   # a config.json
    tensors = random_tensors(config, seed=0)                                 # HF names, [out, in]
    save(folder, config, tensors, shards=2)                                  # + the index file
    expected_BxLxV = logits(config, tensors, tokens_BxL)
    expected_NxBxV = generate_logits(config, tensors, prompts, steps=N)   # with a KV cache
"""

import json
import math

import numpy as np
from safetensors.numpy import save_file

V, D, L, H, G, K, F = 256, 64, 2, 4, 2, 16, 96  # vocabulary, width, layers, heads, KV heads, head, MLP


def hf_config(model_type: str = "llama", **options) -> dict:
    """A config.json of a tiny two-layer model of ``model_type``, ``options`` on top."""
    config = {"model_type": model_type, "architectures": [f"{model_type.capitalize()}ForCausalLM"],
              "vocab_size": V, "hidden_size": D, "intermediate_size": F, "num_hidden_layers": L,
              "num_attention_heads": H, "num_key_value_heads": G, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_position_embeddings": 64, "tie_word_embeddings": False, "hidden_act": "silu",
              "torch_dtype": "float32"}  # fmt: skip
    if model_type == "gemma":
        config |= {"head_dim": 32, "tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh"}
    if model_type == "gemma2":  # Caps small enough to bite on random weights; a scale not 1 / sqrt(head).
        config |= {"head_dim": 32, "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
                   "query_pre_attn_scalar": 24, "attn_logit_softcapping": 0.5,
                   "final_logit_softcapping": 1.5, "sliding_window": 64}  # fmt: skip
    if model_type == "gemma3_text":  # Gemma 3's text model: windows on layer 0 of every 2, a local RoPE base.
        config |= {"architectures": ["Gemma3ForCausalLM"], "head_dim": 32, "tie_word_embeddings": True,
                   "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 24,
                   "sliding_window": 64, "sliding_window_pattern": 2, "rope_local_base_freq": 100.0,
                   "rope_scaling": {"rope_type": "linear", "factor": 8.0}}  # fmt: skip
    if model_type == "mistral":
        config["sliding_window"] = None
    if model_type == "qwen3":  # Qwen3's heads are wider than hidden / heads, as Qwen3-0.6B's (128 > 64).
        config["head_dim"] = 24
    return config | options


GEMMAS = ("gemma", "gemma2", "gemma3_text")  # Norms of 1 + weight, embeddings scaled by sqrt(width).
POST_NORMS = ("gemma2", "gemma3_text")  # Four norms a layer, a scale and caps of the scores.


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def window_of(config: dict) -> tuple[int | None, list[bool]]:
    """The sliding window and which layers it slides on: Mistral's every layer; Qwen2's and Qwen3's with
    ``use_sliding_window``, from ``max_window_layers`` on; Gemma 2's the first and every other one; Gemma
    3's all but every ``sliding_window_pattern``-th (6); each as ``layer_types`` says where given."""
    kind, layers = config["model_type"], range(config["num_hidden_layers"])
    window = config.get("sliding_window") if kind in ("mistral", *POST_NORMS) else None
    if kind in ("qwen2", "qwen3") and config.get("use_sliding_window"):
        window = config.get("sliding_window")
    pattern = config.get("sliding_window_pattern", 6)
    default = {"gemma2": [(i + 1) % 2 == 1 for i in layers],
               "gemma3_text": [(i + 1) % pattern != 0 for i in layers],
               "qwen2": [i >= config.get("max_window_layers", 28) for i in layers]}  # fmt: skip
    slides = default.get(kind.replace("qwen3", "qwen2"), [True for _ in layers])
    if config.get("layer_types") and kind != "mistral":
        slides = [t == "sliding_attention" for t in config["layer_types"]]
    return window, slides


def random_tensors(config: dict, seed: int = 0) -> dict:
    """Random float32 weights under the model's Hugging Face names and ``[out, in]`` layout."""
    rng = np.random.default_rng(seed)
    w = lambda *shape: (rng.normal(size=shape) * 0.1).astype(np.float32)  # noqa: E731
    d, k, heads, groups = (
        config["hidden_size"],
        head_dim(config),
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    gemma = config["model_type"] in GEMMAS
    norm = (lambda n=d: w(n)) if gemma else (lambda n=d: 1 + w(n))  # Gemma's scales multiply as 1 + weight.
    tensors = {"model.embed_tokens.weight": w(config["vocab_size"], d), "model.norm.weight": norm()}
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = w(config["vocab_size"], d)
    for i in range(config["num_hidden_layers"]):
        p, f = f"model.layers.{i}.", config["intermediate_size"]
        tensors |= {p + "self_attn.q_proj.weight": w(heads * k, d),
                    p + "self_attn.k_proj.weight": w(groups * k, d),
                    p + "self_attn.v_proj.weight": w(groups * k, d),
                    p + "self_attn.o_proj.weight": w(d, heads * k),
                    p + "mlp.gate_proj.weight": w(f, d), p + "mlp.up_proj.weight": w(f, d),
                    p + "mlp.down_proj.weight": w(d, f), p + "input_layernorm.weight": norm(),
                    p + "post_attention_layernorm.weight": norm()}  # fmt: skip
        if config["model_type"] == "qwen2":
            for n, width in (("q", heads * k), ("k", groups * k), ("v", groups * k)):
                tensors[f"{p}self_attn.{n}_proj.bias"] = w(width)
        if config["model_type"] in POST_NORMS:  # Four norms a layer (post_attention_layernorm: attention's).
            tensors |= {p + "pre_feedforward_layernorm.weight": norm(),
                        p + "post_feedforward_layernorm.weight": norm()}  # fmt: skip
        if config["model_type"] in ("qwen3", "gemma3_text"):  # A scale over a head's width for the queries,
            tensors |= {f"{p}self_attn.q_norm.weight": norm(k),
                        f"{p}self_attn.k_norm.weight": norm(k)}  # fmt: skip  # one for the keys.
    return tensors


def save(folder, config: dict | None, tensors: dict, shards: int = 1, index: bool = True) -> None:
    """Writes the checkpoint as the Hub lays it out: ``model.safetensors``, or ``shards`` files with
    ``model.safetensors.index.json`` (unless ``index`` is False); and ``config.json`` (unless ``config``
    is None)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = names[s * len(names) // shards : (s + 1) * len(names) // shards]
            save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
            weight_map |= {n: file for n in part}
        listing = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
            "weight_map": weight_map,
        }
        if index:
            (folder / "model.safetensors.index.json").write_text(json.dumps(listing))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))


def inv_freq(config: dict, seq_len: int) -> tuple[np.ndarray, float]:
    """``ROPE_INIT_FUNCTIONS[rope_type](config, seq_len=seq_len)``: inverse frequencies and the factor on
    cos and sin (modeling_rope_utils.py; dynamic as :class:`Rotary` recomputes it for a forward's
    ``seq_len``)."""
    dim, base = head_dim(config), config["rope_theta"]
    default = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return default, 1.0
    factor = scaling["factor"]
    if kind == "linear":
        return default / factor, 1.0
    if kind == "dynamic":
        longest = config["max_position_embeddings"]
        if seq_len <= longest:
            return default, 1.0
        base = base * ((factor * seq_len / longest) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / base ** (np.arange(0, dim, 2) / dim), 1.0
    if kind == "llama3":
        old = scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / default
        scaled = np.where(wavelen > old / low, default / factor, default)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return np.where(medium, smoothed, scaled), 1.0
    assert kind == "yarn", kind
    original = scaling.get("original_max_position_embeddings") or config["max_position_embeddings"]
    attention = scaling.get("attention_factor")
    if attention is None:  # get_mscale, with DeepSeek's mscale and mscale_all_dim where both are given.
        mscale = lambda m=1: 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0  # noqa: E731
        both = scaling.get("mscale") and scaling.get("mscale_all_dim")
        attention = mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"]) if both else mscale()
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = math.floor(correction(fast)), math.ceil(correction(slow))
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low if high != low else 0.001), 0, 1)
    extrapolation = 1 - ramp
    positions = base ** (np.arange(0, dim, 2) / dim)
    return (1 / (factor * positions)) * (1 - extrapolation) + (1 / positions) * extrapolation, attention


class Rotary:
    """transformers' rotary module (``LlamaRotaryEmbedding``, the same class in each type), its state
    kept across forwards as ``dynamic_rope_update`` keeps it: a dynamic scaling's frequencies are
    recomputed for ``seq_len = max(position_ids) + 1`` when that exceeds the longest seen, and reset to
    the original ones for a forward shorter than ``max_position_embeddings`` after a longer one."""

    def __init__(self, config: dict):
        self.config, self.original = config, config["max_position_embeddings"]
        self.longest = self.original  # max_seq_len_cached
        self.inv, self.attention = inv_freq(config, self.original)
        scaling = config.get("rope_scaling") or {}
        self.dynamic = "dynamic" in scaling.get("rope_type", scaling.get("type", "default"))

    def __call__(self, position_ids_BxS) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin ``[B, 1, S, head_dim]`` of the positions."""
        if self.dynamic:
            seq_len = int(position_ids_BxS.max()) + 1
            if seq_len > self.longest:  # growth
                self.inv, self.attention = inv_freq(self.config, seq_len)
                self.longest = seq_len
            if seq_len < self.original < self.longest:  # reset
                self.inv, self.attention = inv_freq(self.config, self.original)
                self.longest = self.original
        emb = np.concatenate([position_ids_BxS[..., None] * self.inv] * 2, -1)[:, None]
        return np.cos(emb) * self.attention, np.sin(emb) * self.attention


def rotaries(config: dict) -> tuple[Rotary, Rotary]:
    """The rotary modules of the full-attention layers and of the sliding ones: Gemma 3's local one has
    its own base (``rope_local_base_freq``) and no scaling; every other type's layers share one."""
    if config["model_type"] != "gemma3_text":
        shared = Rotary(config)
        return shared, shared
    local = config | {"rope_theta": config.get("rope_local_base_freq", 10000.0), "rope_scaling": None}
    return Rotary(config), Rotary(local)


def logits(config: dict, tensors: dict, tokens) -> np.ndarray:
    """The model's logits for ``tokens`` ``[B, S]``: transformers' forward, in float64."""
    B, S = tokens.shape
    positions = np.broadcast_to(np.arange(S), (B, S))
    return forward(config, tensors, tokens, positions, np.ones((B, S), bool), rotaries(config), None)


def generate_logits(config: dict, tensors: dict, prompts: list, steps: int) -> np.ndarray:
    """``[steps, B, V]``: the logits of transformers' greedy ``generate`` with a KV cache on a fresh model
    (``DynamicCache``): the prompts left-padded with an attention mask, their ``position_ids`` its
    ``cumsum - 1`` (``prepare_inputs_for_generation``), one forward over the prompts, then one per new
    token, the keys in the cache as each forward rotated them."""
    width, rotary = max(map(len, prompts)), rotaries(config)
    tokens = np.array([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in prompts], bool)
    cache, out = [], []
    for _ in range(steps):
        fresh = tokens[:, -1:] if out else tokens
        positions = np.where(mask, np.cumsum(mask, -1) - 1, 1)[:, -fresh.shape[1] :]
        step = forward(config, tensors, fresh, positions, mask, rotary, cache)[:, -1]
        out.append(step)
        tokens = np.concatenate([tokens, step.argmax(-1)[:, None]], -1)
        mask = np.concatenate([mask, np.ones((len(prompts), 1), bool)], -1)
    return np.stack(out)


def forward(config: dict, tensors: dict, tokens, positions, mask, rotary: tuple, cache: list | None):
    """Logits ``[B, S, V]`` of ``tokens`` ``[B, S]`` at ``positions`` after the ``cache``'s keys and values
    (a list of each layer's, extended in place; None: no cache); ``mask`` ``[B, T]``: which of the
    cache's and these tokens are not padding; ``rotary``: :func:`rotaries`."""
    t = {k: v.astype(np.float64) for k, v in tensors.items()}
    gemma, gemma2 = config["model_type"] in GEMMAS, config["model_type"] in POST_NORMS
    heads, groups, k = config["num_attention_heads"], config["num_key_value_heads"], head_dim(config)
    eps = config["rms_norm_eps"]

    def norm(x, w):  # Gemma's norms multiply by 1 + weight.
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * ((1 + w) if gemma else w)

    def rotate_half(x):
        x1, x2 = np.split(x, 2, axis=-1)
        return np.concatenate([-x2, x1], axis=-1)

    def act(x):
        if gemma:  # gelu_pytorch_tanh
            return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
        return x / (1 + np.exp(-x))

    B, S = tokens.shape
    T = mask.shape[1]
    (cos, sin), local = rotary[0](positions), rotary[1](positions)
    q_idx, kv_idx = np.arange(T - S, T)[:, None], np.arange(T)[None, :]
    allowed = (kv_idx <= q_idx) & mask[:, None, None, :]
    full = np.where(allowed, 0.0, np.finfo(np.float64).min)  # A padding query sees nothing: finite.
    window, slides = window_of(config)
    sliding = full
    if window is not None:  # masking_utils.sliding_window_overlay
        sliding = np.where(allowed & (kv_idx > q_idx - window), 0.0, np.finfo(np.float64).min)
    scale = config.get("query_pre_attn_scalar", k) ** -0.5 if gemma2 else k**-0.5

    def cap(x, key):  # Gemma 2's soft caps: cap * tanh(x / cap); Gemma 3's attention passes none.
        capped = (
            gemma2
            and config.get(key)
            and (key, config["model_type"]) != ("attn_logit_softcapping", "gemma3_text")
        )
        return np.tanh(x / config[key]) * config[key] if capped else x

    x = t["model.embed_tokens.weight"][tokens]
    if gemma:
        x = x * np.sqrt(config["hidden_size"])
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, t[p + "input_layernorm.weight"])
        q, kk, v = (h @ t[p + f"self_attn.{n}_proj.weight"].T + t.get(p + f"self_attn.{n}_proj.bias", 0)
                    for n in "qkv")  # fmt: skip
        q = q.reshape(B, S, heads, k).transpose(0, 2, 1, 3)
        kk, v = (a.reshape(B, S, groups, k).transpose(0, 2, 1, 3) for a in (kk, v))
        if config["model_type"] in ("qwen3", "gemma3_text"):  # Each head normed over its width.
            q, kk = norm(q, t[p + "self_attn.q_norm.weight"]), norm(kk, t[p + "self_attn.k_norm.weight"])
        c, s = local if slides[i] else (cos, sin)  # Gemma 3's sliding layers: the local RoPE base.
        q, kk = q * c + rotate_half(q) * s, kk * c + rotate_half(kk) * s
        if cache is not None:  # The keys as rotated when they were computed.
            if len(cache) == i:
                cache.append((kk[:, :, :0], v[:, :, :0]))
            kk, v = (np.concatenate([old, new], 2) for old, new in zip(cache[i], (kk, v), strict=True))
            cache[i] = (kk, v)
        kk, v = np.repeat(kk, heads // groups, axis=1), np.repeat(v, heads // groups, axis=1)
        scores = cap(q @ kk.transpose(0, 1, 3, 2) * scale, "attn_logit_softcapping")
        scores = scores + (sliding if slides[i] else full)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = (probs @ v).transpose(0, 2, 1, 3).reshape(B, S, heads * k) @ t[p + "self_attn.o_proj.weight"].T
        if gemma2:
            x = x + norm(out, t[p + "post_attention_layernorm.weight"])
            h = norm(x, t[p + "pre_feedforward_layernorm.weight"])
        else:
            x = x + out
            h = norm(x, t[p + "post_attention_layernorm.weight"])
        gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        mlp = (act(gate) * up) @ t[p + "mlp.down_proj.weight"].T
        x = x + (norm(mlp, t[p + "post_feedforward_layernorm.weight"]) if gemma2 else mlp)
    head = t["model.embed_tokens.weight"] if config["tie_word_embeddings"] else t["lm_head.weight"]
    return cap(norm(x, t["model.norm.weight"]) @ head.T, "final_logit_softcapping")
