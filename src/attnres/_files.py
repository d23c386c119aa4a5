"""The one reader and the one writer for the files attnres reads and writes.

Reading (:func:`read_bounded`): a pipeline or trace file is a regular file of a
few kilobytes. Anything else -- a FIFO, a character or block device, a socket,
a directory -- is refused before a byte is read (a FIFO is opened without
waiting for a writer), and a regular file is read up to :data:`MAX_INPUT_BYTES`
and refused past it. Symlinks are followed.

Writing (:func:`atomic_write_text`), shared by ``explain``/``plan --trace-out``,
``replay --update`` and ``make golden``:

- a path that names nothing, or a regular file, is written atomically: a
  temporary file ``.NAME.attnres-PID-XXXXXXXX.tmp`` in the same folder, then a
  rename over ``NAME``. A new file's mode follows the umask; a rewritten file
  keeps its mode.
- a symlink is followed: the regular file it points to is rewritten in place
  of its own folder (the link stays a link). A dangling symlink is refused.
- a character device or a FIFO (``/dev/null``, ``/dev/stdout``, a named pipe
  with a reader) is written through, never replaced; a FIFO without a reader
  is refused rather than waited on.
- a directory, block device or socket is refused.

Every refusal is an :class:`OSError` whose ``strerror`` says what the path is
and why it is refused. Temporary files of this naming pattern left behind by a
killed process (SIGKILL, power loss) are swept from the folder the next time
attnres writes there.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from attnres.errors import InvalidArgumentError

__all__ = [
    "MANIFEST_NAME",
    "MAX_HEADER_BYTES",
    "MAX_INPUT_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_JSON_INT_DIGITS",
    "atomic_write_text",
    "check_manifest",
    "exclusive_lock",
    "parse_json",
    "read_bounded",
    "read_json",
    "read_safetensors_header",
    "write_manifest",
]

#: The most bytes attnres reads from one pipeline or trace file (4 MiB).
MAX_INPUT_BYTES = 4 * 1024 * 1024

#: The most bytes of a safetensors header attnres reads (its JSON, not the tensors).
MAX_HEADER_BYTES = 64 * 1024 * 1024
#: JSON read by :func:`read_json` nests at most this deep (configs nest 2-4 levels).
MAX_JSON_DEPTH = 64
#: ... and holds no integer of more digits than this (2**64 has 20).
MAX_JSON_INT_DIGITS = 40

#: Our temporary files: ``.NAME.attnres-PID-RANDOM.tmp``.
_TEMP_RE = re.compile(r"^\..+\.attnres-(\d+)-[0-9a-f]{8}\.tmp\Z")
#: A temporary file of a process that is gone is debris at once; one of a live
#: process (or one another host wrote) only after this long.
_STALE_AFTER_S = 3600.0
_swept: set[str] = set()
#: open never waits on a FIFO (or a device), and no child process inherits the descriptor
_NONBLOCK = getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _not_regular(path: str, mode: int, why: str) -> OSError:
    """The refusal of ``path``, which is not a regular file: says what it is, and
    ``why`` that is refused (a directory's is an :class:`IsADirectoryError`, as
    :class:`OSError` itself picks for ``EISDIR``)."""
    code = errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL
    return OSError(code, f"it is {_kind(mode)}; {why}", path)


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):g} MiB"


def _encodable(path: str) -> str:
    """``path``, if it names a file the file system can encode; an :class:`OSError`
    saying why not otherwise (an empty path, or a lone surrogate such as
    ``"\\ud800"``: Python's own ``UnicodeEncodeError`` names no file; issue 32
    item 16)."""
    if path == "":
        raise OSError(errno.ENOENT, "an empty path names no file", path)
    try:
        os.fsencode(path)
    except UnicodeEncodeError as exc:
        raise OSError(
            errno.EINVAL,
            f"the path holds {path[exc.start : exc.end]!r} at character {exc.start}, which no "
            f"file name can hold (a lone surrogate); name the file in valid text",
            path,
        ) from None
    return path


def _open_regular(source: str, what: str) -> tuple[int, os.stat_result]:
    """An open descriptor of the regular file ``source`` (never waits on a FIFO)."""
    _encodable(source)
    try:
        fd = os.open(source, os.O_RDONLY | _NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(
                exc.errno, "it is a symlink loop (too many levels of symbolic links)", source
            ) from None
        if exc.errno == errno.ENOENT and os.path.islink(source):
            raise OSError(
                exc.errno, f"a symlink to {os.readlink(source)!r}, which does not exist", source
            ) from None
        if exc.errno == errno.ENAMETOOLONG:
            raise OSError(exc.errno, "the file name is too long", source) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(source, st.st_mode, f"a {what} must be a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _read_upto(fd: int, n: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while total < n:
        chunk = os.read(fd, min(1 << 20, n - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def read_bounded(path: str | os.PathLike[str], *, what: str, limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    ``what`` names the kind of file in messages ("trace file"). Raises
    :class:`OSError` (``strerror`` says why) for anything that is not a regular
    file or that is larger than ``limit``.
    """
    source = os.fspath(path)
    fd, st = _open_regular(source, what)
    try:
        if st.st_size > limit:
            raise OSError(
                errno.EFBIG,
                f"it is {st.st_size} bytes, over the {_mib(limit)} limit for a {what}",
                source,
            )
        data = _read_upto(fd, limit + 1)
        if len(data) > limit:
            raise OSError(
                errno.EFBIG, f"it holds more than the {_mib(limit)} limit for a {what}", source
            )
        return data
    finally:
        os.close(fd)


