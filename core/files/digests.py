"""A file's sha256, hashed once per file version and remembered: what every shard reader checks a shard with
(:mod:`core.shards.check`), and what the shard writer (:mod:`core.shards.store`) records in the index.

Hashing costs one read of the file (~1 GB/s), so a digest is computed once per *file version* and remembered:
in this process, and outside every run dir in ``$XDG_CACHE_HOME/tokenmill/shard-digests/`` (one small JSON file
per version, named by the version's sha256: a lookup reads ~200 bytes, whatever else is cached). A version is
(device, inode, size, mtime, ctime, real path): any write to the file, a rename over it, a copy, or even
resetting its mtime with ``utime`` changes its ctime, which no user can set, so a remembered digest always
belongs to the very bytes on disk. An entry holds only that version text and a hex digest, read as JSON and
checked; nothing in it is code, and a missing, unreadable or odd entry only costs a hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import threading
from pathlib import Path

from core.files.atomic import TEMP_PREFIX

CACHE_FOLDER_NAME = "shard-digests"
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")

_LOCK = threading.Lock()
_digests: dict[str, str] = {}  # file version -> sha256: what this process hashed or read from the cache folder


def file_sha256(path: Path, *, trust_cache: bool = True) -> str:
    """Hex sha256 of ``path``'s bytes, hashed once per file version (see the module docstring).

    ``trust_cache=False`` hashes the bytes whatever is remembered (``shards verify``) and remembers the result.
    A file that changes while it is hashed is not remembered.
    """
    version = _file_version(path)
    if trust_cache:
        known = _remembered(version)
        if known is not None:
            return known
    digest = sha256_mapped(path)
    if _file_version(path) == version:
        _remember(version, digest)
    return digest


def sha256_mapped(path: Path) -> str:
    """Hex sha256 of a file's bytes, hashed through a read-only memory map: the readers promise no copy of the
    tokens in Python memory, and reading in chunks would allocate one (1 MB) per chunk."""
    with open(path, "rb") as handle:
        if not os.fstat(handle.fileno()).st_size:
            return hashlib.sha256().hexdigest()
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return hashlib.sha256(mapped).hexdigest()


def forget_digests() -> None:
    """Drop what this process remembers (tests: the next open asks the cache folder again)."""
    with _LOCK:
        _digests.clear()


def cache_folder() -> Path:
    """``$XDG_CACHE_HOME/tokenmill/shard-digests`` (``~/.cache`` by default): outside every run dir."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenmill" / CACHE_FOLDER_NAME


def _file_version(path: Path) -> str:
    stat = os.stat(path)
    return (f"{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}:"
            f"{os.path.realpath(path)}")


def _entry(version: str) -> Path:
    """The cache file of one file version: named by the version's sha256, so any path or name is a plain file name."""
    return cache_folder() / hashlib.sha256(version.encode("utf-8", "surrogateescape")).hexdigest()


def _remembered(version: str) -> str | None:
    """The digest remembered for ``version`` in this process or in the cache folder; None when there is none."""
    with _LOCK:
        if version in _digests:
            return _digests[version]
    try:
        record = json.loads(_entry(version).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    digest = record.get("sha256") if isinstance(record, dict) and record.get("version") == version else None
    if not isinstance(digest, str) or not _HEX_DIGEST.fullmatch(digest):
        return None  # another version's entry (a hash collision), or not one this module wrote
    with _LOCK:
        _digests[version] = digest
    return digest


def _remember(version: str, digest: str) -> None:
    """Keep ``digest`` in this process and in the cache folder (written atomically; a failure only costs a hash)."""
    with _LOCK:
        _digests[version] = digest
    entry = _entry(version)
    partial = entry.with_name(f"{TEMP_PREFIX}{entry.name}.{os.getpid()}.{threading.get_ident()}")
    with contextlib.suppress(OSError):  # a read-only or full home: the next process hashes again
        entry.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"version": version, "sha256": digest}), encoding="utf-8")
        os.replace(partial, entry)
    with contextlib.suppress(OSError):
        partial.unlink(missing_ok=True)
