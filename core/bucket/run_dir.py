"""A run dir in a bucket (``--run-dir s3://bucket/runs/NAME``): a local working copy, published back markers last.

The stages need files on disk (DuckDB spills, shards are memory-mapped, the tokenizer is loaded from a file), so
a command on a bucket run dir works on a *working copy* under ``$XDG_CACHE_HOME/tokenmill/work/s3/<bucket>/
<prefix>`` (``~/.cache`` by default), which may be deleted at any time:

1. :meth:`BucketRun.pull` makes the copy equal the bucket: only keys whose size or ETag changed are fetched
   (temporary name, then rename), files the bucket no longer holds are removed, and every shard fetched (or
   touched since) is checked against ``shards/index.parquet``'s sha256 before use.
2. The stages run on the copy exactly as on a local run dir (skip-if-done reads the markers pulled from the bucket).
3. :meth:`BucketRun.publish` uploads what changed in an order that keeps every stage's contract for a reader of
   the bucket: markers about to be replaced or dropped are deleted first; then the outputs; then the markers
   (``shards/index.parquet``, each checkpoint's ``manifest.json``, ``checkpoints/latest``, ``stages/**``,
   ``stages/sealed/**``, in that order); then keys the run removed (pruned checkpoints, manifest first). A PUT is
   atomic (an object is never visible half-written), so a marker in the bucket always has its outputs there.

The trainer publishes each checkpoint as it is saved (rank 0: :func:`publish_working_copy`) and, once its export is
written, the whole copy; the command publishes the rest when its flow ends, also when it failed or was interrupted
(what finished is kept, as locally).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from core.bucket.lock import LOCK_KEY, BucketLock, s3_client, split_url
from core.bucket.object_errors import object_errors
from core.bucket.url import object_and_folder
from core.errors import ObjectStoreError, RunDirError
from core.files.atomic import TEMP_PREFIX, write_text_atomic
from core.files.digests import file_sha256
from core.layout import CHECKPOINT_MANIFEST, PUBLISH_TIERS, SYNC_STATE_SUFFIX
from core.rundir import RunPaths

BUCKET_RUN_ENV = "TOKENMILL_BUCKET_RUN"
"""Set by the command for the trainer it launches: ``<url> <working copy>``, so rank 0 publishes checkpoints."""
STATE_SUFFIX = SYNC_STATE_SUFFIX
"""``<copy>.sync.json`` beside the working copy: ``{key: [size, mtime_ns, etag]}`` of each file known to equal
its key in the bucket (what pull fetched and publish uploaded)."""
MARKER_TIERS = PUBLISH_TIERS
"""Keys uploaded after every other output, in this order (a checkpoint manifest: prefix and suffix)."""


def working_copy_root(url: str) -> Path:
    """Where the working copy of ``url`` lives: ``$XDG_CACHE_HOME/tokenmill/work/s3/<bucket>/<prefix>``."""
    bucket, prefix = split_url(url)
    parts = PurePosixPath(prefix).parts
    if not parts or any(part in ("..", ".") for part in parts):
        raise ObjectStoreError(f"{url}: not a run dir URL; give s3://bucket/runs/NAME")
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache.joinpath("tokenmill", "work", "s3", bucket, *parts)


def _tier(rel: str) -> int:
    """0 for an output; 1.. for a marker (:data:`MARKER_TIERS`), the higher the later."""
    tier = 0
    for number, pattern in enumerate(MARKER_TIERS, start=1):
        if (len(pattern) == 2 and rel.startswith(pattern[0]) and rel.endswith(pattern[1])) or \
                (len(pattern) == 1 and rel.startswith(pattern[0])):
            tier = number
    return tier


class BucketRun:
    """The run dir at ``url`` and its working copy (``local``, default :func:`working_copy_root`)."""

    def __init__(self, url: str, local: Path | None = None, lock: BucketLock | None = None) -> None:
        self.url = url.rstrip("/")
        self.bucket, self.prefix = split_url(self.url)
        self.local = local or working_copy_root(self.url)
        self.lock = lock
        self._client = s3_client()

    @property
    def state_path(self) -> Path:
        return self.local.with_name(self.local.name + STATE_SUFFIX)

    # ---- pull ---------------------------------------------------------------------------------------------

    def pull(self) -> Path:
        """Bring the working copy up to the bucket's run dir (an empty copy for a new one); return its folder."""
        remote = self._list()
        state = self._read_state()
        self.local.mkdir(parents=True, exist_ok=True)
        for rel in sorted(set(self._local_files()) - set(remote)):
            (self.local / rel).unlink()
            state.pop(rel, None)
            self._remove_empty_folders((self.local / rel).parent)
        fetched = []
        for rel, (_, etag) in sorted(remote.items()):
            if not self._matches(rel, state.get(rel), etag):
                state[rel] = self._fetch(rel, etag)
                fetched.append(rel)
        self._write_state(state)
        self._check_shards(state, set(fetched))
        return self.local

    def _remove_empty_folders(self, folder: Path) -> None:
        """Folders the bucket no longer holds a key under, up to the copy's root: a checkpoint whose publication was
        cut leaves no empty ``step-N`` folder that the trainer would take for a save that did not finish."""
        while folder != self.local and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent

    def _check_shards(self, state: dict[str, list[Any]], fetched: set[str]) -> None:
        """Each shard fetched now is checked against the index's sha256; fetched once more if it differs."""
        if not RunPaths(self.local).shard_index.is_file():
            return
        from core.shards.store import read_shard_index  # pyarrow: only a run with shards needs it

        for info in read_shard_index(self.local):
            rel = info.path
            if rel not in fetched and rel in state:
                continue
            # hashed once per file version: the readers that open it next in this process do not hash it again
            if file_sha256(self.local / rel) != info.sha256:
                state[rel] = self._fetch(rel, "")
                self._write_state(state)
                if file_sha256(self.local / rel) != info.sha256:
                    raise ObjectStoreError(f"{self.url}/{rel}: the shard's sha256 differs from shards/index.parquet "
                                           "(damaged in the bucket); run `tokenmill prepare` into a fresh run dir")

    def _matches(self, rel: str, known: list[Any] | None, etag: str) -> bool:
        path = self.local / rel
        if known is None or known[2] != etag or not path.is_file():
            return False
        stat = path.stat()
        return [stat.st_size, stat.st_mtime_ns] == known[:2]

    def _fetch(self, rel: str, etag: str) -> list[Any]:
        """Download ``rel`` under a temporary name, then rename (a cut download leaves no partial file)."""
        target = self.local / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{TEMP_PREFIX}{target.name}")
        try:
            with object_errors(f"{self.url}/{rel}"):
                self._download(rel, partial)
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
        stat = target.stat()
        return [stat.st_size, stat.st_mtime_ns, etag or self._head_etag(rel)]

    def _download(self, rel: str, partial: Path) -> None:
        answer = self._client.get_object(Bucket=self.bucket, Key=self._key(rel))
        with open(partial, "wb") as handle:
            for chunk in answer["Body"].iter_chunks(4 << 20):
                handle.write(chunk)

    def _head_etag(self, rel: str) -> str:
        return str(self._client.head_object(Bucket=self.bucket, Key=self._key(rel))["ETag"])

    # ---- publish ------------------------------------------------------------------------------------------

    def publish(self, under: str = "") -> int:
        """Upload what changed in the working copy (only keys under ``under``, e.g. ``checkpoints/``), markers
        last, then delete what the run removed; return the number of keys written or deleted."""
        if self.lock is not None:
            self.lock.check_held()
        remote = {rel: value for rel, value in self._list().items() if rel.startswith(under)}
        state = self._read_state()
        local = {rel: path for rel, path in self._local_files().items() if rel.startswith(under)}
        changed = sorted((rel for rel in local if not self._matches(rel, state.get(rel), remote.get(rel, ("", ""))[1])),
                         key=lambda rel: (_tier(rel), rel))
        gone = sorted((rel for rel in remote if rel not in local),
                      key=lambda rel: (not rel.endswith(f"/{CHECKPOINT_MANIFEST}"), rel))
        stale_markers = [rel for rel in [*changed, *gone] if rel in remote and _tier(rel) >= 4]
        for rel in stale_markers:  # a marker never vouches for outputs being replaced under it
            self._delete(rel, state)
        for rel in changed:
            state[rel] = self._upload(rel, local[rel])
            if _tier(rel):
                self._write_state(state)
        for rel in gone:
            if rel not in stale_markers:
                self._delete(rel, state)
        self._write_state(state)
        return len(changed) + len(gone)

    def _upload(self, rel: str, path: Path) -> list[Any]:
        stat = path.stat()
        with object_errors(f"{self.url}/{rel}"), open(path, "rb") as handle:
            answer = self._client.put_object(Bucket=self.bucket, Key=self._key(rel), Body=handle)
        return [stat.st_size, stat.st_mtime_ns, str(answer["ETag"])]

    def _delete(self, rel: str, state: dict[str, list[Any]]) -> None:
        with object_errors(f"{self.url}/{rel}"):
            self._client.delete_object(Bucket=self.bucket, Key=self._key(rel))
        state.pop(rel, None)

    # ---- listing and state --------------------------------------------------------------------------------

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}"

    def _list(self) -> dict[str, tuple[int, str]]:
        """``{key relative to the run dir: (size, ETag)}`` of every object under the prefix but the lock."""
        found: dict[str, tuple[int, str]] = {}
        with object_errors(self.url):
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                           Prefix=self.prefix + "/")
            for page in pages:
                for entry in page.get("Contents", []):
                    rel = entry["Key"][len(self.prefix) + 1:]
                    if rel == LOCK_KEY or rel.endswith("/") or not rel:
                        continue
                    if PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts:
                        raise ObjectStoreError(f"{self.url}: key {rel!r} climbs out of the run dir; remove it "
                                               "from the bucket")
                    found[rel] = (int(entry["Size"]), str(entry["ETag"]))
        if (clash := object_and_folder(set(found))) is not None:
            raise RunDirError(f"{self.url}: key {clash[0]!r} is an object and also a folder of others ({clash[1]!r}); "
                              "a run dir holds a file or a folder there, not both: remove one of them from the bucket")
        return found

    def _local_files(self) -> dict[str, Path]:
        """Every regular file of the working copy (not the local lock, not a writer's temporary file)."""
        files = {path.relative_to(self.local).as_posix(): path for path in _walk(self.local)}
        return {rel: path for rel, path in files.items() if rel != LOCK_KEY
                and not any(part.startswith(TEMP_PREFIX) for part in rel.split("/"))}  # nor a folder in the making

    def _read_state(self) -> dict[str, list[Any]]:
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}  # a deleted or damaged state only costs fetching (or uploading) everything again
        return state if isinstance(state, dict) else {}

    def _write_state(self, state: dict[str, list[Any]]) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.state_path, json.dumps(state, sort_keys=True))


