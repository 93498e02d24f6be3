"""Files shardmem writes for the user (shardmem._files): whole or not at all, and a path that cannot be
written is one line naming the flag, for `export --out` (tests/test_export.py), `plan --html` and
`sweep --out`."""

import os

import pytest

from shardmem._files import make_folder, staged, write_file
from shardmem.cli import main
from shardmem.errors import ConfigError

TINY = ["--set", "model.seq_len=16", "--set", "model.n_layers=1", "--set", "remat.layers={}"]


def _fill(disk, leave: int = 0) -> None:
    """Fills the disk up to ``leave`` bytes."""
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    if leave:
        os.truncate(disk / "filler", os.path.getsize(disk / "filler") - leave)


def test_a_full_disk_keeps_the_old_file_and_leaves_no_partial_one(small_disk):
    disk = small_disk("256k")
    write_file(disk / "page.html", "old", "--html")
    _fill(disk, leave=8192)
    with pytest.raises(ConfigError) as error:
        write_file(disk / "page.html", "x" * 100_000, "--html")
    said = "the disk is full; nothing was written (what was there is as it was): free space or choose "
    said += "another place"
    assert str(error.value) == f"--html {str(disk / 'page.html')!r}: {said}"
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "page.html"]
    assert (disk / "page.html").read_text() == "old"


def test_an_interruption_keeps_every_old_file(tmp_path):
    for name in ("a.csv", "b.json"):
        (tmp_path / name).write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with staged([tmp_path / "a.csv", tmp_path / "b.json"], "--out") as (a, b):
            a.write_text("new")
            raise KeyboardInterrupt  # Ctrl-C before b is written: neither is replaced.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.csv", "b.json"]
    assert {p.read_text() for p in tmp_path.iterdir()} == {"old"}


def test_written_files_keep_the_users_permissions(tmp_path):
    mask = os.umask(0o022)
    try:
        write_file(tmp_path / "sweep.csv", "x", "--out")
    finally:
        os.umask(mask)
    assert (tmp_path / "sweep.csv").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("path, says", [
    ("/proc/shardmem.html", "cannot write there"),
    ("{file}/page.html", "a part of the path is a file, not a folder"),
])  # fmt: skip
def test_plan_html_where_it_cannot_be_written_is_one_line_before_compiling(tmp_path, capsys, path, says):
    (tmp_path / "file").write_text("mine")
    path = path.format(file=tmp_path / "file")
    assert main(["plan", "configs/tiny.yaml", "--html", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"shardmem: error: --html {path!r}") and says in err


def test_plan_html_on_a_full_disk_is_one_line_and_keeps_the_old_page(small_disk, capsys):
    disk = small_disk("256k")
    (disk / "page.html").write_text("old")
    _fill(disk, leave=4096)
    assert main(["plan", "configs/tiny.yaml", *TINY, "--html", str(disk / "page.html")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"shardmem: error: --html {str(disk / 'page.html')!r}: the disk is full")
    assert (disk / "page.html").read_text() == "old" and sorted(p.name for p in disk.iterdir()) == [
        "filler",
        "page.html",
    ]


def test_sweep_out_onto_a_file_is_one_line_before_planning(tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    for out, says in [(tmp_path / "file", "is a file, not a folder"),
                      (tmp_path / "file" / "sweep", "a part of the path is a file")]:  # fmt: skip
        assert main(["sweep", "configs/tiny.yaml", "--grid", "remat.policy=none", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--out {str(out)!r}" in err and says in err
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        make_folder(tmp_path / "file", "--out")
