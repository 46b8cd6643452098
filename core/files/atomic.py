"""Atomic file helpers: every artifact is written to a temporary name in its folder, then renamed."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from core.errors import OutOfSpaceError, UnwritableError
from core.files.fence import check_fence
from core.files.path_limits import NAME_MAX_BYTES

TEMP_PREFIX = ".tmp-"
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
UNWRITABLE_ERRNOS = {
    errno.EROFS: ("a read-only file system", "use another run dir (--run-dir) on a writable file system"),
    errno.EACCES: ("permission denied", "make it writable, or use another run dir (--run-dir)"),
    errno.EPERM: ("operation not permitted", "make it writable, or use another run dir (--run-dir)"),
    errno.ENOTDIR: ("a part of the path is a file, not a folder",
                    "move that file out of the way, or use another run dir (--run-dir)"),
    errno.EEXIST: ("a file is in the way where a folder must be",
                   "move that file out of the way, or use another run dir (--run-dir)"),
    errno.ENOENT: ("nothing can be created there", "use another run dir (--run-dir) on a writable file system"),
    errno.ENAMETOOLONG: ("the path is too long", "use a shorter run dir (--run-dir)"),
    errno.EISDIR: ("a folder is in the way where a file must be",
                   "move that folder out of the way, or use another run dir (--run-dir)"),
    errno.ELOOP: ("the path loops through symbolic links", "fix the link, or use another run dir (--run-dir)"),
}
"""Why a folder cannot be made or written, and what to do, by errno: the user's to fix (another path, permissions)."""


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], size_hint_bytes: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it and rename it over ``path``.

    Readers never see a half-written file: on an exception the temporary file is removed and
    ``path`` keeps its previous content (or stays absent). A write that fails for lack of room raises
    OutOfSpaceError naming ``path`` (and ``size_hint_bytes``, the writer's estimate of the room it needs); a folder
    that cannot be made or written (read-only, no permission, a file in the way) raises UnwritableError.
    """
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=TEMP_PREFIX + target.name + ".", dir=target.parent)
    except OSError as err:
        raise (unwritable(err, target.parent) or out_of_space(err, target, size_hint_bytes) or err) from err
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; artifacts are meant to be shared with the data team
        check_fence()
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno in NO_SPACE_ERRNOS:
            raise OutOfSpaceError(no_space_message(target, err.errno, size_hint_bytes)) from err
        if isinstance(err, OSError) and err.errno == errno.EISDIR and err.filename2 is not None \
                and os.fspath(err.filename2) == os.fspath(target):
            raise (unwritable(err, target) or err) from err  # the rename: a folder is where the file goes
        raise


def replace_folder(source: Path, target: Path) -> None:
    """Rename the complete folder ``source`` to ``target``, replacing an existing ``target`` (moved aside first,
    then deleted); both in one folder. Fenced (:func:`core.files.fence.check_fence`) like every write here."""
    old = target.with_name(f"{TEMP_PREFIX}old-{target.name}")
    check_fence()
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
    source.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def remove_folder(folder: Path) -> None:
    """Delete ``folder`` and everything in it (an old checkpoint pruned); fenced like every write here."""
    check_fence()
    shutil.rmtree(folder)


def unwritable(err: OSError, folder: Path) -> UnwritableError | None:
    """The UnwritableError for a failure to make or write into ``folder`` that the user must fix, else None.

    One line: the folder, why (read-only, permission, a file in the way, …) and what to do.
    """
    if err.errno not in UNWRITABLE_ERRNOS:
        return None
    reason, fix = UNWRITABLE_ERRNOS[err.errno]
    culprit = err.filename2 if err.filename2 is not None else err.filename  # a rename names its target second
    if err.errno == errno.ENAMETOOLONG and (long_name := _too_long_name(culprit)) is not None:
        reason, fix = long_name, "use a shorter name"
    where = f": {culprit}" if culprit is not None and Path(culprit) != Path(folder) else ""
    return UnwritableError(f"{folder}: cannot write there ({reason}{where}); {fix}.")


def _too_long_name(path: str | bytes | None) -> str | None:
    """Which file name in ``path`` is longer than a file system allows (NAME_MAX), said in words; else None."""
    if path is None:
        return None
    limit = NAME_MAX_BYTES
    for name in Path(os.fsdecode(path)).parts:
        if len(os.fsencode(name)) > limit:
            return f"the file name {name[:20]!r}… is {len(os.fsencode(name))} bytes, above the {limit} a file " \
                   "system allows per name"
    return None


_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")


def out_of_space(err: BaseException, target: Path, needed_bytes: int | None = None) -> OutOfSpaceError | None:
    """The OutOfSpaceError for ``err`` when it is a failed write for lack of room, else None.

    Native writers report it in their own exception types: safetensors raises ``SafetensorError("... File
    too large (os error 27)")``, so the errno is read from the text when the exception has none.
    """
    number = err.errno if isinstance(err, OSError) else None
    if number is None and (match := _OS_ERROR_IN_TEXT.search(str(err))):
        number = int(match.group(1))
    if number not in NO_SPACE_ERRNOS:
        return None
    return OutOfSpaceError(no_space_message(Path(target), number, needed_bytes))


def no_space_message(target: Path, error_number: int, needed_bytes: int | None) -> str:
    """One line: which file could not be written, the room it needs (when known), what is free, what to do."""
    needs = f"it needs about {needed_bytes:,} bytes, " if needed_bytes is not None else ""
    free = shutil.disk_usage(target.parent).free
    return (f"{target}: no room to write it ({os.strerror(error_number)}): {needs}{free:,} bytes are free on that "
            "file system; free space (or lift the file-size limit, `ulimit -f`) and re-run: finished work is kept.")


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as pretty, key-sorted JSON (deterministic bytes) atomically."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON file written by :func:`write_json_atomic`."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def sha256_file(path: str | os.PathLike[str], chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes, read in chunks (bounded memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def remove_stale_temps(folder: str | os.PathLike[str]) -> int:
    """Delete temporary files/folders a killed writer left in ``folder``; return how many were removed."""
    root = Path(folder)
    if not root.is_dir():
        return 0
    removed = 0
    for leftover in root.rglob(TEMP_PREFIX + "*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)
        removed += 1
    return removed


def _fsync_dir(folder: Path) -> None:
    # A rename is durable only once its directory entry is flushed.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
