"""common/files.py: writes that are whole or not at all."""
import os
import subprocess
import sys

import pytest

from common.files import write_bytes_atomic, write_text_atomic


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def test_a_write_killed_before_its_rename_is_cleared_by_the_next(tmp_path):
    """A SIGKILL between the write and the rename leaves `.NAME.tmp-PID`; the next write
    of that file removes it where PID no longer runs, and leaves a live writer's alone."""
    target = tmp_path / "figure.png"
    stale = tmp_path / f".figure.png.tmp-{dead_pid()}"
    live = tmp_path / f".figure.png.tmp-{os.getppid()}"
    other = tmp_path / f".other.png.tmp-{dead_pid()}"
    for path in (stale, live, other):
        path.write_bytes(b"half")
    write_bytes_atomic(target, b"whole")
    assert target.read_bytes() == b"whole"
    assert not stale.exists() and live.exists() and other.exists()


@pytest.mark.parametrize("where", ["missing/x.txt", "file/x.txt"])
def test_a_failed_write_names_the_file_asked_for_not_its_temporary_name(tmp_path, where):
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError) as failed:
        write_text_atomic(tmp_path / where, "text")
    assert failed.value.filename == str(tmp_path / where)
    assert ".tmp-" not in str(failed.value)


def test_a_full_disk_names_the_file_being_written(tmp_path, monkeypatch):
    """write() on a full disk raises ENOSPC with no file name, so the error line said
    only "No space left on device"."""
    import errno
    from pathlib import Path

    def full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(OSError) as failed:
        write_text_atomic(tmp_path / "state.json", "{}")
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(tmp_path / "state.json")


@pytest.mark.parametrize("text,kind", [("null", "null"), ("[1]", "list"), ('"x"', "string"),
                                       ("3", "number"), ("true", "true or false")])
def test_json_that_is_not_an_object_is_named_in_json_words(text, kind):
    """It said "a JSON NoneType": Python's word for what the file calls null."""
    from common.files import parse_json_object
    with pytest.raises(ValueError, match=f"^holds a JSON {kind}, not an object$"):
        parse_json_object(text.encode())