def _walk(root: Path) -> Iterator[Path]:
    """Regular files under ``root`` (symlinks are not followed: a run dir holds none that tokenmill wrote)."""
    if not root.is_dir():
        return
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if not Path(folder, name).is_symlink()]
        for name in files:
            path = Path(folder, name)
            if path.is_file() and not path.is_symlink():
                yield path


def publish_working_copy(run_dir: Path, *unders: str) -> None:
    """Rank 0 of a trainer launched on a bucket run dir's working copy: publish the keys under each of ``unders``
    (all when none), markers last. A no-op unless :data:`BUCKET_RUN_ENV` names this working copy.

    The trainer calls it for ``metrics/`` and ``checkpoints/`` when a checkpoint is saved (files first, ``latest``
    last), and for the whole run dir once the export is written.
    """
    run = _launched_run(run_dir)
    if run is None:
        return
    for under in unders or ("",):
        run.publish(under)


def _launched_run(run_dir: Path) -> BucketRun | None:
    """The bucket run whose working copy ``run_dir`` is, as :data:`BUCKET_RUN_ENV` names it; None otherwise."""
    url, _, local = os.environ.get(BUCKET_RUN_ENV, "").partition(" ")
    if not url or Path(local).resolve() != Path(run_dir).resolve():
        return None
    return BucketRun(url, Path(local))