def _json_constant(name: str) -> Any:
    raise InvalidArgumentError(f"{name} is not valid JSON")


def _json_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_JSON_INT_DIGITS:
        raise InvalidArgumentError(
            f"an integer of {digits} digits (attnres reads none longer than {MAX_JSON_INT_DIGITS})"
        )
    return int(text)


def _json_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidArgumentError(f"the number {text} is out of range (not a finite float)")
    return value


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:  # json's own dict keeps the last one, silently
            raise InvalidArgumentError(
                f"the key {json.dumps(key, ensure_ascii=True)} appears twice in one object "
                f"(JSON readers disagree on which one counts); keep one"
            )
        out[key] = value
    return out


def parse_json(data: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse bounded JSON: UTF-8, no NaN/Infinity, no number out of float range, no
    integer of more than :data:`MAX_JSON_INT_DIGITS` digits, no key twice in one
    object, nesting at most ``max_depth`` deep. Every refusal is a
    :class:`ValueError` saying why."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(
            f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})"
        ) from None
    try:
        doc = json.loads(
            text,
            object_pairs_hook=_json_object,
            parse_constant=_json_constant,
            parse_int=_json_int,
            parse_float=_json_float,
        )
    except RecursionError:
        raise InvalidArgumentError(f"nested more than {max_depth} levels deep") from None
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"not valid JSON: {exc}") from None
    # iterative: a document just under the parser's own limit must not recurse here
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth > max_depth:
                raise InvalidArgumentError(f"nested more than {max_depth} levels deep")
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
    return doc


def read_json(
    path: str | os.PathLike[str],
    *,
    what: str,
    limit: int = MAX_INPUT_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
) -> Any:
    """The JSON document in the regular file ``path`` (:func:`read_bounded`, then
    :func:`parse_json`). :class:`OSError` for the file, :class:`ValueError` for
    its content; neither names the path (the caller does)."""
    return parse_json(read_bounded(path, what=what, limit=limit), max_depth=max_depth)


def read_safetensors_header(path: str | os.PathLike[str], *, limit: int = MAX_HEADER_BYTES) -> Any:
    """The JSON header of the safetensors file ``path``; never a tensor byte.

    The file is a little-endian u64 length, that many bytes of JSON, then the
    tensors. The length must fit in the file and in ``limit``; the header must
    be a JSON object (:func:`parse_json`). :class:`OSError` for the file,
    :class:`ValueError` for its content.
    """
    source = os.fspath(path)
    what = "safetensors file"
    fd, st = _open_regular(source, what)
    try:
        head = _read_upto(fd, 8)
        if len(head) < 8:
            raise InvalidArgumentError(f"{len(head)} bytes: too short to be a safetensors file")
        length = int.from_bytes(head, "little")
        if length > limit:
            raise InvalidArgumentError(
                f"its header of {length} bytes is over the {_mib(limit)} limit for a "
                f"safetensors header"
            )
        if 8 + length > st.st_size:
            raise InvalidArgumentError(
                f"its header claims {length} bytes, but the file holds {st.st_size} in all "
                f"(truncated, or not a safetensors file)"
            )
        raw = _read_upto(fd, length)
    finally:
        os.close(fd)
    header = parse_json(raw)
    if not isinstance(header, dict):
        raise InvalidArgumentError(f"its header is a JSON {type(header).__name__}, not an object")
    return header


