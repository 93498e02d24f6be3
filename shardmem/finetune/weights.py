"""Pretrained weights in: Hugging Face safetensors checkpoints (or a shardmem run's Orbax checkpoint),
checked against the model from their headers, then read straight into their shards.

    check_init_from(program)                                # names, dtypes, shapes: before any compile
    params = load_safetensors("Llama-3.2-1B/", program)   # the model's parameters, sharded as planned
    state = program.start_from(params)                      # split, quantized, adapters, optimizer

The reference model reads the Llama layout that Llama, Mistral, Gemma (with the model's ``norm_offset``,
``scale_embeddings`` and ``mlp_activation`` set as Gemma's; Gemma 2 with ``post_norms`` too), Qwen2
(``qkv_bias``) and Qwen3 (``qk_norm``) checkpoints share (``model.layers.{i}.self_attn.q_proj.weight`` ...):
each matrix is stored ``[out, in]`` and transposed into the model's ``[in..., out...]``. A model of your own
reads tensors named by its own parameter paths with ``.`` for ``/`` (what
:func:`~shardmem.finetune.export.export_safetensors` writes for it), in its own layout. For the reference
model, files whose metadata says ``format: flax`` (transformers' Flax ``save_pretrained``) are read in that
layout: ``kernel`` matrices ``[in, out]`` and ``model.embed_tokens.embedding``. Which files hold which tensors
(an index, a stray consolidated file) is :mod:`shardmem.finetune.safetensors_files`'s; the architecture in a
folder's ``config.json``, :mod:`shardmem.finetune.hf_config`'s.

Every array is made by :func:`jax.make_array_from_callback`: each device's callback reads only its own
block of each layer's tensor through safetensors' lazy ``safe_open`` slices, so neither the model nor one
whole tensor is ever in host memory or on one device at once (:func:`host_bytes` is the most a load holds).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import jax
import numpy as np

from shardmem.errors import ConfigError, did_you_mean
from shardmem.finetune.lora import weight
from shardmem.finetune.safetensors_files import FLOAT_DTYPES, INDEX, SafetensorsCheckpoint, safetensors_files
from shardmem.finetune.spec import _flat, _name, _put

# Reference parameter (after the layers axis) -> Hugging Face name, and whether it is an [out, in] matrix.
_LAYER_NAMES = {
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", "flat"),  # Qwen2's [heads x head_dim] biases, stored flat.
    "bk": ("self_attn.k_proj.bias", "flat"),
    "bv": ("self_attn.v_proj.bias", "flat"),
    "q_norm/scale": ("self_attn.q_norm.weight", False),  # Qwen3's, over a head's width.
    "k_norm/scale": ("self_attn.k_norm.weight", False),
    "attn_norm/scale": ("input_layernorm.weight", False),
    "mlp_norm/scale": ("post_attention_layernorm.weight", False),
}
# Gemma 2's four norms a layer (model.post_norms): its post_attention_layernorm norms attention's output.
_POST_NORM_NAMES = {
    "mlp_norm/scale": ("pre_feedforward_layernorm.weight", False),
    "post_attn_norm/scale": ("post_attention_layernorm.weight", False),
    "post_mlp_norm/scale": ("post_feedforward_layernorm.weight", False),
}
_TOP_NAMES = {
    "embedding": ("model.embed_tokens.weight", False),
    "final_norm/scale": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")  # Buffers some exports keep; the model computes them.
#: Where a multimodal checkpoint keeps its text model in place of ``model.`` (Gemma 3 4B and larger: the
#: Hub's files and transformers 4.x's saves; the module names of transformers' model since 4.52, as other
#: tools may save them), and its other towers, which the text model skips.
_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
_OTHER_TOWERS = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")


def _text_prefix(tensors) -> str:
    """What the checkpoint's text model's tensor names start with: ``model.``, or a multimodal one's."""
    return next((p for p in _TEXT_PREFIXES if f"{p}embed_tokens.weight" in tensors), "model.")


