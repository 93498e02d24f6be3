"""Pretrained weights in and out: Hugging Face safetensors checkpoints (or a shardmem run's Orbax
checkpoint), read straight into their shards.

    params = load_safetensors("Llama-3.2-1B/", program)   # the model's parameters, sharded as planned
    state = program.start_from(params)                      # split, quantized, adapters, optimizer
    export_safetensors(program, state, "out/")              # LoRA merged, Hugging Face names
    export_safetensors(program, state, "out/", adapters_only=True)   # PEFT's adapter_model.safetensors

The reference model reads the Llama layout that Llama, Mistral, Gemma (with the model's
``norm_offset``, ``scale_embeddings`` and ``mlp_activation`` set as Gemma's) and Qwen2 (``qkv_bias``)
checkpoints share (``model.layers.{i}.self_attn.q_proj.weight`` ...): each matrix is stored ``[out, in]``
and transposed into the model's ``[in..., out...]``. A model of your own reads tensors named by its own
parameter paths with ``.`` for ``/`` (what :func:`export_safetensors` writes for it), in its own layout.
For the reference model, files whose metadata says ``format: flax`` (transformers' Flax
``save_pretrained``) are read in that layout: ``kernel`` matrices ``[in, out]`` and
``model.embed_tokens.embedding``.

Every array is made by :func:`jax.make_array_from_callback`: each device's callback reads only its own
block of each layer's tensor through safetensors' lazy ``safe_open`` slices, so neither the model nor one
whole tensor is ever in host memory or on one device at once (:func:`host_bytes` is the most a load holds).
Export goes one tensor (one layer of a stacked one) at a time into a file written as it goes.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from shardmem.errors import ConfigError, did_you_mean
from shardmem.finetune.lora import weight
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
    "attn_norm/scale": ("input_layernorm.weight", False),
    "mlp_norm/scale": ("post_attention_layernorm.weight", False),
}
_TOP_NAMES = {
    "embedding": ("model.embed_tokens.weight", False),
    "final_norm/scale": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")  # Buffers some exports keep; the model computes them.
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16, "F64": np.float64}


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


def _layout(program, full_shapes: dict, flax: bool = False) -> dict:
    """Path -> :class:`_Tensor` for the program's model; ``flax``: names and ``[in, out]`` matrices as
    transformers' Flax models save them (``safetensors`` metadata ``format: flax``)."""
    layout = {}
    rename = _flax_name if flax else (lambda name, matrix: name)
    if program.custom_model:
        names = program.config.finetune.init_names
        for path in full_shapes:
            layout[path] = _Tensor([names.get(_name(path), _name(path).replace("/", "."))], False)
        return layout
    from shardmem.models.llama import lora_input_dims

    n_layers = program.config.model.n_layers
    for path in full_shapes:
        name = _name(path)
        if name.startswith("layers/"):
            hf, matrix = _LAYER_NAMES.get(name.removeprefix("layers/"), (None, False))
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


