"""Object storage (``s3://`` and every other fsspec URL): source objects listed and opened like local files.

A source ``path`` with a URL scheme is read through fsspec (``s3fs`` for S3: ``pip install 'tokenmill[s3]'``).
Credentials and the endpoint come from the standard AWS environment or config files (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL``, ``~/.aws/config``); a manifest's
``storage_options`` holds only options that are no secret (:data:`ALLOWED_STORAGE_OPTIONS`), because a manifest
is copied into ``run.yaml`` and shared. An object is identified by its key, size and ETag (:func:`list_objects`),
as a local file is by its path, size and mtime. Objects are streamed (:meth:`ObjectPath.open`), never
downloaded whole. Transient errors (connection refused, 503 SlowDown) are retried with backoff by botocore and
s3fs themselves (``AWS_MAX_ATTEMPTS``, ``AWS_RETRY_MODE``); :class:`RetryLog` logs each of those retries once, as a
warning of the ``pipeline.objects`` logger, which they log only at debug level. A store still away after them is
StoreUnavailableError (retryable), also mid-object (:class:`ObjectStream`): never an OSError a reader would take
for a damaged file.
"""

from __future__ import annotations

import io
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from core.bucket.object_errors import (  # also imported from here (tests)
    _one_line,
    object_errors,
    object_store_error,
)
from core.bucket.url import check_bucket_url
from core.errors import ConfigError, ObjectStoreError, StoreUnavailableError

URL_SCHEME = re.compile(r"^([a-z][a-z0-9+.-]*)://")
ALLOWED_STORAGE_OPTIONS = frozenset({"endpoint_url", "region_name", "anon", "requester_pays", "use_ssl",
                                     "client_kwargs", "config_kwargs", "default_block_size"})
"""``storage_options`` keys a manifest may set (passed to the fsspec filesystem): none is a secret."""
ALLOWED_CLIENT_KWARGS = frozenset({"endpoint_url", "region_name", "verify", "use_ssl"})
"""Keys of ``storage_options.client_kwargs`` a manifest may set (botocore client options, no credentials)."""
SECRET_WORDS = ("key", "secret", "token", "password", "credential")
"""A storage option whose name holds one of these is refused: credentials come from the AWS environment/config."""
READ_BLOCK_BYTES = 4 << 20
"""Bytes fetched per ranged GET when streaming an object (s3fs's default, 50 MB, would be held per open file)."""


NOT_OBJECT_STORES = frozenset({"file", "hf"})
"""Schemes never read as object storage: local files, and the Hugging Face hub (tokenmill never downloads it)."""


def is_remote(path: str) -> bool:
    """Whether ``path`` is a URL read through fsspec (``s3://…``, ``gs://…``), not a local path or a hub name."""
    match = URL_SCHEME.match(path)
    return match is not None and match.group(1) not in NOT_OBJECT_STORES


