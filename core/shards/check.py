"""Checked opening of Arrow token shards: no reader uses a shard whose bytes differ from ``shards/index.parquet``.

A run dir is data from whoever made it, and a flipped byte in a shard's token data still parses: the ids are
just wrong (65348 in a vocabulary of 300). So every reader (the loader, ``shards stats``/``sample``, the
``sequences`` view, the ``datasets`` bridge) opens a shard through :func:`open_checked_shard` or
:func:`checked_shard_path`, which compare the file's sha256 with the index row and refuse it in one line naming
the shard and ``tokenmill shards verify``. The pack stage asks :func:`shard_intact` before it skips a pair.
A file is hashed once per version (:mod:`core.files.digests`).
"""

from __future__ import annotations

from pathlib import Path

from core.errors import ShardFormatError
from core.files.digests import file_sha256
from core.shards.store import ShardInfo, ShardTokens

FAULTS = {"differs": "its sha256 differs from shards/index.parquet (changed or damaged since it was written)",
          "missing": "missing, listed in shards/index.parquet (deleted since it was written)",
          "unlisted": "not listed in shards/index.parquet, so its bytes cannot be checked"}
"""What :func:`damaged_shard_message` says is wrong with a shard."""


def damaged_shard_message(path: Path | str, run_dir: Path | str, fault: str = "differs") -> str:
    """The one line a reader refuses a shard with: which shard, what is wrong (a key of FAULTS), what to run."""
    return (f"{path}: {FAULTS[fault]}; nothing was read from it: "
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
    """The shard ``info`` names, memory-mapped (:class:`core.shards.store.ShardTokens`), once its format and its bytes
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
    """:func:`open_checked_shard` for every row, in order (those opened are closed when one is refused)."""
    shards: list[ShardTokens] = []
    try:
        for info in infos:
            shards.append(open_checked_shard(run_dir, info))
    except BaseException:
        for shard in shards:
            shard.close()
        raise
    return shards


def shard_intact(run_dir: Path, info: ShardInfo) -> bool:
    """Whether the shard ``info`` names is on disk with the bytes the index recorded (the pack stage's skip check)."""
    path = Path(run_dir) / info.path
    return path.is_file() and not path.is_symlink() and file_sha256(path) == info.sha256