@contextlib.contextmanager
def exclusive_lock(target: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive lock on ``target`` for a read-merge-write of it.

    The lock is ``flock`` on a sibling file ``.NAME.attnres.lock`` (the target
    itself is replaced by every write, so it cannot carry the lock); the lock
    file stays, empty. Processes on one host (and on file systems that honour
    ``flock``) take turns; where ``fcntl`` does not exist, no lock is taken.
    """
    real = Path(os.path.realpath(os.fspath(target)))
    folder = real.parent
    _make_parents(folder)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    lock = folder / f".{real.name}.attnres.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "the lock file is not a regular file", str(lock))
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


# =============================================================================
# Writing
# =============================================================================


def _sweep(folder: Path) -> None:
    """Remove our own temporary files that a killed process left in ``folder``."""
    key = os.path.abspath(folder)
    if key in _swept:
        return
    _swept.add(key)
    now = time.time()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        m = _TEMP_RE.match(entry.name)
        if m is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                continue
            if _alive(int(m.group(1))) and now - st.st_mtime < _STALE_AFTER_S:
                continue
            os.unlink(entry.path)
        except OSError:
            continue


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True


def _make_parents(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        # mkdir says "File exists" when a parent is a file: name the file instead
        for parent in [*reversed(folder.parents), folder]:
            if parent.exists() and not parent.is_dir():
                raise NotADirectoryError(
                    errno.ENOTDIR, f"not a directory: {str(parent)!r} is a file", str(folder)
                ) from None
        raise


def _write_through(target: str, text: str, kind: str) -> None:
    try:
        fd = os.open(target, os.O_WRONLY | _NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise OSError(
                exc.errno,
                f"it is {kind} that no process is reading; attnres does not wait for one",
                target,
            ) from None
        raise
    try:
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        data = text.encode("utf-8")
        while data:
            n = os.write(fd, data)
            data = data[n:]
    finally:
        os.close(fd)


def atomic_write_text(target: Path, text: str) -> None:
    """Write ``text`` (UTF-8, ``\\n`` line ends) to ``target`` (see the module doc).

    A reader sees the old file or the new one, never a half-written one. An
    interruption (an exception, ``KeyboardInterrupt``, the CLI's SIGTERM) removes
    the temporary file before it propagates.
    """
    path = os.fspath(target)
    _encodable(path)
    try:
        st = os.stat(path)  # follows symlinks, /dev/stdout included
    except FileNotFoundError:
        if os.path.islink(path):
            raise OSError(
                errno.ENOENT,
                f"it is a symlink to {os.readlink(path)!r}, which does not exist; attnres "
                "follows symlinks only to an existing file",
                path,
            ) from None
        st = None
    except NotADirectoryError:
        parent = Path(path).parent
        _make_parents(parent)
        raise
    if st is not None and not stat.S_ISREG(st.st_mode):
        if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode):
            _write_through(path, text, _kind(st.st_mode))
            return
        raise _not_regular(path, st.st_mode, "attnres replaces only regular files")
    real = Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)
    folder = real.parent
    _make_parents(folder)
    _sweep(folder)
    tmp = folder / f".{real.name}.attnres-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        if st is not None:
            os.fchmod(fd, stat.S_IMODE(st.st_mode))  # a rewritten file keeps its mode
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# =============================================================================
# The manifest of a trace folder (``plan --trace-out DIR``)
# =============================================================================

#: Written into a folder of traces: first as "incomplete", last with every file.
MANIFEST_NAME = "attnres.manifest"
_MANIFEST_SCHEMA = 1


def write_manifest(folder: Path, written_by: str, files: Sequence[str] | None = None) -> None:
    """Mark ``folder`` as being written (``files`` ``None``: an interrupted run leaves
    this mark), or complete, listing the trace files written (written last)."""
    doc = {
        "attnres_manifest": _MANIFEST_SCHEMA,
        "complete": files is not None,
        "written_by": written_by,
        "files": sorted(files or ()),
    }
    atomic_write_text(folder / MANIFEST_NAME, json.dumps(doc, indent=2, sort_keys=True) + "\n")


def check_manifest(folder: Path) -> list[tuple[str, str]]:
    """Problems with ``folder``'s manifest, as ``(path, message)``; none without one.

    A manifest still marked incomplete means the writer was interrupted; a
    complete one must list only files that exist.
    """

    path = folder / MANIFEST_NAME
    if not os.path.lexists(path):
        return []
    where = str(path)
    try:
        doc = read_json(path, what="manifest")
    except OSError as exc:
        return [(where, f"cannot read the manifest: {exc.strerror or exc}")]
    except ValueError as exc:
        return [(where, f"not a valid attnres manifest: {exc}")]
    files = doc.get("files") if isinstance(doc, dict) else None
    if (
        not isinstance(doc, dict)
        or doc.get("attnres_manifest") != _MANIFEST_SCHEMA
        or not isinstance(doc.get("complete"), bool)
        or not isinstance(files, list)
        or not all(isinstance(f, str) and f and "/" not in f and f != ".." for f in files)
    ):
        return [(where, "not a valid attnres manifest (schema 1: complete, files, written_by)")]
    writer = doc.get("written_by") or "attnres"
    if not doc["complete"]:
        return [
            (
                str(folder),
                f"incomplete: {writer} began writing this folder and did not finish "
                f"(interrupted or killed), so trace files may be missing; write it again",
            )
        ]
    out = [
        (str(folder / name), f"listed in {MANIFEST_NAME} but missing: the folder is incomplete")
        for name in files
        if not os.path.lexists(folder / name)
    ]
    # issue 20 item 15: a trace the last run did not write is stale (left by an
    # earlier plan of another pipeline or platform); it must not replay as ok
    listed = set(files)
    try:
        present = sorted(e.name for e in os.scandir(folder) if e.name.endswith(".json"))
    except OSError:
        present = []
    out += [
        (
            str(folder / name),
            f"not listed in {MANIFEST_NAME}: left by an earlier run, not written by {writer}; "
            f"delete it or write the folder again into an empty one",
        )
        for name in present
        if name not in listed
    ]
    return out
