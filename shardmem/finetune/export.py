"""A run's weights out, as folders ``transformers`` and PEFT load as they are, written whole or not at all.

    step, files = export_run(config, "runs/my-lora", "exported/")        # the run's newest checkpoint
    export_run(config, "runs/my-lora", "exported/", step=300)             # or one step's
    export_safetensors(program, state, "exported/")                      # model.safetensors + config.json
    export_safetensors(program, state, "adapters/", adapters_only=True)  # PEFT's adapter files

The merged export is ``model.safetensors`` (LoRA merged into its matrices, a quantized base dequantized;
Hugging Face Llama names for the reference model, a model of your own's parameter paths) and the
``config.json`` that describes it: the base checkpoint's, its dtype updated, or one written for the
transformers model type the model is (:func:`~shardmem.finetune.hf_config.to_hf`), with the base's
tokenizer files beside it. ``adapters_only`` writes PEFT's ``adapter_model.safetensors`` (``lora_A``
``[r, in]``, ``lora_B`` ``[out, r]``; an embedding's ``lora_embedding_A`` ``[r, vocab]`` and
``lora_embedding_B`` ``[d_model, r]``) and ``adapter_config.json``, its base the run's ``init_from``.

Every file goes to a temporary file beside it and is renamed over its name once all are complete
(:mod:`shardmem._files`): an error, a full disk or Ctrl-C leaves the folder as it was. An existing export
is replaced only with ``force``; the run's own ``init_from`` never is. One tensor (one layer of a stacked
one) is in host memory at a time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from shardmem._files import make_folder, staged
from shardmem.errors import ConfigError
from shardmem.finetune.hf_config import ARCHITECTURE_KEYS, pretrained_model, run_folder, to_hf
from shardmem.finetune.lora import weight
from shardmem.finetune.safetensors_files import safetensors_files
from shardmem.finetune.spec import _flat, _name
from shardmem.finetune.weights import _expected, _layout, _resolved, same_init_from
from shardmem.units import format_bytes

#: The base checkpoint's files a merged export copies, so that its folder loads with a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")  # fmt: skip
_CODES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(jnp.bfloat16): "BF16"}


def export_run(config, run_dir: str | Path, out: str | Path, *, dtype=jnp.bfloat16,
               adapters_only: bool = False, force: bool = False, step: int | None = None,
               warn: Callable[[str], None] | None = None) -> tuple[int, list[Path]]:  # fmt: skip
    """Exports the checkpoint of ``step`` (default: the newest) of the run in ``run_dir`` (see
    :func:`export_safetensors`) and returns its step and the files written, the weights first.
    ``config`` must be the run's own: a model or fine-tune setting that differs from its ``config.yaml``
    (a LoRA ``alpha`` merges otherwise) is a ConfigError. A newest checkpoint that does not restore is
    moved aside as ``train`` does (:meth:`~shardmem.run.checkpoint.Checkpointer.restore_newest`) and the
    one before it exported; ``warn`` is told so in a line."""
    from shardmem.parallel.mesh import build_mesh
    from shardmem.program import build_program
    from shardmem.run.checkpoint import Checkpointer

    run_dir = Path(run_dir)
    run = run_folder(run_dir)
    if run is not None and run.resolve() != run_dir.resolve():  # Its checkpoints folder, a step's, an item.
        inside = run_dir.resolve().relative_to(run.resolve()).parts  # ("checkpoints", "9", "default")
        if len(inside) > 1 and inside[0] == "checkpoints" and inside[1].isdigit():
            raise ConfigError(f"--run-dir {str(run_dir)!r} is step {inside[1]}'s checkpoint folder of a run; "
                              f"give the run's own folder and the step (--run-dir {run} --step "
                              f"{inside[1]})")  # fmt: skip
        what = "a run's checkpoints folder" if inside == ("checkpoints",) else f"inside the run {run}"
        raise ConfigError(f"--run-dir {str(run_dir)!r} is {what}; give the run's own folder (--run-dir "
                          f"{run}): export takes its newest checkpoint, or --step N's")  # fmt: skip
    out_path, home = Path(out).expanduser().resolve(), run_dir.resolve()
    if run_dir.is_dir() and (out_path == home or out_path.is_relative_to(home / "checkpoints")):
        # finetune.init_from (and generate) would then read the run's folder as these safetensors.
        raise ConfigError(f"--out {str(out)!r} is the run's folder or holds its checkpoints: "
                          "finetune.init_from and generate would read the run as this export, not its newest "
                          f"checkpoint; export beside it, e.g. --out exported/{home.name}")  # fmt: skip
    _same_as_the_run(config, run_dir)
    program = build_program(config, build_mesh(config.mesh.axes, jax.devices()))
    saved_steps, state = [], None
    if (run_dir / "checkpoints").is_dir():
        checkpoints = Checkpointer(run_dir / "checkpoints", every=1, keep=1 << 30)
        saved_steps = checkpoints.all_steps()
        if step is None:
            step, state, moved = checkpoints.restore_newest(program.abstract_state)
            for corrupt in moved if warn is not None else ():
                instead = f"exporting step {step}" if step is not None else "no other checkpoint restores"
                warn(f"checkpoint {corrupt.step} does not restore ({corrupt.reason}); moved it to "
                     f"{corrupt.path}; {instead}")  # fmt: skip
        elif step in saved_steps:
            state = checkpoints.restore(program.abstract_state, step)
    if state is None and step is not None and saved_steps:  # --step names a step the run did not save.
        raise ConfigError(f"--step {step}: {run_dir} has no checkpoint of that step; it has steps "
                          f"{', '.join(map(str, saved_steps))}")  # fmt: skip
    if state is None:
        raise ConfigError(_no_run(run_dir, config.name))
    return step, _export(program, state, out, dtype, adapters_only, force)


def _no_run(run_dir: Path, name: str) -> str:
    """What to say of a --run-dir with no checkpoint: a folder of runs, a checkpoint of weights, or a run
    not trained yet."""
    runs = sorted(p.name for p in run_dir.glob("*") if run_folder(p) == p) if run_dir.is_dir() else []
    if runs:
        listed = ", ".join(runs[:5]) + (", ..." if runs[5:] else "")
        return (f"--run-dir {str(run_dir)!r} holds runs ({listed}), not one; give the one to export "
                f"(--run-dir {run_dir / (name if name in runs else runs[0])})")  # fmt: skip
    if run_dir.is_dir() and safetensors_files(run_dir):
        return (f"--run-dir {str(run_dir)!r} holds safetensors weights (a Hugging Face checkpoint or an "
                "export), not a shardmem run; give the folder train wrote the run to")  # fmt: skip
    return (f"--run-dir {str(run_dir)!r} has no checkpoint to export; train first (shardmem train CONFIG "
            f"--run-dir {run_dir})")  # fmt: skip


def _same_as_the_run(config, run_dir: Path) -> None:
    """Raises ConfigError listing each model or fine-tune setting ``config`` gives otherwise than the run's
    ``config.yaml`` (a run without one is taken as it is)."""
    from shardmem.config import load_config

    if not (run_dir / "config.yaml").is_file() or config.user_model:
        return
    saved = load_config(run_dir / "config.yaml")
    size = lambda model, key: model.head_size if key == "head_dim" else getattr(model, key, None)  # noqa: E731
    pairs = [(f"model.{k}", size(config.model, k), size(saved.model, k)) for k in ARCHITECTURE_KEYS]
    pairs = [p for p in pairs if p[1] != p[2]] + config.finetune.differences(saved.finetune)
    mine, theirs = config.finetune.init_from, saved.finetune.init_from
    if not same_init_from(mine, theirs):
        pairs.append(("finetune.init_from", mine, theirs))  # Its config.json, tokenizer, PEFT's base.
    differ = [f"{key}={_shown(mine)} here but {_shown(theirs)} in the run" for key, mine, theirs in pairs]
    if differ:
        raise ConfigError(f"{'; '.join(differ)} ({run_dir / 'config.yaml'}): export with the config the run "
                          "trained with (its weights are merged with its own settings, and its base's "
                          "config.json and tokenizer files go beside them)")  # fmt: skip


def _shown(value) -> str:
    """A setting as --set would write it: ``{format: nf4, group: 16}`` for a section, not its repr."""
    if dataclasses.is_dataclass(value):
        return yaml.safe_dump(dataclasses.asdict(value), default_flow_style=True, width=10_000).strip()
    return "null" if value is None else str(value)


def export_safetensors(program, state, folder: str | Path, *, dtype=jnp.bfloat16, adapters_only: bool = False,
                       force: bool = False) -> Path:  # fmt: skip
    """Writes the trained weights to ``folder`` (see the module docstring): ``model.safetensors`` and its
    ``config.json``, or with ``adapters_only`` PEFT's adapter files. Returns the weights file. Raises
    ConfigError, writing nothing, for a folder that cannot be written or holds an export (without
    ``force``) or the run's ``init_from``, for ``float16`` entries beyond its range, and for adapters
    PEFT's files cannot hold."""
    return _export(program, state, folder, dtype, adapters_only, force)[0]