class _Tensor:
    """Where one of the model's parameters comes from: a file tensor per layer (``layers`` of them, or
    one), and whether it is a Hugging Face ``[out, in]`` matrix of the parameter's ``in_dims`` inputs
    (or, with ``kernel``, the ``[in, out]`` one of a checkpoint in transformers' Flax layout)."""

    def __init__(self, names: list[str], matrix: bool | str, in_dims: int = 1, stacked: bool = False,
                 kernel: bool = False):  # fmt: skip
        self.flat = matrix == "flat"  # A vector in the file, an array of the same entries in the model.
        self.kernel = kernel and matrix is True
        self.matrix = matrix is True and not kernel
        self.names, self.in_dims, self.stacked = names, in_dims, stacked


def _flax_name(name: str, matrix: bool | str) -> str:
    """The name transformers' Flax models give a PyTorch-layout tensor (``kernel``, ``embedding``)."""
    if matrix is True:
        return name.removesuffix(".weight") + ".kernel"
    return "model.embed_tokens.embedding" if name == "model.embed_tokens.weight" else name


def _layout(program, full_shapes: dict, flax: bool = False, prefix: str = "model.") -> dict:
    """Path -> :class:`_Tensor` for the program's model; ``flax``: names and ``[in, out]`` matrices as
    transformers' Flax models save them (``safetensors`` metadata ``format: flax``); ``prefix``: where the
    text model's tensors are (:func:`_text_prefix`)."""
    layout = {}

    def rename(name: str, matrix: bool | str) -> str:
        if flax:
            return _flax_name(name, matrix)
        if name == "lm_head.weight" and prefix == "language_model.model.":
            return "language_model.lm_head.weight"
        return prefix + name.removeprefix("model.") if name.startswith("model.") else name

    names = program.config.finetune.init_names
    if names and not program.custom_model:
        raise ConfigError(f"finetune.init_names={names!r}: it renames a model of your own's parameters; the "
                          "reference model reads Hugging Face Llama names (model.layers.0.self_attn.q_proj."
                          "weight, ...): leave finetune.init_names out")  # fmt: skip
    if program.custom_model:
        paths = sorted(_name(path) for path in full_shapes)
        unknown = next((key for key in names if key not in paths), None)
        if unknown is not None:  # Its tensor would be looked for under the path's own name instead.
            more = ", ..." if len(paths) > 6 else ""
            raise ConfigError(f"finetune.init_names: {unknown!r} is not a parameter path of the model"
                              f"{did_you_mean(unknown, paths)}; its paths are /-joined, as plan --sharding "
                              f"lists them: {', '.join(paths[:6])}{more}")  # fmt: skip
        for path in full_shapes:
            layout[path] = _Tensor([names.get(_name(path), _name(path).replace("/", "."))], False)
        return layout
    from shardmem.models.llama import lora_input_dims

    n_layers = program.config.model.n_layers
    layer_names = _LAYER_NAMES | (_POST_NORM_NAMES if program.config.model.post_norms else {})
    for path in full_shapes:
        name = _name(path)
        if name.startswith("layers/"):
            hf, matrix = layer_names.get(name.removeprefix("layers/"), (None, False))
            if hf is None:
                raise ConfigError(
                    f"finetune.init_from: the reference model's {name} has no Hugging Face Llama tensor: "
                    "a mixture of experts cannot load safetensors yet"
                )
            names = [rename(f"model.layers.{i}.{hf}", matrix) for i in range(n_layers)]
            layout[path] = _Tensor(names, matrix, lora_input_dims(name), stacked=True, kernel=flax)
        else:
            hf, matrix = _TOP_NAMES[name]
            layout[path] = _Tensor([rename(hf, matrix)], matrix, 1, kernel=flax)
    return layout


def _expected(shape, tensor: _Tensor) -> list[int]:
    layer = shape[1:] if tensor.stacked else shape
    if tensor.flat:
        return [math.prod(layer)]
    ins_outs = [math.prod(layer[: tensor.in_dims]), math.prod(layer[tensor.in_dims :])]
    if tensor.kernel:
        return ins_outs
    return ins_outs[::-1] if tensor.matrix else list(layer)


