"""Every file shardwire writes is whole or untouched: ``shardwire.files.write_atomically``."""

from __future__ import annotations

import os

import pytest

from shardwire.files import write_atomically


def test_a_failed_write_leaves_the_previous_file_whole_and_no_temporary(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("previous")

    class Unwritable(str):
        def encode(self):
            raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomically(path, Unwritable("new"))
    assert path.read_text() == "previous"
    assert os.listdir(tmp_path) == ["results.json"]
    write_atomically(path, "new", durable=True)
    assert path.read_text() == "new"
    assert os.listdir(tmp_path) == ["results.json"]


def test_a_directory_in_the_way_is_a_clear_error(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a directory: give a file name"):
        write_atomically(tmp_path, b"data")
