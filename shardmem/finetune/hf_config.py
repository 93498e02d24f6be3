"""The architecture a pretrained checkpoint declares: a Hugging Face folder's ``config.json`` (or a
shardmem run's ``config.yaml``) read into the reference model's section, and ``config.json`` written
back for an export.

    source = pretrained_model("Llama-3.2-1B/")          # (model keys, where), or None: nothing to read
    model = ModelConfig(**{**source.fields, "seq_len": 2048})
    text = json.dumps(to_hf(model, base=source.hf, dtype="bfloat16"))   # an export's config.json

:func:`~shardmem.config.config_from_dict` takes every architecture key the model section leaves out
from there, and refuses one it writes (or its preset does) that says otherwise, naming the key and both
values. ``config.json`` is read as ``transformers`` reads it, for the model types the reference model
implements (:data:`MODEL_TYPES`); an option that would change the forward pass and that the reference
model does not have (a bias on the output projection, a partial rotary embedding, a quantized
checkpoint, ...) is refused in one line, never dropped. A window on some layers only (Gemma 2's every
other layer, Gemma 3's five of six) is ``sliding_layers``: each layer picks its own window, and Gemma 3's
its RoPE base (``local_rope_theta``), by its index in the stack.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import yaml

from shardmem.errors import ConfigError, one_of
from shardmem.finetune.safetensors_files import safetensors_files
from shardmem.models.rope import ROPE_TYPES

#: config.json's model_type -> the transformers class its weights are written for.
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM",
               "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}  # fmt: skip
#: The model keys a checkpoint decides; the rest (seq_len, the attention kernel, chunks, the experts'
#: capacity and loss weight) are the training run's.
ARCHITECTURE_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "head_dim",
                     "rope_theta", "rope_scaling", "sliding_window", "sliding_layers", "local_rope_theta",
                     "norm_eps", "norm_offset", "scale_embeddings", "mlp_activation", "qkv_bias", "qk_norm",
                     "post_norms", "attention_scale", "attention_softcap", "logit_softcap",
                     "tie_embeddings", "n_experts", "experts_per_token")  # fmt: skip
# transformers' defaults for keys a config.json may leave out, by model type (num_key_value_heads:
# Llama's is num_attention_heads, as every type's null is; max_position_embeddings: dynamic and yarn's).
_DEFAULTS = {
    "llama": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
              "max_position_embeddings": 2048},
    "mistral": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
                "sliding_window": 4096, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32},
    "qwen2": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
              "num_key_value_heads": 32, "max_position_embeddings": 32768},
    "qwen3": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu", "head_dim": 128,
              "num_key_value_heads": 32, "max_position_embeddings": 32768},
    "gemma": {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh",
              "head_dim": 256, "num_key_value_heads": 16, "max_position_embeddings": 8192},
    "gemma2": {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
               "head_dim": 256, "num_key_value_heads": 4, "max_position_embeddings": 8192,
               "sliding_window": 4096, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0},
    "gemma3_text": {"rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                    "hidden_activation": "gelu_pytorch_tanh", "head_dim": 256, "num_key_value_heads": 4,
                    "max_position_embeddings": 131072, "sliding_window": 4096, "query_pre_attn_scalar": 256,
                    "final_logit_softcapping": None,
                    "rope_theta": 1e6, "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6},
}  # fmt: skip
#: Gemma's family: norms of 1 + weight, embeddings scaled by sqrt(width); and the types of four norms a
#: layer, a scale of their own on the scores and a cap on the logits.
_GEMMAS, _POST_NORMS = ("gemma", "gemma2", "gemma3_text"), ("gemma2", "gemma3_text")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_HF_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}  # model.mlp_activation -> hidden_act.
#: The bias flags each type's forward reads (transformers 4.57): Llama's attention projections take
#: attention_bias and its MLP's mlp_bias; Gemma's attention takes attention_bias, its MLP has no bias;
#: Mistral builds every projection without one, and Qwen2 its q, k and v with one (qkv_bias), whatever
#: config.json says; Qwen3's attention_bias puts one on q, k, v and o.
_BIAS_FLAGS = {"llama": ("attention_bias", "mlp_bias"), "gemma": ("attention_bias",), "mistral": (),
               "qwen2": (), "qwen3": ("attention_bias",), "gemma2": ("attention_bias",),
               "gemma3_text": ("attention_bias",)}  # fmt: skip
#: The types whose layers slide as Qwen2's do: from ``max_window_layers`` on, or as ``layer_types`` says,
#: when ``use_sliding_window``.
_QWEN_WINDOWS = ("qwen2", "qwen3")
_ROPE_KEYS = {"rope_type", "factor", "low_freq_factor", "high_freq_factor",
              "original_max_position_embeddings",
              "beta_fast", "beta_slow", "attention_factor", "truncate"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """The architecture a checkpoint declares: ``fields`` (model keys -> values), the file that said so
    (``where``), and the ``config.json`` itself (``hf``) when it is a Hugging Face checkpoint."""

    fields: dict
    where: str
    hf: dict | None = None
    multimodal: bool = False  # The text model of a multimodal checkpoint (Gemma 3's), hf its config.json.


def pretrained_model(init_from: Any) -> Pretrained | None:
    """Returns what ``finetune.init_from`` says of the model: a Hugging Face folder's ``config.json``
    (or the one beside a safetensors file), or a shardmem run's ``config.yaml`` (its folder, its
    checkpoints or one step's); None when there is none (a bare file, a path not there yet)."""
    if not isinstance(init_from, str) or not init_from:
        return None
    path = Path(init_from).expanduser()
    folder = path if path.is_dir() else path.parent
    if (folder / "config.json").is_file() and (path.is_dir() or path.suffix == ".safetensors"):
        file = folder / "config.json"
        try:
            hf = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"finetune.init_from: {file} is not a readable JSON file ({e}); download it "
                              "again") from None  # fmt: skip
        if not isinstance(hf, dict):
            raise ConfigError(f"finetune.init_from: {file} holds no JSON object; download it again")
        if hf.get("model_type") == "gemma3":  # Gemma 3 4B and larger: its text model, the vision tower left.
            hf = text_model(hf, str(file))
            return Pretrained(model_fields(hf, f"{file} (its text_config)"), str(file), hf, multimodal=True)
        return Pretrained(model_fields(hf, str(file)), str(file), hf)
    if path.suffix == ".safetensors" or (path.is_dir() and any(safetensors_files(path))):
        return None  # Weights without a config.json: the model section says what they are.
    run = run_folder(path)
    if run is None:
        return None
    file = run / "config.yaml"
    try:
        model = (yaml.safe_load(file.read_text()) or {}).get("model")
    except (OSError, yaml.YAMLError, AttributeError) as e:
        raise ConfigError(f"finetune.init_from: {file}, the run's config, cannot be read ({e})") from None
    if not isinstance(model, dict) or "factory" in model:
        return None  # A model of your own: its parameters say what they are.
    return Pretrained({k: model[k] for k in ARCHITECTURE_KEYS if k in model}, str(file))


