"""Deterministic, per-process token batches.

Every row of every batch is a pure function of ``(seed, step, row)``, so a resumed run, or the
same run on a different number of processes, sees exactly the same data::

    source = make_source(None, vocab_size=512, seq_len=128, seed=0)
    tokens = global_batch(source, step, 32, NamedSharding(mesh, P(("data", "fsdp"))))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

:func:`global_batch` builds the global ``[batch, seq_len + 1]`` array with
``jax.make_array_from_callback``; each process only generates the rows its own devices hold.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from shardmem.errors import ConfigError

__all__ = [
    "batch_stream",
    "source_batch",
    "TokenSource",
    "SyntheticSource",
    "ByteTextSource",
    "TokenFileSource",
    "make_source",
    "global_batch",
]

# Small strides keep the synthetic task learnable: after two tokens the rest of the row is known.
_SYNTHETIC_STRIDES = np.array([1, 2, 3, 5, 7], dtype=np.int64)


class TokenSource(abc.ABC):
    """A deterministic stream of token rows; subclasses implement :meth:`_row`.

    ``rows(step, a, b, n)`` returns int32 ``[b - a, seq_len + 1]``: row ``r`` depends only on
    ``(seed, step, r)``, never on which process asks or what was asked before.
    """

    vocab_size: int
    seq_len: int
    seed: int

    def __init__(self, *, vocab_size: int, seq_len: int, seed: int) -> None:
        _check_positive("model.vocab_size", vocab_size)
        _check_positive("model.seq_len", seq_len)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ConfigError(f"seed={seed!r} must be a non-negative integer; use e.g. seed=0")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed

    def rows(self, step: int, row_start: int, row_stop: int, global_batch: int) -> np.ndarray:
        """Returns rows ``row_start:row_stop`` of batch ``step`` as int32 ``[n, seq_len + 1]``.

        Inputs are ``[:, :-1]`` and targets ``[:, 1:]``. ``global_batch`` only bounds the range.
        """
        if step < 0:
            raise ValueError(f"step={step} must be non-negative.")
        if not 0 <= row_start <= row_stop <= global_batch:
            raise ValueError(f"rows {row_start}:{row_stop} are outside a global batch of {global_batch}.")
        out = np.empty((row_stop - row_start, self.seq_len + 1), dtype=np.int32)
        for i, row in enumerate(range(row_start, row_stop)):
            out[i] = self._row(np.random.default_rng((self.seed, step, row)))
        return out

    @abc.abstractmethod
    def _row(self, rng: np.random.Generator) -> np.ndarray:
        """Returns one row of ``seq_len + 1`` tokens drawn with ``rng``."""


class SyntheticSource(TokenSource):
    """Arithmetic progressions ``start + stride * i mod vocab_size``: free, learnable data.

    A tiny model first learns that the next token is a small step ahead, then which step;
    the loss falls from ``ln(vocab_size)`` towards zero within a few hundred steps.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        super().__init__(vocab_size=vocab_size, seq_len=seq_len, seed=seed)
        self._positions = np.arange(seq_len + 1, dtype=np.int64)

    def _row(self, rng: np.random.Generator) -> np.ndarray:
        start = rng.integers(0, self.vocab_size)
        stride = rng.choice(_SYNTHETIC_STRIDES)
        return (start + stride * self._positions) % self.vocab_size


class _WindowSource(TokenSource):
    """Random windows of ``seq_len + 1`` tokens from a 1-D memory-mapped token array."""

    def __init__(self, tokens: np.ndarray, path: str, *, vocab_size: int, seq_len: int, seed: int) -> None:
        super().__init__(vocab_size=vocab_size, seq_len=seq_len, seed=seed)
        if tokens.shape[0] < seq_len + 1:
            raise ConfigError(
                f"`data.path={path!r}` holds {tokens.shape[0]} tokens, fewer than "
                f"model.seq_len + 1 = {seq_len + 1}; use a longer file or a shorter seq_len."
            )
        self.path = path
        self._tokens = tokens
        self._last_start = tokens.shape[0] - (seq_len + 1)

    def _row(self, rng: np.random.Generator) -> np.ndarray:
        start = int(rng.integers(0, self._last_start + 1))
        return self._tokens[start : start + self.seq_len + 1]


