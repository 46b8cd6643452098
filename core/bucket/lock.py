"""The run lock of a run dir in a bucket (``s3://bucket/runs/NAME/.lock``): one writer across machines.

A local run dir is locked with ``flock`` (:mod:`core.runlock`); machines that share only a bucket need the store
itself to decide. The lock is an object created with a conditional write, ``PutObject`` with ``If-None-Match:
*``: the store creates it for exactly one of two racing writers and answers the other 412 Precondition Failed
(AWS S3 since 2024-08; SeaweedFS 4.x, checked against the real server in the tests; a store that ignores the
header would let two writers in: check yours). It holds the holder's owner id, host, pid and command. The holder
rewrites it every ``lease/4`` seconds (a heartbeat: ``If-Match`` on its own ETag, so a holder that lost the lock
finds out); a lock whose object was last written more than the lease ago (``TOKENMILL_BUCKET_LOCK_LEASE_S``,
default 60 s; both times are the store's own clock, its ``Last-Modified`` and ``Date``, so machines' clocks need
not agree) was left by a holder that died, and is taken over by a conditional write too (``If-Match`` on the
stale ETag: of two takers, one wins). The lease is for holders on other machines: a holder on this machine (same
host name, boot and pid namespace, all recorded in the lock) whose process is gone, or whose pid now belongs to
another process (its start time differs from the one recorded), is taken over at once, by the same conditional
write.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from core.bucket.object_errors import object_errors
from core.bucket.url import check_bucket_url
from core.errors import ConfigError, ObjectStoreError, RunLockedError
from core.layout import RELATIVE, run_key

LOCK_KEY = run_key(RELATIVE.lock_file)
"""The lock's key under the run dir's prefix (never pulled into a working copy nor published)."""
LEASE_ENV = "TOKENMILL_BUCKET_LOCK_LEASE_S"
DEFAULT_LEASE_S = 60.0
"""A lock not rewritten for this long is stale: its holder died (kill -9, a lost machine) and it is taken over."""
LOGGER = logging.getLogger(__name__)


def s3_client() -> Any:
    """A botocore S3 client from the standard AWS environment (AWS_ENDPOINT_URL, credentials, region)."""
    try:
        import botocore.session  # botocore: the [s3] extra, needed only for a bucket
    except ImportError:
        raise ObjectStoreError("a run dir in a bucket needs s3fs (and botocore); pip install 'tokenmill[s3]'") from None
    return botocore.session.get_session().create_client("s3")


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``; ObjectStoreError for another scheme or no bucket."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if scheme not in ("s3", "s3a") or not bucket:
        raise ObjectStoreError(f"{url}: a run dir in a bucket is an s3:// URL (s3://bucket/runs/NAME); other "
                               "object stores are not supported as run dirs yet")
    try:
        check_bucket_url(url)  # before any request: botocore's ParamValidationError or a 400 would be a traceback
    except ValueError as err:
        raise ConfigError(f"run dir: {err}.") from None
    return bucket, key.strip("/")


def _error_code(err: Exception) -> str:
    response = getattr(err, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def _conflict(err: Exception) -> bool:
    """The store refused a conditional write: the object exists (or changed) since we looked."""
    status = (getattr(err, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
    return _error_code(err) in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)


class BucketLock:
    """The bucket run dir's lock (a context manager); RunLockedError naming the URL and the holder when taken."""

    def __init__(self, url: str, command: str = "", lease_s: float | None = None) -> None:
        self.url = url.rstrip("/")
        self.bucket, prefix = split_url(self.url)
        self.key = f"{prefix}/{LOCK_KEY}" if prefix else LOCK_KEY
        self.lock_url = f"{self.url}/{LOCK_KEY}"
        self.lease_s = float(lease_s if lease_s is not None else os.environ.get(LEASE_ENV, DEFAULT_LEASE_S))
        self.record = {"owner": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
                       "command": " ".join(["tokenmill", *sys.argv[1:2]]) if command == "" else command,
                       "lease_s": self.lease_s, "beat": 0, **this_process()}
        self.lost: str | None = None
        """Set by the heartbeat when another process took the lock over: this one must stop writing."""
        self._client = s3_client()
        self._etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        with object_errors(self.lock_url):
            try:
                self._etag = self._put(IfNoneMatch="*")
            except Exception as err:
                if not _conflict(err):
                    raise
                self._take_over_if_stale()
        self._thread = threading.Thread(target=self._beat, name="bucket-lock-heartbeat", daemon=True)
        self._thread.start()

    def _take_over_if_stale(self) -> None:
        """The lock exists: take it if its holder stopped beating for a lease, else RunLockedError naming it."""
        try:
            answer = self._client.get_object(Bucket=self.bucket, Key=self.key)
        except Exception as err:
            if _error_code(err) not in ("NoSuchKey", "404"):
                raise
            try:  # released meanwhile: try once more, conditionally
                self._etag = self._put(IfNoneMatch="*")
                return
            except Exception as again:
                if _conflict(again):
                    raise self._taken() from None
                raise
        holder = _holder_record(answer["Body"].read())
        age_s = _age_s(answer)
        gone = died_on_this_machine(holder)
        if age_s <= self.lease_s and not gone:
            raise RunLockedError(
                f"{self.url}: run directory is in use by {_describe(holder)} (lock {self.lock_url}, written "
                f"{age_s:.0f} s ago); wait for it to finish or use another --run-dir. A holder that died is "
                f"taken over once its lock is {self.lease_s:.0f} s old ({LEASE_ENV}).") from None
        try:
            self._etag = self._put(IfMatch=answer["ETag"])
        except Exception as err:
            if _conflict(err):
                raise self._taken() from None
            raise
        if gone:
            LOGGER.warning("%s: took over the lock of %s, a process of this machine that is gone", self.url,
                           _describe(holder))
        else:
            LOGGER.warning("%s: took over the lock of %s, silent for %.0f s (more than the %.0f s lease)", self.url,
                           _describe(holder), age_s, self.lease_s)

    def _taken(self) -> RunLockedError:
        return RunLockedError(f"{self.url}: run directory was just taken by another process (lock {self.lock_url}); "
                              "wait for it to finish or use another --run-dir.")

    def _put(self, **condition: str) -> str:
        self.record["beat"] = int(self.record["beat"]) + 1  # new bytes, new ETag on every write
        body = json.dumps(self.record, sort_keys=True).encode()
        answer = self._client.put_object(Bucket=self.bucket, Key=self.key, Body=body,
                                         ContentType="application/json", **condition)
        return str(answer["ETag"])

    def _beat(self) -> None:
        """Rewrite the lock every lease/4 s, conditionally on our own ETag; a refusal means we lost it."""
        while not self._stop.wait(self.lease_s / 4):
            try:
                self._etag = self._put(IfMatch=str(self._etag))
            except Exception as err:
                if _conflict(err) or _error_code(err) in ("NoSuchKey", "404"):
                    self.lost = (f"{self.url}: lost the run lock ({self.lock_url}) to another process after "
                                 f"{self.lease_s:.0f} s without a heartbeat; nothing more is published from here")
                    LOGGER.error("%s", self.lost)
                    return
                LOGGER.warning("%s: heartbeat of the run lock failed (%s); retrying", self.url, _error_code(err) or err)

    def check_held(self) -> None:
        """RunLockedError when the heartbeat found the lock taken over (call before each publication)."""
        if self.lost is not None:
            raise RunLockedError(self.lost)

    def release(self) -> None:
        """Stop the heartbeat and delete the lock, only if it is still ours (its ETag is the one we wrote)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost is not None or self._etag is None:
            return
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=self.key)
            if head["ETag"] == self._etag:
                self._client.delete_object(Bucket=self.bucket, Key=self.key)
        except Exception as err:  # left in place, it is taken over after the lease
            LOGGER.warning("%s: could not remove the run lock (%s); it expires after %.0f s", self.url,
                           _error_code(err) or err, self.lease_s)
        self._etag = None

    def __enter__(self) -> BucketLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _proc_stat_fields(pid: int | str) -> list[str] | None:
    """``/proc/PID/stat``'s fields from the state on (state, ppid, …; starttime is index 19), None without it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _machine() -> dict[str, str] | None:
    """This machine's boot and this process's pid namespace: pids recorded under both name the same processes."""
    try:
        return {"boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                "pid_ns": os.readlink("/proc/self/ns/pid")}
    except OSError:
        return None


def this_process() -> dict[str, Any]:
    """What the lock records to tell, later and on this machine, whether its holder still runs (empty without
    ``/proc``: such a holder is only ever taken over after the lease)."""
    machine, fields = _machine(), _proc_stat_fields("self")
    if machine is None or fields is None:
        return {}
    return {**machine, "started": int(fields[19])}


def died_on_this_machine(holder: dict[str, Any]) -> bool:
    """Whether ``holder`` (a lock record) is a process of this machine that no longer runs.

    Same host name, boot and pid namespace as this process, and its pid is gone, a zombie, or a process started
    at another time than the one recorded (the pid was reused). A holder on another machine, or one whose lock
    records no start time, is never judged here: its lease decides.
    """
    here = _machine()
    pid, started = holder.get("pid"), holder.get("started")
    if here is None or holder.get("host") != socket.gethostname() or any(holder.get(k) != v for k, v in here.items()):
        return False
    if not isinstance(pid, int) or not isinstance(started, int) or isinstance(pid, bool) or pid <= 0:
        return False
    fields = _proc_stat_fields(pid)
    return fields is None or fields[0] == "Z" or int(fields[19]) != started


def _holder_record(body: bytes) -> dict[str, Any]:
    try:
        record = json.loads(body)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    """``pid N on host H (tokenmill prepare)``: the same words as the local lock's holder line."""
    pid, host = holder.get("pid", "?"), str(holder.get("host", "an unknown host"))[:100]
    command = str(holder.get("command", ""))[:100]
    return f"pid {pid} on host {host}" + (f" ({command})" if command else "")


def _age_s(answer: dict[str, Any]) -> float:
    """Seconds since the object was written, by the store's clock alone (its Date header minus Last-Modified)."""
    date = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    now = parsedate_to_datetime(date).timestamp() if date else time.time()
    return max(0.0, now - answer["LastModified"].timestamp())