#: Gemma3TextConfig's sizes, which a multimodal Gemma 3's text_config leaves out where they are these.
_GEMMA3_SIZES = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                 "num_hidden_layers": 26, "num_attention_heads": 8}  # fmt: skip


def text_model(hf: dict, where: str) -> dict:
    """The ``config.json`` of a multimodal Gemma 3's (``model_type: gemma3``) text model as its
    ``Gemma3ForCausalLM``'s: its ``text_config`` with Gemma3TextConfig's sizes (and longest context)
    where it leaves them out, and the top level's dtype, token ids and ``quantization_config`` (a quantized
    checkpoint says so there: refused as the text model's). The weights load from the text model's
    tensors, the vision tower's left out (:mod:`shardmem.finetune.weights`); an export is that
    ``Gemma3ForCausalLM``."""
    text = hf.get("text_config", {})
    if not isinstance(text, dict):
        raise ConfigError(f"finetune.init_from: {where} has text_config={json.dumps(text)}, where "
                          "transformers writes the text model's config (an object); give the checkpoint's "
                          "own config.json")  # fmt: skip
    out = {**_GEMMA3_SIZES, **text, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}
    out.setdefault("max_position_embeddings", _DEFAULTS["gemma3_text"]["max_position_embeddings"])
    top = ("torch_dtype", "dtype", "eos_token_id", "bos_token_id", "pad_token_id", "quantization_config")
    for key in top:
        if key in hf and key not in text:
            out[key] = hf[key]
    return out


