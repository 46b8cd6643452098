"""A run dir in a bucket -> a local, deletable mirror of it, for the commands that need files on disk.

``tokenmill query`` reads a bucket directly (:mod:`pipeline.sql.remote_run`). ``shards verify|stats|sample`` and
``report`` memory-map shards, hash them and write the report, so they run on a mirror under
``$XDG_CACHE_HOME/tokenmill/runs/<bucket>/<prefix>`` (``~/.cache`` by default): only the keys whose size or ETag
changed since the last mirror are fetched, keys gone from the bucket are removed, and checkpoint and model
weights are left out (``SKIPPED_PREFIXES``: gigabytes no such command reads). Deleting the mirror loses nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

from core.bucket.url import object_and_folder
from core.errors import ObjectStoreError, RunDirError
from core.files.atomic import TEMP_PREFIX
from core.layout import MIRROR_STATE_SUFFIX, UNMIRRORED_FOLDERS
from pipeline.objects import ObjectPath, checked_url, object_errors, object_version

SKIPPED_PREFIXES = UNMIRRORED_FOLDERS
"""Keys not mirrored (weights); their small JSON files are, so the report still lists the checkpoints."""
STATE_SUFFIX = MIRROR_STATE_SUFFIX
"""``<mirror>.mirror.json`` beside the mirror (not in it: the run dir stays as tokenmill wrote it):
``{key: [size, version]}`` of what the mirror holds."""


def mirror_root(url: str) -> Path:
    """Where the mirror of ``url`` lives: ``$XDG_CACHE_HOME/tokenmill/runs/<bucket>/<prefix>``."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    parts = PurePosixPath(url.split("://", 1)[1].strip("/")).parts
    if not parts or any(part in ("..", ".") for part in parts):
        raise ObjectStoreError(f"{url}: not a run dir URL; give s3://bucket/runs/NAME")
    return cache.joinpath("tokenmill", "runs", url.split("://", 1)[0], *parts)


def mirror_run(url: str) -> Path:
    """The local mirror of the run dir at ``url``, brought up to date; ObjectStoreError when nothing is there."""
    root = ObjectPath(checked_url(url, "run dir").rstrip("/"))
    fs, base = root.filesystem()
    with object_errors(url):
        listed = fs.find(base, detail=True)
    wanted = {}
    for key, info in listed.items():
        rel = key[len(base) + 1:]
        if not key.startswith(base + "/") or _skipped(rel):
            continue
        if PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts:
            raise ObjectStoreError(f"{url}: key {rel!r} climbs out of the run dir; remove it from the bucket")
        wanted[rel] = [int(info.get("size") or 0), object_version(info)]
    if (clash := object_and_folder(set(wanted))) is not None:
        raise RunDirError(f"{url}: key {clash[0]!r} is an object and also a folder of others ({clash[1]!r}); a run "
                          "dir holds a file or a folder there, not both: remove one of them from the bucket")
    if not wanted:
        raise ObjectStoreError(f"{url}: no run dir there (no objects under that prefix); give the prefix a "
                               "tokenmill run was uploaded to, e.g. s3://bucket/runs/NAME.")
    local = mirror_root(url)
    state_path = local.with_name(local.name + STATE_SUFFIX)
    held = json.loads(state_path.read_text()) if state_path.is_file() else {}
    for rel in sorted(set(held) - set(wanted)):
        (local / rel).unlink(missing_ok=True)
    for rel, stamp in sorted(wanted.items()):
        target = local / rel
        if held.get(rel) == stamp and target.is_file():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        _fetch(fs, f"{base}/{rel}", target, f"{url}/{rel}")
    state_path.parent.mkdir(parents=True, exist_ok=True)
    state_path.write_text(json.dumps(wanted))
    return local


def _fetch(fs: Any, key: str, target: Path, url: str) -> None:
    """Download ``key`` beside ``target`` under a temporary name, then rename: a download cut short (the store
    went away mid-object, after s3fs's retries) leaves no partial file behind, and the mirror's state is written
    only once every key is in, so the next mirror fetches the rest. ObjectStoreError, one line, on failure."""
    partial = target.with_name(f"{TEMP_PREFIX}{target.name}")
    try:
        with object_errors(url):
            fs.get_file(key, str(partial))
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)


def _skipped(rel: str) -> bool:
    return rel.startswith(SKIPPED_PREFIXES) and not rel.endswith(".json")