def check_init_from(program, *, planning: bool = False) -> list[str]:
    """Checks ``finetune.init_from`` against the program's model before anything is compiled or read:
    each tensor's name, dtype and shape from the safetensors headers (a shardmem run: its checkpoint's
    metadata), and, unless ``planning``, that an ``lm_head`` beside tied embeddings is a copy of the
    embedding (the one check that reads data). A path that is not there is an error, or with
    ``planning`` a warning (a plan may come before the download), as is a Hugging Face folder that holds
    its ``config.json`` and no weights yet; returns the plan's warnings."""
    given = program.config.finetune.init_from
    if given is None:
        return []
    path = _resolved(given)
    if not path.exists():
        if planning:
            return [f"finetune.init_from={given!r} is not there yet, so the plan could not check it against "
                    "the model (train checks it before compiling)"]  # fmt: skip
        raise ConfigError(missing_init_from(given))
    if _is_orbax_run(path):
        _check_orbax(path, given, program)
        return []
    if planning and _config_only(path):
        return [f"finetune.init_from={given!r} has its config.json but no weights yet: the plan is of the "
                "architecture it declares, unchecked against the weights (train checks them before "
                "compiling)"]  # fmt: skip
    abstract = _as_stored(program)
    full_shapes = {p: leaf.shape for p, leaf in _flat(abstract).items()}
    checkpoint = SafetensorsCheckpoint.open(path, given)
    layout = _layout(
        program,
        full_shapes,
        flax=not program.custom_model and checkpoint.flax,
        prefix=_text_prefix(checkpoint.tensors),
    )
    _check(layout, full_shapes, checkpoint, values=not planning)
    return []