def run_folder(path: Path) -> Path | None:
    """Returns the shardmem run folder ``path`` is (or is inside: its checkpoints, a step, an item),
    one that has a ``config.yaml`` and a ``checkpoints`` folder; None otherwise."""
    for folder in (path, *list(path.parents)[:3]):
        if (folder / "config.yaml").is_file() and (folder / "checkpoints").is_dir():
            return folder
    return None


def model_fields(hf: dict, where: str) -> dict:
    """Returns the reference model's architecture keys for a ``config.json``, or raises ConfigError
    naming ``where`` and what the reference model does not implement."""
    kind = hf.get("model_type")
    if kind not in MODEL_TYPES:
        raise ConfigError(
            f"finetune.init_from: {where} says model_type {kind!r}, which the reference model does not "
            f"implement ({one_of(MODEL_TYPES)}); a model of your own can load it (model.factory)"
        )
    get = lambda key: hf[key] if hf.get(key) is not None else _DEFAULTS[kind].get(key)  # noqa: E731

    def refuse(what: str) -> None:
        raise ConfigError(f"finetune.init_from: {where} has {what}, which the reference model does not "
                          "implement: its logits would be wrong, so it is not loaded")  # fmt: skip

    _check_types(hf, where, kind)
    if hf.get("quantization_config"):
        refuse(
            f"quantization_config ({hf['quantization_config'].get('quant_method', '?')}-quantized weights)"
        )
    for key in _BIAS_FLAGS[kind]:
        if hf.get(key):
            refuse(f"{key}: true")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(f"partial_rotary_factor {hf['partial_rotary_factor']}")
    if kind == "gemma3_text" and hf.get("use_bidirectional_attention"):
        refuse("use_bidirectional_attention: true (an encoder's attention, EmbeddingGemma's)")
    activation = get("hidden_act")  # Llama's, Mistral's and Qwen2's: hidden_activation is no key of theirs.
    if kind in _POST_NORMS:  # Their forwards read hidden_activation alone.
        activation = get("hidden_activation")
    if kind == "gemma" and hf.get("hidden_activation"):
        # transformers' PyTorch Gemma runs hidden_act (its default where config.json has none); its Flax
        # Gemma, hidden_activation: where they differ, which the model was trained with is not known.
        said = hf["hidden_activation"]
        if _ACTIVATIONS.get(activation, activation) != _ACTIVATIONS.get(said, said):
            default = "" if hf.get("hidden_act") else " (transformers' default)"
            refuse(f"hidden_act {activation!r}{default} and hidden_activation {said!r}, which "
                   "transformers' own models read differently (set both to the one the model was trained "
                   "with)")  # fmt: skip
        activation = said
    if activation not in _ACTIVATIONS:
        refuse(f"the activation {activation!r} (the reference model's: {one_of(_ACTIVATIONS)})")
    heads = hf["num_attention_heads"]
    head_dim = get("head_dim") or hf["hidden_size"] // heads
    kv_heads = hf.get("num_key_value_heads", _DEFAULTS[kind].get("num_key_value_heads")) or heads
    scaling = _rope_scaling(hf, where, get("max_position_embeddings"), refuse)
    gemma = kind in _GEMMAS
    window, sliding_layers = _sliding_window(hf, kind, where, refuse)
    fields = {
        "vocab_size": hf["vocab_size"], "d_model": hf["hidden_size"], "n_layers": hf["num_hidden_layers"],
        "n_heads": heads, "n_kv_heads": kv_heads,
        "d_ff": hf["intermediate_size"], "head_dim": head_dim,
        "rope_theta": float(hf.get("rope_theta", _DEFAULTS[kind].get("rope_theta", 10000.0))),
        "rope_scaling": scaling,
        "sliding_window": window, "sliding_layers": sliding_layers, "norm_eps": float(get("rms_norm_eps")),
        "norm_offset": 1.0 if gemma else 0.0, "scale_embeddings": gemma,
        "mlp_activation": _ACTIVATIONS[activation], "qkv_bias": kind == "qwen2",
        "qk_norm": kind in ("qwen3", "gemma3_text"),
        "tie_embeddings": bool(get("tie_word_embeddings")), "n_experts": 0,
        # What only Gemma 2 and 3 have, none of here: a model section that writes one is refused, not run.
        "post_norms": False, "attention_scale": None, "attention_softcap": None, "logit_softcap": None,
        "local_rope_theta": None,
    }  # fmt: skip
    if kind in _POST_NORMS:  # Four norms a layer, their scale of the scores, and caps (a null cap is none).
        scalar = get("query_pre_attn_scalar")

        def cap(key: str) -> float | None:
            value = hf[key] if key in hf else _DEFAULTS[kind][key]
            return None if value is None else float(value)

        scale = None if scalar == head_dim else float(scalar) ** -0.5
        fields |= {"post_norms": True, "attention_scale": scale,
                   # Gemma 3's attention passes no cap to its kernel, whatever attn_logit_softcapping says.
                   "attention_softcap": cap("attn_logit_softcapping") if kind == "gemma2" else None,
                   "logit_softcap": cap("final_logit_softcapping")}  # fmt: skip
    if kind == "gemma3_text":  # Its sliding layers rotate with their own base, unscaled.
        fields["local_rope_theta"] = float(get("rope_local_base_freq"))
    return fields


