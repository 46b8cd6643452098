"""What an object store answers for a missing bucket, bad credentials or an unreachable endpoint, as one line.

Shared by the sources in a bucket (:mod:`pipeline.objects`) and the run dir in a bucket (:mod:`core.bucket.run_dir`).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator

from core.errors import ObjectStoreError, StoreUnavailableError


@contextlib.contextmanager
def object_errors(url: str) -> Iterator[None]:
    """Turn what a store answers for a missing bucket, bad or absent credentials, an unreachable endpoint into one
    ObjectStoreError line naming ``url`` (:func:`describe_object_error`); other errors pass unchanged."""
    try:
        yield
    except ObjectStoreError:
        raise
    except Exception as err:
        error = object_store_error(url, err)
        if error is None:
            raise
        raise error from None


def object_store_error(url: str, err: BaseException) -> ObjectStoreError | None:
    """The one-line error for ``err`` (:func:`describe_object_error`): StoreUnavailableError (worth a retry) when
    the store was unreachable or failing, ObjectStoreError for what configuration fixes; None for other errors."""
    line = describe_object_error(url, err)
    if line is None:
        return None
    return StoreUnavailableError(line) if _unreachable(err) or _failing(err) else ObjectStoreError(line)


def describe_object_error(url: str, err: BaseException) -> str | None:
    """One line naming ``url`` and what to set, for the errors a user fixes by configuration; None for others."""
    name = type(err).__name__
    detail = _one_line(err)
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        return (f"{url}: no credentials for the object store ({detail}); set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and AWS_ENDPOINT_URL for a store other than AWS.")
    if isinstance(err, PermissionError) or "AccessDenied" in detail or "InvalidAccessKeyId" in detail \
            or "SignatureDoesNotMatch" in detail:
        return (f"{url}: access denied ({detail}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) "
                "to an identity that may read it.")
    if isinstance(err, FileNotFoundError) or "NoSuchBucket" in detail:
        return (f"{url}: no such bucket or object ({detail}); check the URL, and AWS_ENDPOINT_URL (or the source's "
                "storage_options.endpoint_url) for a store other than AWS.")
    if _unreachable(err):
        return (f"{url}: cannot reach the object store ({detail}), after retries; check AWS_ENDPOINT_URL "
                "(or storage_options.endpoint_url) and that the store is up.")
    if _failing(err):
        return (f"{url}: the object store is overloaded or failing ({detail}), after retries; run again later "
                "(finished parts are kept), or allow more retries: AWS_MAX_ATTEMPTS, AWS_RETRY_MODE=adaptive.")
    return None


EREMOTEIO = getattr(errno, "EREMOTEIO", 121)
"""s3fs's errno for an S3 InternalError (500); Linux's number where Python lacks the name."""
TRANSIENT_WORDS = ("SlowDown", "ServiceUnavailable", "Service Unavailable", "InternalError", "Throttl",
                   "RequestTimeout", "(500)", "(502)", "(503)", "(504)")
"""What a store's answer holds when it failed for now, not for the request (S3 error codes; botocore writes an
answer without a code as ``An error occurred (503) …``)."""


def _unreachable(err: BaseException) -> bool:
    return type(err).__name__ in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError") \
        or isinstance(err, ConnectionError)


def _failing(err: BaseException) -> bool:
    """A store's answer that it failed for now: s3fs turns the ClientError (kept as ``__cause__``) into an OSError
    holding only the message ("Please reduce your request rate."), with EBUSY for 503/SlowDown, EREMOTEIO for 500."""
    if isinstance(err, TimeoutError) or getattr(err, "errno", None) in (errno.EBUSY, EREMOTEIO):
        return True
    return any(word in _one_line(cause) for cause in (err, err.__cause__) if cause is not None
               for word in TRANSIENT_WORDS)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:200] or type(err).__name__