def _files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from a file or a folder of them."""
    from safetensors import safe_open

    where = Path(path)
    files = sorted(where.glob("*.safetensors")) if where.is_dir() else [where]
    if not files or not files[0].exists():
        raise ConfigError(f"finetune.init_from={str(path)!r}: no .safetensors file there; give a file or a "
                          "folder of them (a Hugging Face model's folder)")  # fmt: skip
    index = {}
    for file in files:
        with safe_open(str(file), "numpy") as f:
            index.update((name, file) for name in f.keys())
    return index


def _is_flax(index: dict) -> bool:
    """Whether the files say they hold a Flax model's tensors (transformers' Flax ``save_pretrained``)."""
    from safetensors import safe_open

    formats = set()
    for file in set(index.values()):
        with safe_open(str(file), "numpy") as f:
            formats.add((f.metadata() or {}).get("format"))
    return formats == {"flax"}


def _expected(shape, tensor: _Tensor) -> list[int]:
    layer = shape[1:] if tensor.stacked else shape
    if tensor.flat:
        return [math.prod(layer)]
    ins_outs = [math.prod(layer[: tensor.in_dims]), math.prod(layer[tensor.in_dims :])]
    if tensor.kernel:
        return ins_outs
    return ins_outs[::-1] if tensor.matrix else list(layer)


def _check(layout: dict, full_shapes: dict, index: dict, where: str) -> None:
    wanted = {name for t in layout.values() for name in t.names}
    for path, tensor in layout.items():
        for name in tensor.names:
            if name not in index:
                raise ConfigError(f"finetune.init_from={where!r} has no tensor {name} (for the model's "
                                  f"{_name(path)}){did_you_mean(name, index)}")  # fmt: skip
    from safetensors import safe_open

    for path, tensor in layout.items():
        want = _expected(full_shapes[path], tensor)
        for name in tensor.names:
            with safe_open(str(index[name]), "numpy") as f:
                got = f.get_slice(name).get_shape()
            if list(got) != want:
                raise ConfigError(f"finetune.init_from={where!r}: {name} has shape {list(got)}, but the "
                                  f"model's {_name(path)} needs {want}; does the model section match the "
                                  "checkpoint?")  # fmt: skip
    extra = sorted(n for n in index if n not in wanted and not _IGNORED.search(n))
    tied = [n for n in extra if n in ("lm_head.weight", "lm_head.kernel")]
    if extra and extra != tied:
        raise ConfigError(f"finetune.init_from={where!r} has tensors the model has no place for, such as "
                          f"{', '.join(extra[:3])}; check the model section (a Qwen2 or Gemma layout is not "
                          "the Llama one)")  # fmt: skip


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
    the parameters of a shardmem run's Orbax checkpoint (:func:`load_orbax`)."""
    where = Path(path)
    if where.is_dir() and not list(where.glob("*.safetensors")) and _orbax_item(where) is not None:
        return load_orbax(path, program)
    return load_safetensors(path, program)


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


def load_orbax(path: str | Path, program) -> dict:
    """Returns the model's full parameters from a shardmem run's Orbax checkpoint (the newest step of a
    run or checkpoints folder, or one step's), restoring ``state["params"]`` alone, each array into its
    shards in the dtype the program keeps it in (frozen ones in ``finetune.base_dtype``)."""
    import orbax.checkpoint as ocp

    item = _orbax_item(Path(path))
    if item is None:
        raise ConfigError(f"finetune.init_from={str(path)!r}: no safetensors file and no Orbax checkpoint "
                          "there; give a safetensors file or folder, or a shardmem run's folder")  # fmt: skip
    target = {"params": _as_stored(program)}
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    args = ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
    try:
        with ocp.PyTreeCheckpointer() as checkpointer:
            return checkpointer.restore(item, args=args)["params"]
    except (ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = first.split(". Truncating")[0][:300]  # Orbax's advice to pad or truncate does not apply.
        raise ConfigError(
            f"finetune.init_from={str(path)!r}: the checkpoint's parameters do not restore into "
            f"the model's ({first}); does the model section match the run that saved it?"
        ) from None


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
    from a safetensors file or folder; a missing, extra or misshapen tensor is a ConfigError naming it."""
    from safetensors import safe_open

    abstract = _as_stored(program)
    full_shapes = {p: leaf.shape for p, leaf in _flat(abstract).items()}
    index = _files(path)
    layout = _layout(program, full_shapes, flax=not program.custom_model and _is_flax(index))
    _check(layout, full_shapes, index, str(path))
    params: dict = {}
    for p, leaf in _flat(abstract).items():
        tensor = layout[p]

        def read(idx, leaf=leaf, tensor=tensor):
            idx = tuple(idx) + (slice(None),) * (len(leaf.shape) - len(idx))
            layers = range(*idx[0].indices(leaf.shape[0])) if tensor.stacked else [None]
            blocks = []
            for layer in layers:
                name = tensor.names[layer or 0]
                with safe_open(str(index[name]), "numpy") as f:
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
        from safetensors import safe_open

        widest = 0
        for file in sorted(set(_files(path).values())):
            with safe_open(str(file), "numpy") as f:
                for name in f.keys():
                    widest = max(
                        widest, np.dtype(_DTYPES.get(f.get_slice(name).get_dtype(), np.float32)).itemsize
                    )
        return widest or 4
    except (ConfigError, OSError):
        return 4


def host_bytes(program, file_dtype_bytes: int = 4) -> int:
    """Returns the most host memory a load holds at once: one device's block of one parameter (all
    its layers), as read (``file_dtype_bytes`` an entry) and converted to the parameter's dtype."""
    return max(math.prod(leaf.sharding.shard_shape(leaf.shape)) * (file_dtype_bytes + leaf.dtype.itemsize)
               for leaf in jax.tree.leaves(program.model_params))  # fmt: skip