def _export(program, state, folder, dtype, adapters_only: bool, force: bool) -> list[Path]:
    """Writes the export (see :func:`export_safetensors`); returns the files, the weights first."""
    np_dtype = np.dtype(dtype)
    if adapters_only:
        _check_adapters(program)
    source = pretrained_model(program.config.finetune.init_from) if not program.custom_model else None
    base = source.hf if source is not None else None
    extra: dict[str, bytes] = {}
    if adapters_only:
        name = "adapter_model.safetensors"
        extra["adapter_config.json"] = _json(_adapter_config(program, source))
    else:
        name = "model.safetensors"
        hf = None if program.custom_model else to_hf(program.config.model, base, np_dtype.name)
        if hf is not None:
            extra["config.json"] = _json(hf)
        if base is not None:
            home = Path(source.where).parent
            extra |= {f: (home / f).read_bytes() for f in TOKENIZER_FILES if (home / f).is_file()}
    out = _out_folder(folder, [name, *extra], force, program.config.finetune.init_from)
    tensors = list(_hf_tensors(program, state, np_dtype, adapters_only))
    header = _header(tensors, np_dtype)
    needed = len(header) + sum(math.prod(shape) * np_dtype.itemsize for _, shape, _ in tensors)
    needed += sum(len(data) for data in extra.values())
    free = shutil.disk_usage(out).free
    if needed > free:
        raise ConfigError(f"--out {str(folder)!r}: the export needs {format_bytes(needed)} but the disk has "
                          f"{format_bytes(free)} free; free space or choose another place")  # fmt: skip
    files = [out / name, *(out / f for f in extra)]
    with staged(files, "--out") as temporaries:
        _write(temporaries[0], header, tensors)
        for temporary, data in zip(temporaries[1:], extra.values(), strict=True):
            temporary.write_bytes(data)
    return files