#: The sizes a config.json must give (transformers' names), and those it may.
_REQUIRED_SIZES = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window_pattern")
#: Other keys read, each checked where given: a quoted value would otherwise load as another model
#: (``bool("false")`` ties the embeddings). Qwen2's window keys may be 0.
_COUNTS = ("sliding_window", "max_window_layers")
_NUMBERS = ("rope_theta", "rms_norm_eps", "query_pre_attn_scalar", "rope_local_base_freq")
_CAPS = ("attn_logit_softcapping", "final_logit_softcapping")  # Gemma 2's: null is no cap.
_FLAGS = (
    "tie_word_embeddings",
    "use_sliding_window",
    "attention_bias",
    "mlp_bias",
    "use_bidirectional_attention",
)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: The keys the reader checks, what transformers writes for each, and the test of it.
_TYPES = (
    ((*_REQUIRED_SIZES, *_OPTIONAL_SIZES), "a positive integer", lambda v: _integer(v) and v > 0),
    (_COUNTS, "an integer of 0 or more", lambda v: _integer(v) and v >= 0),
    (_NUMBERS, "a positive number", lambda v: (_integer(v) or isinstance(v, float)) and v > 0),
    (_CAPS, "a positive number or null", lambda v: (_integer(v) or isinstance(v, float)) and v > 0),
    (_FLAGS, "true or false", lambda v: isinstance(v, bool)),
)


def _check_types(hf: dict, where: str, kind: str) -> None:
    """Raises ConfigError naming the file and the key for a size config.json lacks, or a value it gives
    in another type than transformers writes (a size as other than a positive integer, a flag as other
    than true or false, ...); a bias flag only where model type ``kind`` reads it."""
    unread = {"attention_bias", "mlp_bias"} - set(_BIAS_FLAGS[kind])
    for key in _REQUIRED_SIZES:
        if key not in hf:
            raise ConfigError(f"finetune.init_from: {where} has no {key}, where transformers writes a "
                              "positive integer; give the checkpoint's own config.json")  # fmt: skip
    for keys, written, valid in _TYPES:
        for key in (key for key in keys if key not in unread):
            value = hf.get(key)
            # A null rope_theta or rms_norm_eps is given too: transformers fails on it.
            given = value is not None or (key in _NUMBERS and key in hf)
            if given and not valid(value):
                raise ConfigError(
                    f"finetune.init_from: {where} has {key}={json.dumps(value)}, where "
                    f"transformers writes {written}; give the checkpoint's own config.json"
                )