def _config_only(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face folder downloaded as far as its ``config.json``: no safetensors
    file and no index (a folder with an index and missing files is a download cut short: an error)."""
    return (path.is_dir() and (path / "config.json").is_file() and not safetensors_files(path)
            and not (path / INDEX).is_file())  # fmt: skip


def _resolved(path: str | Path) -> Path:
    """``finetune.init_from`` as an absolute path (a relative one is from the working directory)."""
    return Path(path).expanduser().absolute()


def same_init_from(given, other) -> bool:
    """Whether two ``finetune.init_from`` values name the same weights: equal, or paths to one place (a
    relative and an absolute path, a trailing slash)."""
    if given == other or given is None or other is None:
        return given == other
    return _resolved(given).resolve() == _resolved(other).resolve()


def missing_init_from(given) -> str:
    """The message for a ``finetune.init_from`` that is not there (where a relative one is read from)."""
    relative = "" if Path(given).expanduser().is_absolute() else f" (a relative path is from {Path.cwd()})"
    return (f"finetune.init_from={str(given)!r}: no such file or folder{relative}; give a Hugging Face "
            "model's folder, a safetensors file or a shardmem run's folder")  # fmt: skip


def _check(layout: dict, full_shapes: dict, checkpoint: SafetensorsCheckpoint, *, values: bool) -> None:
    """Raises ConfigError naming the first tensor that is missing, not a float, misshapen or extra."""
    where, tensors = checkpoint.where, checkpoint.tensors
    for path, tensor in layout.items():
        for name in tensor.names:
            if name not in tensors:
                listed = f" ({checkpoint.index.name} lists none)" if checkpoint.index else ""
                raise ConfigError(f"finetune.init_from={where!r} has no tensor {name}{listed} (for the "
                                  "model's "
                                  f"{_name(path)}){did_you_mean(name, tensors)}")  # fmt: skip
    for path, tensor in layout.items():
        want = _expected(full_shapes[path], tensor)
        for name in tensor.names:
            header = tensors[name]
            if header.dtype not in FLOAT_DTYPES:
                raise ConfigError(
                    f"finetune.init_from={where!r}: {name} is stored as {header.dtype}, which no weight is; "
                    "shardmem loads float32, float16, bfloat16 or float64 tensors (a quantized checkpoint's "
                    "codes need its own dequantization: start from the unquantized checkpoint)"
                )
            if list(header.shape) != want:
                raise ConfigError(f"finetune.init_from={where!r}: {name} has shape {list(header.shape)}, but "
                                  f"the model's {_name(path)} needs {want}; does the model section match the "
                                  "checkpoint?")  # fmt: skip
    wanted = {name for t in layout.values() for name in t.names}
    towers = _text_prefix(tensors) != "model."  # A multimodal checkpoint's: not the text model's.
    extra = sorted(n for n in tensors if n not in wanted and not _IGNORED.search(n)
                   and not (towers and _OTHER_TOWERS.match(n)))  # fmt: skip
    heads = [n for n in extra if n in ("lm_head.weight", "lm_head.kernel", "language_model.lm_head.weight")]
    others = [n for n in extra if n not in heads]
    if others:
        raise ConfigError(f"finetune.init_from={where!r} has tensors the model has no place for, such as "
                          f"{', '.join(others[:3])} (in {tensors[others[0]].file.name}); check the model "
                          "section (a Qwen2 or Gemma layout is not the Llama one)")  # fmt: skip
    embedding = layout.get(("embedding",))
    if heads and values and embedding is not None and not _is_copy(checkpoint, heads[0], embedding.names[0]):
        raise ConfigError(
            f"finetune.init_from={where!r} has {heads[0]}, an output head of its own (not a copy of "
            f"{embedding.names[0]}), but model.tie_embeddings is true, which would drop it and give other "
            "logits; set model.tie_embeddings: false"
        )


def _is_copy(checkpoint: SafetensorsCheckpoint, head: str, embedding: str) -> bool:
    """Whether the head tensor holds the embedding's values (``[V, D]``, or Flax's ``[D, V]`` kernel),
    compared a block of rows at a time."""
    from safetensors import safe_open

    h, e = checkpoint.tensors[head], checkpoint.tensors[embedding]
    kernel = head.endswith(".kernel")
    if (h.shape[::-1] if kernel else h.shape) != e.shape:
        return False
    rows = max(1, (64 << 20) // max(1, math.prod(e.shape[1:]) * 4))
    with safe_open(str(h.file), "numpy") as fh, safe_open(str(e.file), "numpy") as fe:
        for start in range(0, e.shape[0], rows):
            block = slice(start, min(start + rows, e.shape[0]))  # safetensors slices do not clip.
            head_rows = fh.get_slice(head)[:, block].T if kernel else fh.get_slice(head)[block]
            if not np.array_equal(head_rows, fe.get_slice(embedding)[block]):
                return False
    return True


def _block(sl, tensor: _Tensor, layer_shape, index) -> np.ndarray:
    """One layer's block ``index`` (slices in the model's layout) read from file slice ``sl``."""
    index = tuple(slice(*s.indices(n)) for s, n in zip(index, layer_shape, strict=True))
    if tensor.flat:
        first, rest = index[0], math.prod(layer_shape[1:])
        block = sl[first.start * rest : first.stop * rest].reshape(first.stop - first.start, *layer_shape[1:])
        return block[(slice(None), *index[1:])]
    if not (tensor.matrix or tensor.kernel):
        return sl[index] if index else sl[:]
    ins, outs = layer_shape[: tensor.in_dims], layer_shape[tensor.in_dims :]
    idx_in, idx_out = index[: tensor.in_dims], index[tensor.in_dims :]
    rest_in, rest_out = math.prod(ins[1:]), math.prod(outs[1:])
    o, i = idx_out[0], idx_in[0]
    if tensor.kernel:  # [in, out] already: only the flattened dimensions to unfold.
        block = sl[i.start * rest_in : i.stop * rest_in, o.start * rest_out : o.stop * rest_out]
        block = block.reshape(i.stop - i.start, *ins[1:], o.stop - o.start, *outs[1:])
        return block[(slice(None), *idx_in[1:], slice(None), *idx_out[1:])]
    block = sl[o.start * rest_out : o.stop * rest_out, i.start * rest_in : i.stop * rest_in]
    block = block.reshape(o.stop - o.start, *outs[1:], i.stop - i.start, *ins[1:])
    block = block[(slice(None), *idx_out[1:], slice(None), *idx_in[1:])]
    n_out = len(outs)
    return block.transpose(*range(n_out, block.ndim), *range(n_out))


def load_weights(path: str | Path, program) -> dict:
    """Returns the model's full parameters from ``path``: safetensors (:func:`load_safetensors`), or
    the parameters of a shardmem run's Orbax checkpoint (:func:`load_orbax`); a relative path is from
    the working directory."""
    where = _resolved(path)
    if not where.exists():
        raise ConfigError(missing_init_from(path))
    if _is_orbax_run(where):
        return load_orbax(where, program)
    return load_safetensors(where, program)


def _is_orbax_run(where: Path) -> bool:
    return where.is_dir() and not safetensors_files(where) and _orbax_item(where) is not None


def _orbax_item(where: Path) -> Path | None:
    """The Orbax item folder in a run folder, its checkpoints folder, one step's folder or the item."""
    if (where / "checkpoints").is_dir():
        where = where / "checkpoints"
    steps = sorted((p for p in where.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    if steps:
        where = steps[-1]
    if (where / "default").is_dir():
        where = where / "default"
    return where if (where / "_METADATA").exists() or (where / "manifest.ocdbt").exists() else None


def _orbax_tree(item: Path) -> dict:
    """The saved state's tree of array metadata (shapes and dtypes), read without its data."""
    import orbax.checkpoint as ocp

    # The handler reads the item's own metadata; a PyTreeCheckpointer would also look for the step's
    # _CHECKPOINT_METADATA in the item folder (it is one level up) and warn that it does not exist.
    handler = ocp.PyTreeCheckpointHandler()
    try:
        metadata = handler.metadata(item)
    except (OSError, ValueError) as e:  # A deleted or garbled _METADATA (JSONDecodeError is a ValueError).
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise ConfigError(f"finetune.init_from: the checkpoint in {str(item)!r} does not read ({first}); "
                          "name an older step's folder of the run, or another run") from None  # fmt: skip
    finally:
        handler.close()
    return getattr(metadata, "tree", metadata)


def _check_orbax(path: Path, given, program) -> None:
    """The header check of a shardmem run: a fine-tuning run needs its config.yaml (its adapters' scale,
    its base's quantization); a plain run's parameters must have the model's shapes."""
    item = _orbax_item(path)
    tree = _orbax_tree(item)
    if "frozen" in tree:
        _run_config(path, given)
        return
    saved = {p: tuple(leaf.shape) for p, leaf in _flat(tree.get("params", {})).items()}
    for p, leaf in _flat(program.model_params).items():
        if saved.get(p, tuple(leaf.shape)) != tuple(leaf.shape):
            raise ConfigError(f"finetune.init_from={str(given)!r}: the run's {_name(p)} has shape "
                              f"{list(saved[p])}, but the model's needs {list(leaf.shape)}; does the model "
                              "section match the run that saved it?")  # fmt: skip


def _run_config(path: Path, given):
    """The config a fine-tuning run was trained with (its config.yaml), which says how to merge it."""
    from shardmem.config import load_config
    from shardmem.finetune.hf_config import run_folder

    run = run_folder(path)
    if run is None:
        raise ConfigError(f"finetune.init_from={str(given)!r} is a fine-tuning run's checkpoint (adapters "
                          "and a frozen base), but not inside its run folder, whose config.yaml says how to "
                          "merge them (the LoRA scale, the quantization); name the run's folder")  # fmt: skip
    return load_config(run / "config.yaml")


def load_orbax(path: str | Path, program) -> dict:
    """Returns the model's full parameters from a shardmem run's Orbax checkpoint (the newest step of a
    run or checkpoints folder, or one step's), restoring ``state["params"]`` alone, each array into its
    shards in the dtype the program keeps it in (frozen ones in ``finetune.base_dtype``). A fine-tuning
    run's parameters are its merged model: adapters added to their dequantized base, with the settings
    of the run's own config.yaml."""
    import orbax.checkpoint as ocp

    path = _resolved(path)
    item = _orbax_item(path)
    if item is None:
        raise ConfigError(f"finetune.init_from={str(path)!r}: no safetensors file and no Orbax checkpoint "
                          "there; give a safetensors file or folder, or a shardmem run's folder")  # fmt: skip
    if "frozen" in _orbax_tree(item):
        return _merged_run(path, item, program)
    target = {"params": _as_stored(program)}
    return _restore(ocp, item, target, path)["params"]


def _restore(ocp, item: Path, target: dict, path: Path) -> dict:
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    args = ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
    try:
        with ocp.PyTreeCheckpointer() as checkpointer:
            return checkpointer.restore(item, args=args)
    except (ValueError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = first.split(". Truncating")[0][:300]  # Orbax's advice to pad or truncate does not apply.
        raise ConfigError(
            f"finetune.init_from={str(path)!r}: the checkpoint's parameters do not restore into "
            f"the model's ({first}); does the model section match the run that saved it?"
        ) from None


def _merged_run(path: Path, item: Path, program) -> dict:
    """A fine-tuning run's model: its trainable and frozen parameters restored as that run laid them
    out (its own finetune section, on this program's mesh), then each weight merged and cast into this
    program's parameters and shardings."""
    import dataclasses

    import orbax.checkpoint as ocp

    from shardmem.program import build_program

    saved = _run_config(path, path)
    config = dataclasses.replace(program.config, finetune=dataclasses.replace(saved.finetune, init_from=None))
    run = build_program(config, program.mesh)
    state = run.abstract_state
    restored = _restore(ocp, item, {"params": state["params"], "frozen": state["frozen"]}, path)
    stored = _as_stored(program)

    def merge(trainable, frozen):
        full = run.finetune.assemble(trainable, frozen)
        values = _flat(full, is_leaf=lambda x: not isinstance(x, dict))
        merged: dict = {}
        for p, leaf in _flat(stored).items():
            _put(merged, p, weight(values[p], leaf.dtype))
        return merged

    shardings = jax.tree.map(lambda leaf: leaf.sharding, stored)
    return jax.jit(merge, out_shardings=shardings)(restored["params"], restored["frozen"])


def _as_stored(program) -> dict:
    """The model's abstract parameters, frozen ones in ``finetune.base_dtype`` (no float32 copy)."""
    finetune, stored = program.finetune, {}
    for p, leaf in _flat(program.model_params).items():
        if finetune is not None and p in finetune.frozen:
            leaf = jax.ShapeDtypeStruct(leaf.shape, finetune.base_dtype, sharding=leaf.sharding)
        _put(stored, p, leaf)
    return stored


def load_safetensors(path: str | Path, program) -> dict:
    """Returns the model's full parameters (``program.model_params``' tree, dtypes and shardings) read
    from a safetensors file or folder; a missing, extra, misshapen or non-float tensor is a ConfigError
    naming it."""
    from safetensors import safe_open

    abstract = _as_stored(program)
    full_shapes = {p: leaf.shape for p, leaf in _flat(abstract).items()}
    checkpoint = SafetensorsCheckpoint.open(path)
    layout = _layout(
        program,
        full_shapes,
        flax=not program.custom_model and checkpoint.flax,
        prefix=_text_prefix(checkpoint.tensors),
    )
    _check(layout, full_shapes, checkpoint, values=True)
    params: dict = {}
    for p, leaf in _flat(abstract).items():
        tensor = layout[p]

        def read(idx, leaf=leaf, tensor=tensor):
            idx = tuple(idx) + (slice(None),) * (len(leaf.shape) - len(idx))
            layers = range(*idx[0].indices(leaf.shape[0])) if tensor.stacked else [None]
            blocks = []
            for layer in layers:
                name = tensor.names[layer or 0]
                with safe_open(str(checkpoint.tensors[name].file), "numpy") as f:
                    sl = f.get_slice(name)
                    inner = idx[1:] if tensor.stacked else idx
                    blocks.append(_block(sl, tensor, leaf.shape[1:] if tensor.stacked else leaf.shape, inner))
            out = np.stack(blocks) if tensor.stacked else blocks[0]
            return np.asarray(out).astype(leaf.dtype)

        _put(params, p, jax.make_array_from_callback(leaf.shape, leaf.sharding, read))
    return params


def file_entry_bytes(path: str | Path) -> int:
    """Returns the widest entry size among a checkpoint's tensors (4 when it cannot be read yet)."""
    try:
        return SafetensorsCheckpoint.open(_resolved(path)).entry_bytes()
    except (ConfigError, OSError):
        return 4


def host_bytes(program, file_dtype_bytes: int = 4) -> int:
    """Returns the most host memory a load holds at once: one device's block of one parameter (all
    its layers), as read (``file_dtype_bytes`` an entry) and converted to the parameter's dtype."""
    return max(math.prod(leaf.sharding.shard_shape(leaf.shape)) * (file_dtype_bytes + leaf.dtype.itemsize)
               for leaf in jax.tree.leaves(program.model_params))  # fmt: skip