def _json(data) -> bytes:
    return (json.dumps(data, indent=2) + "\n").encode()


def _out_folder(folder, names: list[str], force: bool, init_from) -> Path:
    """The export folder, created; refuses the run's ``init_from``, another checkpoint's folder, and
    (without ``force``) one that holds these files already."""
    out = make_folder(folder, "--out").resolve()
    if init_from is not None:
        base = _resolved(init_from)
        if out == base.resolve() or (base.is_file() and out == base.resolve().parent):
            raise ConfigError(f"--out {str(folder)!r} holds finetune.init_from, the weights this run started "
                              "from, which the export would replace; export to another folder")  # fmt: skip
    others = sorted(p.name for p in out.glob("*.safetensors*") if p.name not in names and p.name[0] != ".")
    if others:
        raise ConfigError(f"--out {str(folder)!r} holds another checkpoint's files (such as {others[0]}), "
                          "which would load beside the export; export to an empty folder")  # fmt: skip
    there = [n for n in names if (out / n).exists()]
    if there and not force:
        raise ConfigError(f"--out {str(folder)!r} already holds {', '.join(there)} (an earlier export?); "
                          "pass --force to replace them, or export to another folder")  # fmt: skip
    return out


def _check_adapters(program) -> None:
    """Raises ConfigError for a run whose training PEFT's adapter files cannot hold."""
    finetune = program.finetune
    if finetune is None or not finetune.adapted:
        raise ConfigError("export --adapters-only: the config has no finetune.lora; there are no adapters to "
                          "write (export the whole model instead)")  # fmt: skip
    source = None if program.custom_model else pretrained_model(program.config.finetune.init_from)
    if source is not None and source.multimodal:
        raise ConfigError("export --adapters-only: finetune.init_from is a multimodal Gemma 3 (model_type "
                          "gemma3), whose text model PEFT would look for under other module names than the "
                          "adapters'; export the merged model (no --adapters-only): its text model as a "
                          "Gemma3ForCausalLM")  # fmt: skip
    trained = sorted(_name(p) for p in _flat(program.model_params) if p not in finetune.frozen)
    if trained:
        raise ConfigError(f"export --adapters-only: the run also trains {', '.join(trained[:3])} (not "
                          "adapters), which PEFT's adapter files do not hold; export the merged model (no "
                          "--adapters-only), or freeze them in finetune.freeze")  # fmt: skip
    if (
        not program.custom_model
        and program.config.model.tie_embeddings
        and ("embedding",) in finetune.adapted
    ):
        raise ConfigError("export --adapters-only: the embedding's adapter also changes the output head here "
                          "(model.tie_embeddings), and PEFT's embedding adapter does not; export the merged "
                          "model (no --adapters-only)")  # fmt: skip