#: What transformers writes for each rope_scaling key (its other keys are numbers, as factor).
_ROPE_VALUES = {
    "factor": ("a number", lambda v: _integer(v) or isinstance(v, float)),
    "original_max_position_embeddings": ("a positive integer", lambda v: _integer(v) and v > 0),
    "truncate": ("true or false", lambda v: isinstance(v, bool)),
}


def _rope_scaling(hf: dict, where: str, longest: int, refuse) -> dict | None:
    """``rope_scaling`` as the model section writes it; ``longest``: config.json's
    ``max_position_embeddings`` (or transformers' default), which dynamic and yarn read."""
    scaling = hf.get("rope_scaling")
    if not scaling:
        return None
    scaling = dict(scaling)
    scaling["rope_type"] = scaling.pop("rope_type", scaling.pop("type", None))  # transformers' old "type".
    scaling.pop("type", None)
    if scaling["rope_type"] == "default":
        return None
    if scaling["rope_type"] in ROPE_TYPES and scaling.get("factor") is None:  # transformers: a KeyError.
        raise ConfigError(f"finetune.init_from: {where} has rope_scaling {json.dumps(hf['rope_scaling'])} "
                          "without its factor, which transformers requires; give the checkpoint's own "
                          "config.json")  # fmt: skip
    if scaling["rope_type"] == "yarn":  # DeepSeek's pair: transformers' attention factor, where both are.
        mscale, all_dims = scaling.pop("mscale", None), scaling.pop("mscale_all_dim", None)
        if scaling.get("attention_factor") is None and mscale and all_dims:
            factor = scaling["factor"]
            scaled = lambda m: 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0  # noqa: E731
            scaling["attention_factor"] = scaled(mscale) / scaled(all_dims)
    unknown = sorted(set(scaling) - _ROPE_KEYS)
    if unknown:
        refuse(f"rope_scaling {', '.join(unknown)} ({scaling['rope_type']})")
    original = scaling.get("original_max_position_embeddings")
    if isinstance(original, float) and original.is_integer():  # transformers computes with it as written.
        scaling["original_max_position_embeddings"] = int(original)
    for key, value in scaling.items():
        written, valid = _ROPE_VALUES.get(key, _ROPE_VALUES["factor"])
        if key != "rope_type" and value is not None and not valid(value):
            raise ConfigError(f"finetune.init_from: {where} has rope_scaling.{key}="
                              f"{json.dumps(hf['rope_scaling'].get(key, value))}, where transformers writes "
                              f"{written}; give the checkpoint's own config.json")  # fmt: skip
    if scaling["rope_type"] == "dynamic" or (
        scaling["rope_type"] == "yarn" and not scaling.get("original_max_position_embeddings")
    ):
        scaling["max_position_embeddings"] = longest
    return scaling


def _no_positions(where: str) -> ConfigError:
    """A window of 0 on a sliding layer: transformers' mask (``masking_utils.sliding_window_overlay``, the
    keys after ``q - window``) hides every key from every query."""
    return ConfigError(f"finetune.init_from: {where} has sliding_window=0, a window under which "
                       "transformers' mask hides every key from every query; give the checkpoint's own "
                       "config.json (null: no window)")  # fmt: skip


