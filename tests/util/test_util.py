"""The shared helpers: atomic writes and folder replacement, strict config loading."""

import os
import stat
from dataclasses import dataclass

import numpy as np
import pytest

from openglm.util.files import replace_dir, write_atomic
from openglm.util.strict import check_keys, from_dict


def test_write_atomic_text_bytes_and_writer_keep_the_suffix(tmp_path):
    write_atomic(tmp_path / "a" / "t.txt", "héllo")  # creates the folder
    write_atomic(tmp_path / "b.bin", b"\0\1")
    write_atomic(tmp_path / "v.npy", lambda tmp: np.save(tmp, np.arange(3)))  # np.save appends .npy otherwise
    assert (tmp_path / "a" / "t.txt").read_text(encoding="utf-8") == "héllo"
    assert (tmp_path / "b.bin").read_bytes() == b"\0\1"
    assert np.load(tmp_path / "v.npy").tolist() == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b.bin", "v.npy"]  # no temp file left


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "state.json"
    target.write_text("old")

    def dies(tmp):
        tmp.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(target, dies)
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["state.json"]


def test_keep_mode_keeps_an_executable_script_executable(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("echo 1\n")
    script.chmod(0o755)
    write_atomic(script, "echo 2\n", keep_mode=True)
    assert stat.S_IMODE(script.stat().st_mode) == 0o755 and script.read_text() == "echo 2\n"


def test_replace_dir_swaps_a_folder_in(tmp_path):
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "f").write_text("2")
    replace_dir(tmp_path / "new", tmp_path / "ckpt")  # no old folder yet
    (tmp_path / "newer").mkdir()
    (tmp_path / "newer" / "f").write_text("3")
    replace_dir(tmp_path / "newer", tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "f").read_text() == "3" and sorted(os.listdir(tmp_path)) == ["ckpt"]


@dataclass
class Cfg:
    a: int = 1
    b: str = ""


def test_unknown_keys_are_named():
    assert from_dict(Cfg, {"a": 2}, "Cfg field(s)") == Cfg(a=2)
    with pytest.raises(ValueError, match=r"unknown Cfg field\(s\) \['c', 'd'\]; known: \['a', 'b'\]"):
        check_keys({"a": 1, "d": 0, "c": 0}, Cfg, "Cfg field(s)")
    with pytest.raises(TypeError, match="unknown option"):
        check_keys({"x": 1}, Cfg, "option(s)", TypeError)
