"""Which tensors a safetensors checkpoint holds, in which file, with which dtype and shape: read from the
files' headers alone (no tensor data), every problem a one-line ConfigError naming the file.

    checkpoint = SafetensorsCheckpoint.open("Mistral-7B-Instruct-v0.3/")
    checkpoint.tensors["model.norm.weight"]        # TensorHeader(file, dtype="BF16", shape=(4096,))

A folder with ``model.safetensors.index.json`` holds the tensors its ``weight_map`` lists, in the files it
names (the Hub's sharded layout); other ``.safetensors`` files there (Mistral's ``consolidated.safetensors``,
the same weights under other names) are not read. Without an index, every ``.safetensors`` file of the
folder is, and a tensor in two of them is an error.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from shardmem.errors import ConfigError

INDEX = "model.safetensors.index.json"
#: safetensors dtype codes a weight may be stored in, and their entry sizes.
FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def not_weights(given, file: Path) -> str:
    """The message for a ``finetune.init_from`` that names a file other than weights (a ``config.json``,
    a run's ``config.yaml``, a PyTorch ``.bin``)."""
    return (f"finetune.init_from={given!r} is a file, not weights; give the folder it is in "
            f"({str(file.parent)!r}) if that is a Hugging Face model's or a shardmem run's, or a "
            ".safetensors file")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TensorHeader:
    """One tensor of a checkpoint: the file holding it, its safetensors dtype code and its shape."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SafetensorsCheckpoint:
    """The tensors of a safetensors file or folder (see the module docstring); ``where`` is the path as
    ``finetune.init_from`` gives it, ``flax`` whether every file says ``format: flax`` (transformers'
    Flax ``save_pretrained``), ``index`` the index file when there is one."""

    where: str
    tensors: dict[str, TensorHeader]
    flax: bool = False
    index: Path | None = None

    @staticmethod
    def open(path: str | Path, where: str | None = None) -> SafetensorsCheckpoint:
        """Reads the headers of the checkpoint at ``path``; raises ConfigError for a path with no
        safetensors file, an index naming a missing file or tensor, a file that is not safetensors
        (empty, truncated, garbage) and a tensor found in two files."""
        where = where or str(path)
        folder = Path(path).expanduser()
        index_file = folder / INDEX if folder.is_dir() else None
        if index_file is not None and index_file.is_file():
            listed = _index(index_file, where)
            files = sorted(set(listed.values()))
        else:
            index_file = None
            files = safetensors_files(folder) if folder.is_dir() else [folder]
            listed = None
        if not files or not files[0].exists():
            run = next((f for f in (folder, folder.parent) if (f / "config.yaml").is_file()), None)
            if folder.is_dir() and run is not None:  # A shardmem run folder (or its checkpoints) with none.
                raise ConfigError(f"finetune.init_from={where!r}: the shardmem run at {str(run)!r} has no "
                                  "checkpoint saved yet; train it first (shardmem train CONFIG --run-dir "
                                  f"{run}), or give a Hugging Face model's folder")  # fmt: skip
            if folder.is_dir() and (folder / "config.json").is_file():  # Downloaded as far as its config.
                raise ConfigError(f"finetune.init_from={where!r} has a config.json but no .safetensors "
                                  "file; download the model's weights into it too (its *.safetensors "
                                  "files)")  # fmt: skip
            raise ConfigError(f"finetune.init_from={where!r}: no .safetensors file there; give a file or a "
                              "folder of them (a Hugging Face model's folder)")  # fmt: skip
        tensors: dict[str, TensorHeader] = {}
        formats = set()
        for file in files:
            try:
                names, dtypes, shapes, metadata = _header(file)
            except ConfigError:
                if folder.is_dir() or folder.suffix == ".safetensors":
                    raise  # A checkpoint's file that does not read: "download it again" is the fix.
                raise ConfigError(not_weights(where, folder)) from None
            formats.add(metadata.get("format"))
            for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                if listed is not None and listed.get(name) != file:
                    continue  # Not the index's copy (or not in the index): not part of the checkpoint.
                if name in tensors:
                    raise ConfigError(
                        f"finetune.init_from={where!r}: {name} is in both {tensors[name].file.name} and "
                        f"{file.name}; keep one checkpoint's files in the folder, or name the file"
                    )
                tensors[name] = TensorHeader(file, dtype, tuple(shape))
        for name, file in (listed or {}).items():
            if name not in tensors:
                raise ConfigError(f"finetune.init_from={where!r}: {INDEX} puts {name} in {file.name}, which "
                                  "has no such tensor; download the checkpoint again")  # fmt: skip
        return SafetensorsCheckpoint(where, tensors, formats == {"flax"}, index_file)

    def entry_bytes(self) -> int:
        """Returns the widest entry among the checkpoint's tensors (4 for integer ones' sake)."""
        return max((FLOAT_DTYPES.get(t.dtype, 4) for t in self.tensors.values()), default=4)


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's ``.safetensors`` files, not hidden ones (an interrupted export's temporaries)."""
    return sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("."))


def _index(file: Path, where: str) -> dict[str, Path]:
    """Tensor name -> file, from an index's ``weight_map``; a file it names must be there."""
    try:
        weight_map = json.loads(file.read_text())["weight_map"]
        listed = {str(name): file.parent / str(shard) for name, shard in weight_map.items()}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"finetune.init_from={where!r}: {file.name} is not a safetensors index (no "
                          f"weight_map: {type(e).__name__}); download it again") from None  # fmt: skip
    missing = sorted({p.name for p in listed.values() if not p.is_file()})
    if missing:
        raise ConfigError(
            f"finetune.init_from={where!r}: {file.name} lists {len(missing)} file(s) the folder does not "
            "have, "
            f"such as {missing[0]}; the download is incomplete: download the missing shards"
        )
    return listed


def _header(file: Path) -> tuple[list[str], list[str], list[list[int]], dict]:
    """Names, dtype codes, shapes and metadata of one file's tensors, or a one-line ConfigError."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), "numpy") as f:
            names = list(f.keys())
            slices = [f.get_slice(name) for name in names]
            return names, [s.get_dtype() for s in slices], [s.get_shape() for s in slices], f.metadata() or {}
    except (SafetensorError, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"finetune.init_from: {file} is not a readable safetensors file ({reason}); it is "
                          "empty, truncated or not safetensors: download it again") from None  # fmt: skip
