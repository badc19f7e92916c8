"""File helpers shared by the token cache and checkpoints: hashing, reads that are
bounded (a file that is not a plain file, or is larger than it can be, is refused
before it is read), and writes that are atomic (a temporary file, flushed to disk,
then renamed over the target)."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

JSON_LIMIT = 64 << 20       # bytes: the project's own JSON files are far smaller


def inside(folder: Path, name, roots: tuple[Path, ...] | None = None) -> Path | None:
    """The resolved path of `name`, a name read from a file, inside `folder`; None unless
    it is a non-empty relative path that stays inside the folder (or one of `roots`)
    with every symlink followed. The one rule for every name a file gives: a shard in
    meta.json, a file in a checkpoint's state.json, a weight file in a transformers
    index. Whether a path outside exists is never looked at, so a refusal cannot tell."""
    if not isinstance(name, str) or not name or "\0" in name or os.path.isabs(name):
        return None
    try:
        target = (Path(folder) / name).resolve()
    except (OSError, RuntimeError):             # a loop of symlinks
        return None
    if not any(target.is_relative_to(root) for root in (roots or (Path(folder).resolve(),))):
        return None
    return target


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


def read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of a plain file of at most `limit` bytes. Anything else is refused with
    ValueError before more than `limit` bytes are read: a device (a symlink to
    /dev/zero never ends), a pipe (opened without waiting for a writer), a folder, or a
    larger file. A missing file raises OSError as open() does."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"is {file_kind(info.st_mode)}, not a plain file")
        if info.st_size > limit:
            raise ValueError(f"is {info.st_size:,} bytes, more than the {limit:,} it may be")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:                       # it grew while being read
        raise ValueError(f"is more than the {limit:,} bytes it may be")
    return data


# What a path may be besides a plain file (stat's file types), so that a refusal names
# what it found: a pipe or a device is not a typo.
FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe"),
              (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
              (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """What a stat mode is: "a plain file", "a folder", "a named pipe", ..."""
    if stat.S_ISREG(mode):
        return "a plain file"
    return next((name for test, name in FILE_KINDS if test(mode)), "a special file")


def odd_kind(path: Path) -> str | None:
    """What stands at `path` where a plain file belongs ("a folder", "a named pipe", ...),
    found by stat alone, never by opening it: opening a pipe waits for a writer. None
    where a plain file (symlinks followed) or nothing is there."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):               # missing, a dangling link, a NUL in the name
        return None
    return None if stat.S_ISREG(mode) else file_kind(mode)


def open_plain(path: Path):
    """`path` opened for reading in binary when it is a plain file (symlinks followed);
    anything else is refused with ValueError naming what it is, before a byte is read
    and without waiting: a pipe is opened without waiting for a writer, as in
    read_bounded. A missing file raises OSError as open() does."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"is {file_kind(mode)}, not a plain file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def parse_json_object(data: bytes) -> dict:
    """A JSON object from bytes, or ValueError saying why not: not UTF-8, not JSON,
    nested too deeply for the parser, or a JSON value that is not an object."""
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("is not UTF-8 text") from None
    except RecursionError:
        raise ValueError("is nested too deeply to be a JSON file of this kind") from None
    except ValueError as err:
        raise ValueError(f"is not JSON ({err})") from None
    if not isinstance(value, dict):
        kind = {type(None): "null", bool: "true or false", list: "list", str: "string",
                int: "number", float: "number"}.get(type(value), type(value).__name__)
        raise ValueError(f"holds a JSON {kind}, not an object")
    return value


def read_json(path: Path, limit: int = JSON_LIMIT) -> dict | None:
    """A JSON object from a file, or None when the file is missing, unreadable, not a
    plain file, larger than `limit`, not UTF-8, not JSON, or holds something other than
    an object."""
    try:
        return parse_json_object(read_bounded(path, limit))
    except (OSError, ValueError):
        return None


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write `data` so that `path` holds either its old contents or all of the new: a
    process killed part-way, or a full disk, never leaves half a file behind."""
    path = Path(path)
    prefix = f".{path.name}.tmp-"
    remove_stale(path.parent, prefix)     # what a killed write of this file left behind
    tmp = path.with_name(f"{prefix}{os.getpid()}")
    try:
        # Made afresh: a link left under the temporary name is removed, never written through.
        tmp.unlink(missing_ok=True)
        tmp.write_bytes(data)
        fsync(tmp)
        os.replace(tmp, path)
    except BaseException as failed:
        with contextlib.suppress(OSError):  # a full disk leaves no half-written file behind
            tmp.unlink(missing_ok=True)
        if isinstance(failed, OSError) and failed.filename in (str(tmp), None):
            # say the file the user asked for, not the temporary name they never gave (a
            # full disk's error from write() names no file at all)
            raise OSError(failed.errno, failed.strerror, str(path)) from None
        raise


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


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
    # Never through a symbolic link: the lock's pid is written into the file it opens,
    # which must be the folder's own (ELOOP where `path` is a link).
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OSError(err.errno, "a symbolic link where a lock file belongs (remove the "
                          "link)", str(path)) from None
        raise
    f = os.fdopen(fd, "r+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        f.close()
        return None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
    except OSError as err:                # a full disk's write names no file
        f.close()
        raise OSError(err.errno, err.strerror, str(path)) from None
    return f


def lock_holder(path: Path) -> str:
    try:
        return Path(path).read_text().strip() or "?"
    except OSError:
        return "?"


def file_in_the_way(path) -> Path | None:
    """The file standing at `path`, or at the nearest of the folders above it that
    exists: where a folder is to be made, that file stops it, and naming it says what to
    move (for FILE/sub, FILE)."""
    path = Path(path)
    nearest = next((p for p in [path, *path.parents] if p.exists()), None)
    return nearest if nearest is not None and not nearest.is_dir() else None


@contextlib.contextmanager
def removed_if_left_empty(path):
    """`path` and the folders above it that are not there yet: those made inside the
    block and left empty when it ends (a command refused its input after making its
    --out, or was stopped before writing) are removed, so a refusal leaves nothing
    behind. A folder with anything in it is kept (rmdir removes only an empty one)."""
    path = Path(path)
    made = [folder for folder in (path, *path.parents) if not folder.exists()]
    try:
        yield path
    finally:
        for folder in made:                     # the deepest first
            try:
                folder.rmdir()
            except OSError:                     # not empty, or not made after all
                break


def writable_folder(path, option: str = "--out") -> Path:
    """`path` as a folder this process can write into, created if missing, checked before
    any long work starts so that a bad `option` cannot lose what the work measured."""
    from common.errors import ConfigError
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{option} {path} is a file, not a folder: give a folder to write into")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"{option} {path} cannot be written ({err.strerror or err}): "
                          "give a folder you can write into") from None
    return path