def _sliding_window(hf: dict, kind: str, where: str, refuse) -> tuple[int | None, tuple[int, ...] | None]:
    """``(window, sliding_layers)``: Mistral's window (every layer's), or Qwen2's, Qwen3's, Gemma 2's or
    Gemma 3's with the layers it slides on where it is not every layer (transformers: Qwen's layer i slides
    from ``max_window_layers`` on with ``sliding_window`` when ``use_sliding_window``, Gemma 2's every other
    one from the first, Gemma 3's all but every ``sliding_window_pattern``-th (6), unless ``layer_types``
    says which; a null window is none, and refused for Gemma 2 and 3, whose forwards need one)."""
    if kind == "mistral":
        window = hf.get("sliding_window", 4096)
        if window == 0:
            raise _no_positions(where)
        return window, None
    if kind not in (*_QWEN_WINDOWS, *_POST_NORMS):
        return None, None
    layers = hf["num_hidden_layers"]
    if kind in _POST_NORMS:
        window = hf.get("sliding_window", 4096)
        every = hf.get("sliding_window_pattern", 6) if kind == "gemma3_text" else 2  # Each every-th is full.
        kinds = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)
        ]
    else:
        window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None
        first = hf.get("max_window_layers", 28)  # The first layer that slides.
        kinds = hf.get("layer_types") or [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(layers)
        ]
    if len(kinds) != layers:  # transformers' config raises.
        refuse(f"layer_types of {len(kinds)} layers for its {layers}")
    other = next((k for k in kinds if k not in ("sliding_attention", "full_attention")), None)
    if other is not None:  # transformers' config raises, or its mask has none of that kind.
        refuse(f"layer_types with {json.dumps(other)} (the reference model's: sliding_attention, "
               "full_attention)")  # fmt: skip
    sliding = tuple(i for i, k in enumerate(kinds) if k == "sliding_attention")
    if kind in _POST_NORMS and window is None:  # Its forward builds the sliding mask whatever the layers.
        name = {"gemma2": "Gemma 2", "gemma3_text": "Gemma 3"}[kind]
        refuse(f"sliding_window null, with which transformers' {name} cannot build its sliding mask")
    if not sliding:  # Gemma 2's (3's) window kept, on no layer: its export writes it back.
        return (window, ()) if kind in _POST_NORMS else (None, None)
    if window is None:  # transformers' forward raises: its sliding layers have no window.
        refuse(f"layer_types with sliding_attention layers but no sliding window (use_sliding_window "
               f"{json.dumps(hf.get('use_sliding_window'))}, sliding_window "
               f"{json.dumps(hf.get('sliding_window'))})")  # fmt: skip
    if window == 0:
        raise _no_positions(where)
    return window, (None if len(sliding) == layers else sliding)


def disagreements(written, declared, keys, where: str) -> None:
    """Raises one ConfigError listing each of ``keys`` where the model section ``written`` (a
    :class:`~shardmem.models.llama.ModelConfig`) differs from the checkpoint's ``declared`` one."""
    lines = []
    for key in keys:
        mine, theirs = getattr(written, key), getattr(declared, key)
        if key == "head_dim":
            mine, theirs = written.head_size, declared.head_size
        if mine != theirs:
            lines.append(f"model.{key}={_show(mine)} but {where} says {_show(theirs)}")
    if lines:
        raise ConfigError(f"{'; '.join(lines)}: the checkpoint's architecture is what loads; remove the key "
                          f"from the model section (it is taken from there) or fix it")  # fmt: skip


def _show(value) -> str:
    if dataclasses.is_dataclass(value):
        fields = {k: v for k, v in dataclasses.asdict(value).items() if v is not None and k != "truncate"}
        return "{" + ", ".join(f"{k}: {v}" for k, v in fields.items()) + "}"
    return "null" if value is None else str(value)


