"""Tests for shardmem.run.data: determinism, file sources, errors and sharded global batches."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardmem.errors import ConfigError
from shardmem.run.data import (
    ByteTextSource,
    SyntheticSource,
    TokenFileSource,
    global_batch,
    make_source,
)


@pytest.fixture
def text_path(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 20)
    return str(path)


@pytest.fixture
def npy_path(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, np.arange(1000, dtype=np.uint16) % 300)
    return str(path)


def test_synthetic_rows_are_learnable_progressions():
    source = SyntheticSource(vocab_size=97, seq_len=16, seed=3)
    rows = source.rows(step=5, row_start=0, row_stop=8, global_batch=8)
    assert rows.shape == (8, 17) and rows.dtype == np.int32
    assert rows.min() >= 0 and rows.max() < 97
    steps = np.diff(rows.astype(np.int64), axis=1) % 97
    assert np.all(steps == steps[:, :1]), "each row has one constant stride"
    assert set(steps[:, 0]) <= {1, 2, 3, 5, 7}


@pytest.mark.parametrize("kind", ["synthetic", "text", "npy"])
def test_rows_depend_only_on_seed_step_and_row(kind, text_path, npy_path):
    path = {"synthetic": None, "text": text_path, "npy": npy_path}[kind]
    source = make_source(path, vocab_size=512, seq_len=12, seed=7)
    whole = source.rows(step=4, row_start=0, row_stop=16, global_batch=16)
    # Any split into row ranges (as different process counts would ask) gives the same rows.
    for bounds in ([0, 16], [0, 8, 16], [0, 3, 4, 11, 16]):
        parts = [source.rows(4, a, b, 16) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        np.testing.assert_array_equal(np.concatenate(parts), whole)
    # Earlier calls for other steps do not change what a step returns.
    source.rows(step=9, row_start=0, row_stop=16, global_batch=16)
    np.testing.assert_array_equal(source.rows(4, 0, 16, 16), whole)
    # A fresh source with the same seed agrees; another step or seed differs.
    again = make_source(path, vocab_size=512, seq_len=12, seed=7)
    np.testing.assert_array_equal(again.rows(4, 0, 16, 16), whole)
    assert not np.array_equal(source.rows(5, 0, 16, 16), whole)
    other_seed = make_source(path, vocab_size=512, seq_len=12, seed=8)
    assert not np.array_equal(other_seed.rows(4, 0, 16, 16), whole)


def test_byte_text_source_reads_windows_of_the_file(text_path):
    source = make_source(text_path, vocab_size=256, seq_len=10, seed=0)
    assert isinstance(source, ByteTextSource) and source.vocab_size == 256
    text = open(text_path, "rb").read()
    for row in source.rows(0, 0, 4, 4):
        assert row.dtype == np.int32
        assert bytes(row.astype(np.uint8).tolist()) in text


def test_token_file_source_reads_windows_of_the_array(npy_path):
    source = make_source(npy_path, vocab_size=300, seq_len=10, seed=0)
    assert isinstance(source, TokenFileSource)
    tokens = np.load(npy_path)
    windows = np.lib.stride_tricks.sliding_window_view(tokens, 11)
    for row in source.rows(2, 0, 4, 4):
        assert row.dtype == np.int32
        assert np.any(np.all(windows == row, axis=1)), "each row is a window of the file"


def test_missing_file_names_data_path(tmp_path):
    for name in ("missing.txt", "missing.npy"):
        with pytest.raises(ConfigError, match=r"data\.path=.*does not exist"):
            make_source(str(tmp_path / name), vocab_size=256, seq_len=8, seed=0)


def test_too_short_files_name_data_path_and_seq_len(tmp_path):
    short_text = tmp_path / "short.txt"
    short_text.write_bytes(b"abc")
    empty_text = tmp_path / "empty.txt"
    empty_text.write_bytes(b"")
    short_npy = tmp_path / "short.npy"
    np.save(short_npy, np.arange(5, dtype=np.int32))
    for path in (short_text, empty_text, short_npy):
        with pytest.raises(ConfigError, match=r"data\.path=.*seq_len \+ 1 = 9"):
            make_source(str(path), vocab_size=256, seq_len=8, seed=0)


def test_byte_text_needs_a_vocab_of_256(text_path):
    with pytest.raises(ConfigError, match=r"model\.vocab_size=128.*>= 256"):
        make_source(text_path, vocab_size=128, seq_len=8, seed=0)


def test_token_ids_beyond_the_vocab_are_reported(npy_path):
    source = make_source(npy_path, vocab_size=100, seq_len=50, seed=0)
    with pytest.raises(ConfigError, match=r"token id \d+, outside \[0, model\.vocab_size=100\)"):
        source.rows(0, 0, 8, 8)


def test_negative_token_ids_say_the_file_is_at_fault(tmp_path):
    path = tmp_path / "wrapped.npy"
    np.save(path, np.array([5, 40000, 7] * 40, dtype=np.uint16).astype(np.int16))  # 40000 wraps around.
    source = make_source(str(path), vocab_size=50000, seq_len=8, seed=0)
    with pytest.raises(ConfigError, match=r"token id -25536; ids are never negative: its dtype int16 .*"):
        source.rows(0, 0, 8, 8)
    padded = tmp_path / "padded.npy"
    np.save(padded, np.array([5, -100, 7] * 40, dtype=np.int32))
    source = make_source(str(padded), vocab_size=50000, seq_len=8, seed=0)
    with pytest.raises(ConfigError, match=r"token id -100; .*padding or ignore markers"):
        source.rows(0, 0, 8, 8)


def test_npy_must_hold_1d_integers(tmp_path):
    path = tmp_path / "floats.npy"
    np.save(path, np.zeros((4, 50), dtype=np.float32))
    with pytest.raises(ConfigError, match="1-D integer array"):
        make_source(str(path), vocab_size=256, seq_len=8, seed=0)


def test_bad_arguments_raise_config_errors():
    with pytest.raises(ConfigError, match="model.seq_len=0"):
        SyntheticSource(vocab_size=16, seq_len=0, seed=0)
    with pytest.raises(ConfigError, match="seed=-1"):
        SyntheticSource(vocab_size=16, seq_len=8, seed=-1)


@pytest.mark.newest
@pytest.mark.parametrize(
    "mesh_shape, spec",
    [
        ((8,), P("data")),
        ((2, 4), P(("data", "fsdp"))),
        ((2, 4), P("data")),  # replicated over fsdp
        ((2, 4), P("fsdp", "data")),  # sequence dim split too
        ((2, 4), P()),  # fully replicated
    ],
)
def test_global_batch_matches_the_unsharded_rows(mesh_shape, spec):
    names = ("data", "fsdp")[: len(mesh_shape)]
    mesh = jax.make_mesh(mesh_shape, names, devices=jax.devices()[:8])
    sharding = NamedSharding(mesh, spec)
    source = SyntheticSource(vocab_size=1000, seq_len=15, seed=1)
    batch = global_batch(source, 3, 16, sharding)
    assert batch.shape == (16, 16) and batch.dtype == np.int32
    assert batch.sharding == sharding
    np.testing.assert_array_equal(np.asarray(batch), source.rows(3, 0, 16, 16))


@pytest.mark.newest
def test_global_batch_generates_each_row_once_per_process():
    class CountingSource(SyntheticSource):
        calls: list[tuple[int, int]] = []

        def rows(self, step, row_start, row_stop, global_batch):
            self.calls.append((row_start, row_stop))
            return super().rows(step, row_start, row_stop, global_batch)

    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), devices=jax.devices()[:8])
    source = CountingSource(vocab_size=50, seq_len=7, seed=0)
    global_batch(source, 0, 8, NamedSharding(mesh, P("data")))
    assert sorted(source.calls) == [(0, 4), (4, 8)]


def test_global_batch_that_does_not_divide_is_a_config_error():
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    source = SyntheticSource(vocab_size=50, seq_len=7, seed=0)
    with pytest.raises(ConfigError, match=r"train\.global_batch=12"):
        global_batch(source, 0, 12, NamedSharding(mesh, P("data")))


def test_a_npy_file_that_is_not_one_is_named_so_without_mentioning_pickles(tmp_path):
    garbage = tmp_path / "tokens.npy"
    garbage.write_bytes(b"this is text, not an array\n" * 10)
    with pytest.raises(
        ConfigError, match=r"is not a \.npy file \(it does not start with NumPy's header\)"
    ) as e:
        make_source(str(garbage), vocab_size=300, seq_len=10, seed=0)
    assert "pickle" not in str(e.value)