def _layer(value, layer):
    """One layer of a stacked value (an array, Quantized or Adapted), or the value itself."""
    return value if layer is None else jax.tree.map(lambda x: x[layer], value)


def _hf_tensors(program, state, dtype, adapters_only: bool) -> Iterator[tuple[str, tuple, object]]:
    """(name, shape, make) of each tensor to write, ``make()`` its numpy array."""
    finetune = program.finetune
    full = program.natural_params(finetune.assemble(state["params"], state["frozen"]) if finetune
                                  else state["params"])  # fmt: skip
    layout = _layout(program, {p: None for p in _flat(program.model_params)})
    shapes = {p: leaf.shape for p, leaf in _flat(program.model_params).items()}
    values = _flat(full, is_leaf=lambda x: not isinstance(x, dict))
    for path in sorted(shapes, key=_name):
        tensor, value, shape = layout[path], values[path], shapes[path]
        layers = range(shape[0]) if tensor.stacked else [None]
        adapted = finetune is not None and path in finetune.adapted
        if adapters_only and not adapted:
            continue
        for layer in layers:
            name = tensor.names[layer or 0]
            layer_shape = shape[1:] if tensor.stacked else shape
            if adapters_only:  # PEFT's names and layout: lora_A [r, in], lora_B [out, r].
                base = "base_model.model." + name.removesuffix(".weight")
                n_in = finetune.adapted[path].input_dims
                d_in, d_out = math.prod(layer_shape[:n_in]), math.prod(layer_shape[n_in:])

                def a(v=value, n=layer, d=d_in):
                    return np.asarray(_layer(v.lora_a, n)).reshape(d, -1).T.astype(dtype)

                def b(v=value, n=layer, d=d_out):
                    return np.asarray(_layer(v.lora_b, n)).reshape(-1, d).T.astype(dtype)

                yield f"{base}.lora_A.weight", (finetune.rank, d_in), a
                yield f"{base}.lora_B.weight", (d_out, finetune.rank), b
                continue
            out_shape = tuple(_expected(shape, tensor))

            def make(v=value, n=layer, t=tensor, s=out_shape):
                w = np.asarray(weight(_layer(v, n), jnp.float32))
                if t.matrix:
                    w = w.reshape(math.prod(w.shape[: t.in_dims]), -1).T
                return np.ascontiguousarray(w.reshape(s)).astype(dtype)

            yield name, out_shape, make


def export_safetensors(program, state, folder: str | Path, *, dtype=jnp.bfloat16,
                       adapters_only: bool = False) -> Path:  # fmt: skip
    """Writes the trained weights to ``folder``: ``model.safetensors`` with LoRA merged into its matrices
    and the quantized base dequantized (Hugging Face Llama names for the reference model, its own paths
    for a model of your own), or with ``adapters_only`` PEFT's ``adapter_model.safetensors`` and
    ``adapter_config.json``. Returns the file written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    finetune = program.finetune
    if adapters_only and (finetune is None or not finetune.adapted):
        raise ConfigError("export --adapters-only: the config has no finetune.lora; there are no adapters to "
                          "write (export the whole model instead)")  # fmt: skip
    np_dtype = np.dtype(dtype)
    file = folder / ("adapter_model.safetensors" if adapters_only else "model.safetensors")
    _write(file, list(_hf_tensors(program, state, np_dtype, adapters_only)), np_dtype)
    if adapters_only:
        lora = program.config.finetune.lora
        modules = sorted({_LAYER_NAMES.get(_name(p).removeprefix("layers/"), (_name(p),))[0].split(".")[-2]
                          for p in finetune.adapted})  # fmt: skip
        config = {"peft_type": "LORA", "r": lora.rank, "lora_alpha": lora.alpha, "target_modules": modules,
                  "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}  # fmt: skip
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return file


_CODES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(jnp.bfloat16): "BF16"}


def _write(file: Path, tensors: list, dtype: np.dtype) -> None:
    """Writes a safetensors file one tensor at a time: the header's offsets come from the shapes."""
    header, offset = {}, 0
    for name, shape, _ in tensors:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name, shape, make in tensors:
            array = make()
            if tuple(array.shape) != tuple(shape):
                raise AssertionError(f"{name}: made {array.shape}, header says {shape}")
            f.write(array.tobytes())
