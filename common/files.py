"""File helpers shared by the token cache and checkpoints: hashing, and writes that
are atomic (a temporary file, flushed to disk, then renamed over the target)."""
from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import shutil
from pathlib import Path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_json(path: Path) -> dict | None:
    """A JSON object from a file, or None when the file is missing, unreadable, not
    UTF-8, not JSON, or holds something other than an object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    fsync(tmp)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data) -> None:
    write_text_atomic(path, json.dumps(data, indent=2))


def umask_mode(path: Path) -> None:
    """Give a file the mode a plain `open` would (0666 less the umask). Some writers
    (safetensors among them) create their file private to its owner, which a folder
    meant to be shared or uploaded should not be."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def remove_stale(folder: Path, prefix: str) -> None:
    """Remove what `PREFIX<pid>` names in `folder` where that process no longer runs:
    the temporary folders of writes that were killed. A live process's are left alone."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for path in folder.glob(f"{glob.escape(prefix)}*"):
        pid = path.name[len(prefix):]
        if pid.isdigit() and not pid_alive(int(pid)):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True                       # someone else's process, or not a pid we can judge
    return True


def lock_file(path: Path, wait: bool):
    """An exclusive lock on `path` (created if missing), held until the returned file
    is closed or the process ends, however it ends. Returns None when another process
    holds it and `wait` is False."""
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        f.close()
        return None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def lock_holder(path: Path) -> str:
    try:
        return Path(path).read_text().strip() or "?"
    except OSError:
        return "?"