def to_hf(model, base: dict | None, dtype: str) -> dict | None:
    """Returns the ``config.json`` of the model (a :class:`~shardmem.models.llama.ModelConfig`) saved in
    ``dtype``: the base checkpoint's (``base``) with the dtype updated, or one written for the
    transformers model type it is; None when it is none of :data:`MODEL_TYPES`."""
    kind = base.get("model_type") if base else _model_type(model)
    if kind not in MODEL_TYPES:
        return None
    out = dict(base) if base else {"architectures": [MODEL_TYPES[kind]], "model_type": kind}
    scaling = None
    if model.rope_scaling is not None:
        scaling = {k: v for k, v in dataclasses.asdict(model.rope_scaling).items()
                   if v is not None and k != "max_position_embeddings"
                   and (k != "truncate" or not v)}  # fmt: skip
    longest = (model.rope_scaling and model.rope_scaling.max_position_embeddings) or model.seq_len
    out.update(vocab_size=model.vocab_size, hidden_size=model.d_model, num_hidden_layers=model.n_layers,
               num_attention_heads=model.n_heads, num_key_value_heads=model.n_kv_heads,
               intermediate_size=model.d_ff, head_dim=model.head_size, rope_theta=model.rope_theta,
               rope_scaling=scaling, rms_norm_eps=model.norm_eps, tie_word_embeddings=model.tie_embeddings,
               torch_dtype=dtype)  # fmt: skip
    # A base that leaves it out means transformers' default for its type, as it was read.
    out.setdefault("max_position_embeddings", _DEFAULTS[kind]["max_position_embeddings"] if base else longest)
    if "dtype" in out:  # transformers 4.56 and later write this name.
        out["dtype"] = dtype
    if kind == "mistral":
        out["sliding_window"] = model.sliding_window
    elif kind in _QWEN_WINDOWS:
        out.update(use_sliding_window=model.sliding_window is not None, max_window_layers=0,
                   sliding_window=model.sliding_window, layer_types=_layer_types(model))  # fmt: skip
    elif kind in _POST_NORMS:
        scalar = model.head_size if model.attention_scale is None else round(model.attention_scale**-2, 6)
        out.update(sliding_window=model.sliding_window, layer_types=_layer_types(model),
                   query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                   attn_logit_softcapping=model.attention_softcap,
                   final_logit_softcapping=model.logit_softcap)  # fmt: skip
        if kind == "gemma3_text":  # Its sliding layers' base (transformers' default: 10,000).
            out["rope_local_base_freq"] = model.local_rope_theta or model.rope_theta
    # The model's own activation (a Llama of gelu_pytorch_tanh, a Gemma of silu), not the type's usual one.
    activation = _HF_ACTIVATIONS[model.mlp_activation]
    if kind in _GEMMAS:
        out.update(hidden_act=activation, hidden_activation=activation)
    else:
        out["hidden_act"] = activation
    return out


def _layer_types(model) -> list[str] | None:
    """``layer_types``: which layers slide (``model.sliding_layers``, or every one); None without a window."""
    if model.sliding_window is None:
        return None
    sliding = set(range(model.n_layers) if model.sliding_layers is None else model.sliding_layers)
    return ["sliding_attention" if i in sliding else "full_attention" for i in range(model.n_layers)]


def _model_type(model) -> str | None:
    """The transformers model type whose forward is the reference model's with these options."""
    if model.n_experts or model.mlp_activation not in _HF_ACTIVATIONS:
        return None
    gemma2 = (model.post_norms, model.attention_scale, model.attention_softcap, model.logit_softcap)
    if (model.norm_offset, model.scale_embeddings) == (1.0, True):
        if model.qkv_bias:
            return None
        if model.qk_norm:  # Gemma 3's, whose attention takes no cap, and whose forward needs a window;
            gemma3 = model.post_norms and model.sliding_window is not None and model.attention_softcap is None
            # its sliding layers rotate unscaled: a model that scales them with the rest is not one.
            local = model.local_rope_theta is not None or model.rope_scaling is None
            return "gemma3_text" if gemma3 and local else None
        if model.rope_scaling is not None or model.local_rope_theta is not None:
            return None
        if model.post_norms:
            return "gemma2" if model.sliding_window is not None else None
        return "gemma" if model.sliding_window is None and not any(gemma2) else None
    if (model.norm_offset, model.scale_embeddings) != (0.0, False) or any(gemma2):
        return None
    if model.local_rope_theta is not None:
        return None
    if model.sliding_layers is not None and not model.qkv_bias and not model.qk_norm:
        return None  # Mistral slides every layer.
    if model.qkv_bias:  # Qwen2's; no transformers type has both.
        return None if model.qk_norm else "qwen2"
    if model.qk_norm:
        return "qwen3"
    return "mistral" if model.sliding_window is not None else "llama"
