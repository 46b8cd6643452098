"""Exceptions every tokenmill package raises: each message says what was wrong, the value and the fix."""

from __future__ import annotations


class TokenmillError(Exception):
    """A problem the user can act on; the CLI prints its message as one line, without a traceback."""


class ConfigError(TokenmillError):
    """A recipe (``configs/*.yaml``) or setting is invalid."""


class ManifestError(TokenmillError):
    """A corpus manifest (``data_manifests/*.yaml``) is invalid or names paths that cannot be used."""


class ObjectStoreError(TokenmillError):
    """A bucket or object cannot be reached (missing, no permission, no credentials, endpoint down): one line
    naming the URL and what to set."""


class StoreUnavailableError(ObjectStoreError):
    """The object store did not answer, or failed mid-object, after botocore's and s3fs's retries: worth a retry
    later (unlike a missing bucket or bad credentials); a re-run reads only unfinished parts again."""

    retryable = True


class SourceReadError(TokenmillError):
    """An input file cannot be read at all (not a single record could be recovered from it)."""


class ShardFormatError(TokenmillError):
    """A shard or the shard index does not match the documented format."""


class OutOfSpaceError(TokenmillError, OSError):
    """A write failed for lack of room (disk full, quota, file-size limit); the previous file is unchanged.

    Also an OSError, so code that handles failed writes as OSError still does.
    """


class UnwritableError(TokenmillError, OSError):
    """A file or folder cannot be written there (read-only file system, no permission, a file where a folder must
    be); nothing was written. Also an OSError, like OutOfSpaceError."""


class CheckpointError(TokenmillError):
    """A checkpoint is missing, corrupt or does not belong to this run."""


class RunLockedError(TokenmillError):
    """Another process holds the run directory."""


class StageMismatchError(TokenmillError):
    """A stage's recorded fingerprint differs from the current inputs and settings."""


class RunDirError(TokenmillError):
    """The run directory holds what tokenmill never writes there (a crafted or damaged run dir)."""


class QueryError(TokenmillError):
    """A query was refused or failed."""


class TrainingDivergedError(TokenmillError):
    """Training produced non-finite losses or gradients for too many steps in a row."""


class ChildProcessFailed(TokenmillError):
    """The child process failed or ran past its deadline; worth a retry (training resumes from a checkpoint)."""

    retryable = True
