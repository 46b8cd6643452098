"""Checked opening of Arrow token shards: no reader uses a shard whose bytes differ from ``shards/index.parquet``.

A run dir is data from whoever made it, and a flipped byte in a shard's token data still parses: the ids are
just wrong (65348 in a vocabulary of 300). So every reader (the loader, ``shards stats``/``sample``, the
``sequences`` view, the ``datasets`` bridge) opens a shard through :func:`open_checked_shard` or
:func:`checked_shard_path`, which compare the file's sha256 with the index row and refuse it in one line naming
the shard and ``tokenmill shards verify``. The pack stage asks :func:`shard_intact` before it skips a pair.

Hashing costs one read of the file (~1 GB/s), so a digest is computed once per *file version* and remembered:
in this process, and in a small JSON file outside every run dir (``$XDG_CACHE_HOME/tokenmill/shard-digests.json``).
A version is (device, inode, size, mtime, ctime, real path): any write to the file, a rename over it, a copy, or
even resetting its mtime with ``utime`` changes its ctime, which no user can set, so a remembered digest always
belongs to the very bytes on disk. The cache holds only hex digests keyed by that text; nothing in it is code,
and a missing, unreadable or odd cache only costs a hash.
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

from core.atomic import TEMP_PREFIX
from core.errors import ShardFormatError
from core.shards import ShardInfo, ShardTokens

CACHE_FILE_NAME = "shard-digests.json"
CACHE_VERSION = 1
MAX_CACHED_DIGESTS = 20_000
"""Entries kept in the cache file (the newest): ~3 MB of JSON, and a run's shards number in the thousands."""
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")

_LOCK = threading.Lock()
_digests: dict[str, str] | None = None  # file version -> sha256, loaded from the cache file on first use
_unsaved = False


FAULTS = {"differs": "its sha256 differs from shards/index.parquet",
          "missing": "missing, listed in shards/index.parquet",
          "unlisted": "not listed in shards/index.parquet"}
"""What :func:`damaged_shard_message` says is wrong with a shard."""


def damaged_shard_message(path: Path | str, run_dir: Path | str, fault: str = "differs") -> str:
    """The one line a reader refuses a shard with: which shard, what is wrong (a key of FAULTS), what to run."""
    return (f"{path}: {FAULTS[fault]} (changed or damaged since it was written); nothing was read from it: "
            f"`tokenmill shards verify {run_dir}` lists every damaged shard, and `tokenmill prepare` with the "
            "run's recipe writes them again.")


def check_digest(path: Path | str, digest: str, expected: str, run_dir: Path | str) -> None:
    """ShardFormatError (:func:`damaged_shard_message`) unless ``digest`` (of the bytes read) is ``expected``."""
    if digest != expected:
        raise ShardFormatError(damaged_shard_message(path, run_dir))


def checked_shard_path(run_dir: Path, info: ShardInfo) -> Path:
    """The path of the shard ``info`` (an index row) names, once its bytes are those the index recorded.

    Raises ShardFormatError naming the shard when it is missing or its sha256 differs from ``info.sha256``.
    """
    path = Path(run_dir) / info.path
    if not path.is_file():
        raise ShardFormatError(damaged_shard_message(path, run_dir, "missing"))
    check_digest(path, file_sha256(path), info.sha256, run_dir)
    return path


def open_checked_shard(run_dir: Path, info: ShardInfo) -> ShardTokens:
    """The shard ``info`` names, memory-mapped (:class:`core.shards.ShardTokens`), once its format and its bytes
    are checked: ShardFormatError naming the shard otherwise (unreadable, other format, sha256 differs)."""
    path = Path(run_dir) / info.path
    if not path.is_file():
        raise ShardFormatError(damaged_shard_message(path, run_dir, "missing"))
    shard = ShardTokens(path)  # the format first: a truncated file is named as such
    try:
        checked_shard_path(run_dir, info)
    except BaseException:
        shard.close()
        raise
    return shard


def open_checked_shards(run_dir: Path, infos: list[ShardInfo]) -> list[ShardTokens]:
    """:func:`open_checked_shard` for every row, in order; the digests learnt are saved once at the end."""
    shards: list[ShardTokens] = []
    try:
        for info in infos:
            shards.append(open_checked_shard(run_dir, info))
    except BaseException:
        for shard in shards:
            shard.close()
        raise
    finally:
        save_digest_cache()
    return shards


def shard_intact(run_dir: Path, info: ShardInfo) -> bool:
    """Whether the shard ``info`` names is on disk with the bytes the index recorded (the pack stage's skip check)."""
    path = Path(run_dir) / info.path
    return path.is_file() and not path.is_symlink() and file_sha256(path) == info.sha256


def file_sha256(path: Path, *, trust_cache: bool = True) -> str:
    """Hex sha256 of ``path``'s bytes, hashed once per file version (see the module docstring).

    ``trust_cache=False`` hashes the bytes whatever is remembered (``shards verify``) and remembers the result.
    A file that changes while it is hashed is not remembered.
    """
    global _unsaved
    before = _file_version(path)
    digests = _known_digests()
    if trust_cache and before in digests:
        return digests[before]
    digest = sha256_mapped(path)
    if _file_version(path) == before:
        with _LOCK:
            digests[before] = digest
            _unsaved = True
    return digest


def sha256_mapped(path: Path) -> str:
    """Hex sha256 of a file's bytes, hashed through a read-only memory map: the readers promise no copy of the
    tokens in Python memory, and reading in chunks would allocate one (1 MB) per chunk."""
    with open(path, "rb") as handle:
        if not os.fstat(handle.fileno()).st_size:
            return hashlib.sha256().hexdigest()
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return hashlib.sha256(mapped).hexdigest()


def save_digest_cache() -> None:
    """Write the digests learnt in this process to the cache file (atomically, merged with what it holds)."""
    global _unsaved
    with _LOCK:
        if not _unsaved or _digests is None:
            return
        cache = _cache_path()
        merged = {**_read_cache(cache), **_digests}
        kept = dict(list(merged.items())[-MAX_CACHED_DIGESTS:])
        partial = cache.with_name(f"{TEMP_PREFIX}{cache.name}.{os.getpid()}.{threading.get_ident()}")
        with contextlib.suppress(OSError):  # only an optimisation: a read-only home costs a hash next time
            cache.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({"version": CACHE_VERSION, "digests": kept}), encoding="utf-8")
            os.replace(partial, cache)
        partial.unlink(missing_ok=True)
        _unsaved = False


def forget_digests() -> None:
    """Drop what this process remembers (tests: the next open reads the cache file again)."""
    global _digests, _unsaved
    with _LOCK:
        _digests, _unsaved = None, False


def _file_version(path: Path) -> str:
    stat = os.stat(path)
    return (f"{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}:"
            f"{os.path.realpath(path)}")


def _known_digests() -> dict[str, str]:
    global _digests
    with _LOCK:
        if _digests is None:
            _digests = _read_cache(_cache_path())
        return _digests


def _cache_path() -> Path:
    """``$XDG_CACHE_HOME/tokenmill/shard-digests.json`` (``~/.cache`` by default): outside every run dir."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenmill" / CACHE_FILE_NAME


def _read_cache(path: Path) -> dict[str, str]:
    """The cache file's ``{file version: digest}``; only str keys and 64-hex values are taken, anything else is {}."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict) or record.get("version") != CACHE_VERSION or not isinstance(
            record.get("digests"), dict):
        return {}
    return {key: value for key, value in record["digests"].items()
            if isinstance(key, str) and isinstance(value, str) and _HEX_DIGEST.fullmatch(value)}