class ByteTextSource(_WindowSource):
    """Byte-level tokens (vocab 256) from any file, read through ``np.memmap``."""

    def __init__(self, path: str, seq_len: int, seed: int) -> None:
        size = _file_size(path)
        # np.memmap cannot map an empty file; the length check below reports it instead.
        tokens = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        super().__init__(tokens, path, vocab_size=256, seq_len=seq_len, seed=seed)


_NPY_MAGIC = b"\x93NUMPY"


class TokenFileSource(_WindowSource):
    """Pre-tokenized ids from a 1-D integer ``.npy`` file, loaded with ``mmap_mode="r"``.

    Token ids are checked against ``vocab_size`` on the windows actually read, so opening a
    large file stays free; a bad id raises :class:`ConfigError` on the batch that contains it.
    """

    def __init__(self, path: str, seq_len: int, seed: int, vocab_size: int) -> None:
        _file_size(path)
        with open(path, "rb") as file:
            magic = file.read(len(_NPY_MAGIC))
        if magic != _NPY_MAGIC:  # np.load would take it for a pickle and say so, which misleads.
            raise ConfigError(
                f"`data.path={path!r}` is not a .npy file (it does not start with NumPy's header); "
                "save token ids with np.save(path, ids)."
            )
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as error:  # A damaged header, or an object array (which only pickles hold).
            raise ConfigError(
                f"`data.path={path!r}` is not a readable .npy array ({error}); "
                "save token ids with np.save(path, ids)."
            ) from error
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ConfigError(
                f"`data.path={path!r}` holds a {tokens.dtype} array of shape {tokens.shape}; "
                "expected a 1-D integer array of token ids."
            )
        super().__init__(tokens, path, vocab_size=vocab_size, seq_len=seq_len, seed=seed)

    def _row(self, rng: np.random.Generator) -> np.ndarray:
        window = super()._row(rng)
        low, high = int(window.min()), int(window.max())
        if low < 0:
            dtype = self._tokens.dtype
            if np.iinfo(dtype).max < self.vocab_size - 1:
                why = f"its dtype {dtype} cannot hold ids up to {self.vocab_size - 1}; save them as uint32"
            else:
                why = "negative values are usually padding or ignore markers (such as -100); drop them"
            raise ConfigError(
                f"`data.path={self.path!r}` contains token id {low}; ids are never negative: {why}"
            )
        if high >= self.vocab_size:
            raise ConfigError(
                f"`data.path={self.path!r}` contains token id {high}, outside "
                f"[0, model.vocab_size={self.vocab_size}); set model.vocab_size to the "
                "tokenizer's vocabulary size."
            )
        return window


def make_source(path: str | None, *, vocab_size: int, seq_len: int, seed: int) -> TokenSource:
    """Returns the source for ``data.path``: synthetic if None, token ids if ``.npy``, else bytes.

    Example: ``make_source("corpus.txt", vocab_size=256, seq_len=128, seed=0)``.
    """
    if path is None:
        return SyntheticSource(vocab_size, seq_len, seed)
    if os.fspath(path).endswith(".npy"):
        return TokenFileSource(path, seq_len, seed, vocab_size)
    if vocab_size < 256:
        raise ConfigError(
            f"`data.path={path!r}` is read as bytes (256 token ids) but "
            f"`model.vocab_size={vocab_size}`; set model.vocab_size >= 256, or pass a "
            "pre-tokenized .npy file."
        )
    return ByteTextSource(path, seq_len, seed)