def check_storage_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` when every key is allowed and none looks secret; ValueError naming the key otherwise."""
    for key, value in options.items():
        _check_option(key, ALLOWED_STORAGE_OPTIONS)
        if key in ("client_kwargs", "config_kwargs") and not isinstance(value, dict):
            raise ValueError(f"storage_options.{key} must be a mapping, e.g. client_kwargs: {{endpoint_url: http://…}}")
        for inner, inner_value in (value.items() if isinstance(value, dict) else []):
            allowed = ALLOWED_CLIENT_KWARGS if key == "client_kwargs" else {inner}  # botocore Config: no credentials
            _check_option(f"{key}.{inner}", {f"{key}.{name}" for name in allowed})
            _check_url_value(f"{key}.{inner}", inner_value)
        _check_url_value(key, value)
    return options


def _check_url_value(key: str, value: Any) -> None:
    """A URL option (an endpoint) must not carry credentials either."""
    if isinstance(value, str) and "://" in value:
        try:
            _check_no_credentials(value)
        except ValueError:
            raise ValueError(f"storage_options.{key} holds credentials (user info before @); set them in the AWS "
                             "environment or config instead (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)") from None


def _check_option(key: str, allowed: frozenset[str] | set[str]) -> None:
    if any(word in key.lower() for word in SECRET_WORDS):
        raise ValueError(f"storage_options.{key} looks like a secret; a manifest is copied into run.yaml and "
                         "shared, so credentials come from the AWS environment or config instead "
                         "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE)")
    if key not in allowed:
        raise ValueError(f"storage_options.{key} is not one of the allowed options {sorted(allowed)}")


def check_url(url: str) -> str:
    """``url`` when it carries no credentials (``s3://KEY:SECRET@bucket/…``) and its bucket and key follow the
    store's rules (:func:`core.bucket.url.check_bucket_url`); ValueError naming the URL otherwise."""
    return check_bucket_url(_check_no_credentials(url))


def checked_url(url: str, what: str) -> str:
    """:func:`check_url` for a URL given as ``what`` (``run dir``): ConfigError, one line, before any request."""
    try:
        return check_url(url)
    except ValueError as err:
        raise ConfigError(f"{what}: {err}.") from None


def _check_no_credentials(url: str) -> str:
    if "@" in url.split("://", 1)[1].split("/", 1)[0]:
        raise ValueError(f"{url.split('@')[-1]}: a URL with user info (KEY:SECRET@) holds credentials; set them in "
                         "the AWS environment or config instead (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)")
    return url


@dataclass(frozen=True)
class ObjectPath:
    """An object (or a prefix) in a bucket: the few ``Path`` operations the readers use, over fsspec."""

    url: str
    storage_options: dict[str, Any] = field(default_factory=dict, compare=False)

    def __truediv__(self, rel: str) -> ObjectPath:
        return ObjectPath(f"{self.url.rstrip('/')}/{rel}", self.storage_options)

    def __str__(self) -> str:
        return self.url

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(self.url.rstrip("/").rsplit("/", 1)[0], self.storage_options)

    def resolve(self) -> ObjectPath:
        """Itself: an object store has no links to resolve."""
        return self

    def filesystem(self) -> tuple[Any, str]:
        """``(fsspec filesystem, path inside it)``; fsspec caches the filesystem, so this is cheap."""
        RetryLog.install()
        try:
            import fsspec  # fsspec: the [s3] extra, needed only for a URL
        except ImportError:
            raise ObjectStoreError(f"{self.url}: reading object storage needs fsspec and s3fs; "
                                   "pip install 'tokenmill[s3]'") from None
        try:
            return fsspec.core.url_to_fs(self.url, **self.storage_options)
        except ImportError as err:
            raise ObjectStoreError(f"{self.url}: no fsspec filesystem for this URL ({err}); "
                                   "pip install 'tokenmill[s3]' for s3://") from None

    def info(self) -> dict[str, Any]:
        """The object's (or prefix's) fsspec info; ObjectStoreError, one line, when it cannot be reached."""
        fs, path = self.filesystem()
        with object_errors(self.url):
            return fs.info(path)

    def is_dir(self) -> bool:
        return self.info()["type"] == "directory"

    def exists(self) -> bool:
        fs, path = self.filesystem()
        with object_errors(self.url):
            return fs.exists(path)

    def size(self) -> int:
        return int(self.info().get("size") or 0)

    def size_if_present(self) -> int:
        """The object's size, 0 when it is gone; ObjectStoreError when the store cannot answer (no guess)."""
        fs, path = self.filesystem()
        with object_errors(self.url):
            try:
                return int(fs.size(path) or 0)
            except FileNotFoundError:
                return 0

    def open(self) -> BinaryIO:
        """A streaming, seekable handle (ranged GETs of READ_BLOCK_BYTES): never the whole object in memory.

        A read that fails once botocore and s3fs have retried raises ObjectStoreError (:class:`ObjectStream`).
        """
        fs, path = self.filesystem()
        with object_errors(self.url):
            return ObjectStream(fs.open(path, "rb", block_size=READ_BLOCK_BYTES), self.url)


class ObjectStream(io.RawIOBase):
    """An open object whose failed reads raise ObjectStoreError, never OSError.

    The readers take an OSError while reading for a damaged file (an ``unreadable_file`` reject, or a file to fix
    under ``on_error: fail``); a store that went away mid-object is no fault of the file. Raising a TokenmillError
    instead fails the ingest part: it writes no marker, and a re-run reads the object again from its start.
    """

    def __init__(self, handle: Any, url: str) -> None:
        super().__init__()
        self._handle, self.url = handle, url
        self.size = int(handle.size)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        try:
            return self._handle.read(-1 if size is None else size)
        except (ValueError, TypeError):  # a closed handle, a bad argument: the caller's bug, not the store's
            raise
        except Exception as err:
            raise object_store_error(self.url, err) or StoreUnavailableError(
                f"{self.url}: reading the object failed mid-stream ({_one_line(err)}), after retries; run again "
                "once the store answers: finished parts are kept, this one is read again from its start.") from None

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        memoryview(buffer).cast("B")[:len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._handle.seek(offset, whence)

    def tell(self) -> int:
        return self._handle.tell()

    def close(self) -> None:
        if not self.closed:
            self._handle.close()
        super().close()


LOGGER = logging.getLogger(__name__)
RETRY_LOGGERS = ("botocore.endpoint", "botocore.parsers", "botocore.retryhandler", "botocore.retries.standard", "s3fs")
ERROR_CODE = re.compile(rb"<Code>([A-Za-z0-9.]{1,64})</Code>")
"""Where botocore (every retry mode; aiobotocore logs through the same loggers) and s3fs say, at debug level,
which request was sent, what failed and that it is retried."""


class RetryLog(logging.Filter):
    """Turns each retry that botocore or s3fs logs at debug level into one warning of :data:`LOGGER` naming the
    request, the error, the attempt and the wait; drops the rest of their debug records (unless the user asked for
    them: a logger set to DEBUG is left alone).

    botocore logs one ``Response received to retry, sleeping for N seconds`` per retry in every mode (legacy,
    standard, adaptive), after the call (``Making request for``, once before its attempts) and the cause (an
    exception, the error code in the answer's body, or a legacy ``retry needed: …`` line); s3fs logs one
    ``Retryable error`` per retry of its own (a body cut mid-read, a SlowDown that outlived botocore's retries).
    One filter on all five loggers, its state per thread: s3fs runs every request on one event-loop thread.
    """

    _installed = False

    def __init__(self) -> None:
        super().__init__()
        self.state = threading.local()

    @classmethod
    def install(cls) -> None:
        if cls._installed:
            return
        cls._installed = True
        retry_log = cls()
        for name in RETRY_LOGGERS:
            logger = logging.getLogger(name)
            if logger.getEffectiveLevel() > logging.DEBUG:
                logger.setLevel(logging.DEBUG)
                logger.addFilter(retry_log)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG:
            return True
        state, text = self.state, str(record.msg)
        if text.startswith("Making request for") and isinstance(record.args, tuple) and len(record.args) == 2:
            request = record.args[1] if isinstance(record.args[1], dict) else {}  # once per call, before attempts
            state.request = f"{request.get('method', '')} {str(request.get('url', ''))[:160]}".strip()
            state.attempt, state.cause = 0, ""
        elif text.startswith("Sending http request"):  # each attempt: its cause is its own
            state.cause = ""
        elif text.startswith("Response body") and record.args and isinstance(record.args[0], bytes):
            code = ERROR_CODE.search(record.args[0][:2048])  # an S3 error answer: <Error><Code>SlowDown</Code>
            state.cause = f"the store answered {code.group(1).decode(errors='replace')}" if code else ""
        elif text.startswith("Fetch: "):  # s3fs, before a ranged GET of an open object
            state.s3fs_request = "GET " + record.getMessage().removeprefix("Fetch: ")
        elif text.startswith("Exception received when sending HTTP request") and record.exc_info:
            state.cause = " ".join(str(record.exc_info[1]).split()) or type(record.exc_info[1]).__name__
        elif text.startswith("retry needed"):  # legacy mode names the status or exception
            state.cause = record.getMessage().split(": ", 1)[-1]
        elif text.startswith("Response received to retry"):
            state.attempt = getattr(state, "attempt", 0) + 1
            self._warn(getattr(state, "cause", "") or "an HTTP answer worth a retry: throttled, or 5xx",
                       getattr(state, "request", "a request"), f"retry {state.attempt}",
                       float(record.args[0]) if record.args else 0.0)
        elif text.startswith("Retryable error") or (text.startswith("Client error") and "SlowDown" in
                                                     record.getMessage()):
            self._warn(record.getMessage().split(": ", 1)[-1], getattr(state, "s3fs_request", "a request"),
                       "retried by s3fs", None)
        return False

    @staticmethod
    def _warn(cause: str, request: str, attempt: str, wait_s: float | None) -> None:
        wait = f" in {wait_s:.2f} s" if wait_s is not None else ""
        LOGGER.warning("object store: transient error on %s (%s); %s%s", request, " ".join(cause.split())[:200],
                       attempt, wait)


def object_version(info: dict[str, Any]) -> str:
    """What tells a changed object apart at the same key: its ETag (else its modification time), as text."""
    for key in ("ETag", "etag", "LastModified", "mtime", "last_modified"):
        if info.get(key) is not None:
            return f"{key}:{str(info[key]).strip(chr(34))}"
    return ""


def list_objects(root: ObjectPath) -> list[tuple[str, int, str]]:
    """``(key relative to root, size, version)`` of every object under ``root`` (or of ``root`` itself)."""
    fs, path = root.filesystem()
    with object_errors(root.url):
        info = fs.info(path)
        if info["type"] != "directory":
            return [(root.name, int(info.get("size") or 0), object_version(info))]
        found = fs.find(path, detail=True, withdirs=False)
    prefix = path.rstrip("/") + "/"
    return sorted((key[len(prefix):], int(entry.get("size") or 0), object_version(entry))
                  for key, entry in found.items() if key.startswith(prefix) and not key.endswith("/"))
