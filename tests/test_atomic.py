"""ds4.atomic: the temp-file-then-rename output every tool uses."""

import os
import stat

import pytest

from ds4.atomic import atomic_write, write_bytes_atomic, write_text_atomic


def _plain_open_mode(tmp_path) -> int:
    probe = tmp_path / "probe"
    probe.write_text("")
    return stat.S_IMODE(probe.stat().st_mode)


def test_text_bytes_content_mode_and_no_leftovers(tmp_path):
    target = tmp_path / "sub" / "dir" / "out.txt"
    write_text_atomic(target, "α\nβ\n")
    assert target.read_bytes() == "α\nβ\n".encode()
    write_bytes_atomic(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    # Same mode as a plain open() would give (mkstemp alone would leave 0600).
    assert stat.S_IMODE(target.stat().st_mode) == _plain_open_mode(tmp_path)
    assert os.listdir(target.parent) == ["out.txt"]


def test_failed_write_keeps_the_old_file_and_removes_the_temp(tmp_path):
    target = tmp_path / "keep.txt"
    target.write_text("old")

    def boom(p):
        p.write_text("half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        atomic_write(target, boom)
    assert target.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["keep.txt"]


def test_missing_folder_is_an_error_not_created(tmp_path):
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "nope" / "x.txt", lambda p: p.write_text("x"))
    assert not (tmp_path / "nope").exists()