def global_batch(
    source: TokenSource, step: int, global_batch: int, sharding: jax.sharding.Sharding
) -> jax.Array:
    """Returns batch ``step`` as a global int32 ``[global_batch, seq_len + 1]`` array.

    Each process generates only the rows of its addressable shards; rows replicated over
    several local devices are generated once. ``sharding`` may split the batch dimension over
    several mesh axes, and may replicate either dimension.
    """
    _check_positive("train.global_batch", global_batch)
    shape = (global_batch, source.seq_len + 1)
    try:
        sharding.shard_shape(shape)
    except ValueError as error:
        raise ConfigError(
            f"`train.global_batch={global_batch}` cannot be split by the batch sharding "
            f"{sharding}: {error}. Use a multiple of the number of data-parallel devices."
        ) from error

    def rows(step: int, rows: range, seed: int) -> np.ndarray:
        return source.rows(step, rows.start, rows.stop, global_batch)

    abstract = jax.ShapeDtypeStruct(shape, np.int32, sharding=sharding)
    return source_batch(rows, step, source.seed, abstract)


def batch_stream(config, program, *, synthetic: bool = False) -> Callable[[int], Any]:
    """Returns ``step -> global batch`` for a built program: token rows from ``data.path`` (or the
    synthetic stream) for the reference batch, else the user's ``data.source`` function. ``synthetic``
    lets a declared batch without a source run on zeros (for timing steps)."""
    train = config.train
    if program.token_batch:
        vocab = config.model.vocab_size if hasattr(config.model, "vocab_size") else 256
        rows = jax.tree.leaves(program.abstract_batch)[0].shape
        source = make_source(config.data.path, vocab_size=vocab, seq_len=rows[1] - 1, seed=train.seed)
        return lambda step: global_batch(source, step, rows[0], program.batch_sharding)
    if config.data.source is None:
        if synthetic:
            return lambda step: jax.tree.map(
                lambda leaf: jax.numpy.zeros(leaf.shape, leaf.dtype, device=leaf.sharding),
                program.abstract_batch,
            )
        raise ConfigError(
            "data.source is not set: a declared data.batch needs a function that makes it, e.g. data: "
            "{source: mypkg.data:batches} with batches(step, rows, seed) -> {name: array of len(rows) rows}"
        )
    from shardmem.models.user import import_object, search_from

    with search_from(config.folder):
        fn = import_object(config.data.source, "data.source")
    return lambda step: source_batch(fn, step, train.seed, program.abstract_batch)


def source_batch(fn: Callable, step: int, seed: int, abstract_batch) -> Any:
    """Returns batch ``step`` of ``fn(step, rows, seed)`` as global arrays shaped like ``abstract_batch``
    (sharded abstract arrays). Each process asks only for the rows its devices hold, once per block."""
    blocks: dict[tuple[int, int], Any] = {}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_batch)
    total = leaves[0][1].shape[0]

    def block(start: int, stop: int):
        if (start, stop) not in blocks:
            out = fn(step, range(start, stop), seed)
            flat, got = jax.tree_util.tree_flatten_with_path(out)
            if got != treedef:
                raise ConfigError(
                    f"data.source returned a batch shaped {jax.tree.structure(out)}, but data.batch "
                    f"declares {treedef}; return the same names"
                )
            blocks[(start, stop)] = [np.asarray(value) for _, value in flat]
        return blocks[(start, stop)]

    arrays = []
    for index, (path, leaf) in enumerate(leaves):
        name = jax.tree_util.keystr(path)

        def rows_for(slices: Sequence[slice], index=index, leaf=leaf, name=name) -> np.ndarray:
            start, stop, _ = slices[0].indices(total)
            value = block(start, stop)[index]
            expected = (stop - start, *leaf.shape[1:])
            if value.shape != expected:
                raise ConfigError(
                    f"data.source gave {name} of shape {list(value.shape)} for rows {start}:{stop} of step "
                    f"{step}; data.batch declares {list(expected)} for them"
                )
            return value.astype(leaf.dtype, copy=False)[(slice(None), *slices[1:])]

        arrays.append(jax.make_array_from_callback(leaf.shape, leaf.sharding, rows_for))
    return jax.tree.unflatten(treedef, arrays)


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer; use e.g. {name}=1")


def _file_size(path: str) -> int:
    if not os.path.isfile(path):
        raise ConfigError(
            f"`data.path={path!r}` does not exist or is not a file; pass an existing text or "
            ".npy file, or leave data.path unset for synthetic data."
        )
    return os.path.getsize(path)
