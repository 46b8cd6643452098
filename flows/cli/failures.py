"""A command's unexpected exception said as one line, when its cause is the user's to fix: an OS limit on a path
(a full disk, a file-size limit, a folder where a file goes, a name too long, no permission), or the temporary
Prefect server failing for one of them.

The CLI's top-level handler (:func:`flows.cli.commands.main`) asks :func:`user_error` before it would print a traceback;
the writers of the run dir raise these errors themselves where they can (:mod:`core.files.atomic`), this is what
catches the rest, and what only the command sees: the server's database lives outside the run dir, and its
failures reach tokenmill as HTTP 500 answers to the flow's API calls.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

from core.errors import OutOfSpaceError, TokenmillError, UnwritableError
from core.files.atomic import NO_SPACE_ERRNOS, UNWRITABLE_ERRNOS, no_space_message
from flows.runtime.server import RUNNING, server_failure

PATH_ERRNOS = {number: UNWRITABLE_ERRNOS[number] for number in (
    errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG, errno.EROFS, errno.EACCES, errno.EPERM, errno.ELOOP)}
"""OS errors on a path that the user fixes (missing files are left out: they may be tokenmill's own bug)."""
SERVER_ERROR_TYPES = ("HTTPStatusError", "PrefectHTTPStatusError")
SERVER_GONE_TYPES = ("ConnectError", "RemoteProtocolError", "ReadError", "WriteError")
"""httpx's exceptions for a server that answered 5xx, and for one that went away mid-request."""


def user_error(err: BaseException, *, temporary_server: bool) -> TokenmillError | None:
    """The one-line error for ``err`` when its cause is an OS limit the user fixes, else None (a traceback).

    ``temporary_server``: this command started tokenmill's temporary Prefect server (:mod:`flows.runtime.server`), so an
    HTTP 500 from the API, or the API gone, is that server failing, and its cause is looked for.
    """
    for cause in _chain(err):
        if isinstance(cause, OSError) and cause.filename is not None:
            if cause.errno in NO_SPACE_ERRNOS:
                return OutOfSpaceError(no_space_message(Path(os.fsdecode(cause.filename)), cause.errno, None))
            if cause.errno in PATH_ERRNOS:
                reason, fix = PATH_ERRNOS[cause.errno]
                return UnwritableError(f"{os.fsdecode(cause.filename)}: {reason} ({cause.strerror}); {fix}.")
    if temporary_server and any(_server_failed(cause) for cause in _chain(err)):
        return server_failure("failed (an HTTP 500 answer, or it went away)", RUNNING[-1].log_tail() if RUNNING else "")
    return None


def _server_failed(err: BaseException) -> bool:
    names = {kind.__name__ for kind in type(err).__mro__}
    if names & set(SERVER_GONE_TYPES):
        return True
    response = getattr(err, "response", None)
    return bool(names & set(SERVER_ERROR_TYPES)) and getattr(response, "status_code", 0) >= 500


def _chain(err: BaseException) -> Iterator[BaseException]:
    """``err``, then its causes and contexts (each once: a chain may loop), and an ExceptionGroup's members."""
    seen: set[int] = set()
    pending = [err]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending.extend(cause for cause in (current.__cause__, current.__context__) if cause is not None)
        pending.extend(getattr(current, "exceptions", ()))