def _adapter_config(program, source) -> dict:
    """PEFT's ``adapter_config.json`` (a ``LoraConfig``) for the program's adapters."""
    lora = program.config.finetune.lora
    layout = _layout(program, {p: None for p in _flat(program.model_params)})
    modules = sorted({_module(layout[p].names[0]) for p in program.finetune.adapted})
    base = None
    if source is not None and source.hf is not None:
        base = str(Path(source.where).parent)  # The folder PEFT loads the base model from.
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "inference_mode": True, "r": lora.rank, "lora_alpha": lora.alpha, "target_modules": modules,
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False, "layers_to_transform": None,
            "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}}  # fmt: skip


def _module(tensor_name: str) -> str:
    """The module name PEFT's ``target_modules`` matches: ``q_proj``, ``embed_tokens``, ``lm_head``."""
    return tensor_name.removesuffix(".weight").removesuffix(".kernel").split(".")[-1]


def _layer(value, layer):
    """One layer of a stacked value (an array, Quantized or Adapted), or the value itself."""
    return value if layer is None else jax.tree.map(lambda x: x[layer], value)


def _hf_tensors(program, state, dtype, adapters_only: bool) -> Iterator[tuple[str, tuple, object]]:
    """(name, shape, make) of each tensor to write, ``make()`` its numpy array in ``dtype``."""
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
            if adapters_only:
                yield from _peft_tensors(name, finetune, path, layer_shape, value, layer, dtype)
                continue
            out_shape = tuple(_expected(shape, tensor))

            def make(v=value, n=layer, t=tensor, s=out_shape, name=name):
                w = np.asarray(weight(_layer(v, n), jnp.float32))
                if t.matrix:
                    w = w.reshape(math.prod(w.shape[: t.in_dims]), -1).T
                return _cast(np.ascontiguousarray(w.reshape(s)), dtype, name)

            yield name, out_shape, make


def _peft_tensors(name, finetune, path, layer_shape, value, layer, dtype):
    """PEFT's names and layout of one layer's adapter: ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``;
    an embedding's ``lora_embedding_A`` ``[r, vocab]`` and ``lora_embedding_B`` ``[d_model, r]``."""
    base = "base_model.model." + name.removesuffix(".weight")
    n_in = finetune.adapted[path].input_dims
    d_in, d_out = math.prod(layer_shape[:n_in]), math.prod(layer_shape[n_in:])
    a_name, b_name = f"{base}.lora_A.weight", f"{base}.lora_B.weight"
    if path == ("embedding",):
        a_name, b_name = f"{base}.lora_embedding_A", f"{base}.lora_embedding_B"

    def a(v=value, n=layer, d=d_in):
        return _cast(np.asarray(_layer(v.lora_a, n)).reshape(d, -1).T, dtype, a_name)

    def b(v=value, n=layer, d=d_out):
        return _cast(np.asarray(_layer(v.lora_b, n)).reshape(-1, d).T, dtype, b_name)

    yield a_name, (finetune.rank, d_in), a
    yield b_name, (d_out, finetune.rank), b


def _cast(array: np.ndarray, dtype: np.dtype, name: str) -> np.ndarray:
    """``array`` in ``dtype``; a ConfigError naming the tensor for entries that are not finite, or that
    ``dtype`` cannot hold (float16's largest is 65,504: beyond it numpy writes infinities)."""
    if not np.isfinite(array).all():
        raise ConfigError(f"export: {name} has NaN or infinite entries: the run's state is not finite (did "
                          "it diverge?); export an earlier checkpoint (--step)")  # fmt: skip
    largest = float(np.abs(array).max()) if array.size else 0.0
    if largest > float(jnp.finfo(dtype).max):
        raise ConfigError(f"export --dtype {dtype.name}: {name} has an entry of {largest:.6g}, beyond "
                          f"{dtype.name}'s largest, {float(jnp.finfo(dtype).max):g} (it would be written as "
                          "infinity); export with --dtype bfloat16 or float32")  # fmt: skip
    return array.astype(dtype)


def _header(tensors: list, dtype: np.dtype) -> bytes:
    """The safetensors header of ``tensors``, written before their data: offsets from the shapes."""
    header, offset = {}, 0
    for name, shape, _ in tensors:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _write(file: Path, header: bytes, tensors: list) -> None:
    """Writes a safetensors file one tensor at a time."""
    with open(file, "wb") as f:
        f.write(header)
        for name, shape, make in tensors:
            array = make()
            if tuple(array.shape) != tuple(shape):
                raise AssertionError(f"{name}: made {array.shape}, header says {shape}")
            f.write(array.tobytes())