def machines_apart() -> bool:
    """Several machines in the launch (WORLD_SIZE > LOCAL_WORLD_SIZE), each with its own working copy."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world > int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


def share_checkpoint_parts(run_dir: Path, staging: Path, *, is_main: bool, is_local_main: bool,
                           barrier: Callable[[], None]) -> None:
    """Bring every machine's part of a checkpoint being assembled (``staging``) into rank 0's working copy.

    Without a shared file system each machine writes its ranks' files (``random_states_<rank>.pkl``) into its own
    copy of ``staging``: the first process of every other machine uploads them under the staging folder's key
    (``checkpoints/.tmp-step-N/``), and after the barrier rank 0 fetches what it lacks, so the manifest it writes
    covers every rank. Rank 0's publication then deletes those temporary keys. A no-op on one machine, and for a
    run dir that is not a bucket's working copy. Collective: every rank calls it.
    """
    run = _launched_run(run_dir)
    if run is None or not machines_apart():
        return
    if is_local_main and not is_main:
        for path in sorted(_walk(staging)):
            run._upload(path.relative_to(run.local).as_posix(), path)
    barrier()
    if is_main:
        folder = staging.relative_to(run.local).as_posix() + "/"
        for rel, (_, etag) in sorted(run._list().items()):
            if rel.startswith(folder) and not (run.local / rel).exists():
                run._fetch(rel, etag)


@contextlib.contextmanager
def trainer_working_copy(run_dir: str | Path) -> Iterator[Path]:
    """``python -m trainer.train --run-dir s3://…`` (by hand, or ``accelerate launch`` on each machine): the run
    dir's working copy; ``run_dir`` itself when it is a local folder.

    Global rank 0 holds the bucket lock while training; the first process of each machine pulls that machine's
    copy and the others wait for that pull (a stamp beside the copy naming the launch). The trainer's ranks then
    publish as they do under ``tokenmill train`` (:func:`publish_working_copy`, :func:`share_checkpoint_parts`).
    """
    text = str(run_dir)
    if not text.startswith(("s3://", "s3a://")):
        yield Path(run_dir)
        return
    url = text.rstrip("/")
    local = working_copy_root(url)
    lock = BucketLock(url, "python -m trainer.train") if int(os.environ.get("RANK", "0")) == 0 else None
    with lock if lock is not None else contextlib.nullcontext():
        stamp = local.with_name(local.name + ".pulled")
        launch = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}:{os.environ.get('MASTER_PORT', '')}:{os.getppid()}"
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            BucketRun(url, local, lock).pull()
            write_text_atomic(stamp, launch)
        else:
            while not (stamp.is_file() and stamp.read_text() == launch):
                time.sleep(0.05)
        os.environ[BUCKET_RUN_ENV] = f"{url} {local}"
        yield local
