"""Process-wide defaults that make Prefect and Hugging Face libraries work offline on a laptop."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from core.errors import TokenmillError

if TYPE_CHECKING:
    from prefect.states import State

DEFAULTS = {
    # The server's telemetry fails on a closed network and logs "database is locked" tracebacks.
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # A fresh SQLite database takes ~17 s to migrate on 2 cores; Prefect's default limit is 20 s.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    # Nothing is ever downloaded at run time: fail fast instead of waiting on network timeouts.
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
}


QUIET_ENV = "TOKENMILL_QUIET"
"""Set (by ``tokenmill --quiet``): no progress bars and no per-stage progress lines (flows.progress)."""
TOKENMILL_PREFECT_HOME_ENV = "TOKENMILL_PREFECT_HOME"
"""Names the Prefect home that tokenmill chose itself: equal to ``PREFECT_HOME``, no profile of the user's
can name a server, and tokenmill starts its own temporary one (flows.server.start_temporary_server)."""


def configure_environment() -> None:
    """Fill in settings the user has not set; must run before Prefect is imported.

    Prefect's home goes to ``~/.cache/tokenmill/prefect`` unless the user configured a home or a
    server (``PREFECT_HOME`` / ``PREFECT_API_URL``), so tokenmill never touches their own Prefect setup.
    """
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
    if "PREFECT_HOME" not in os.environ and "PREFECT_API_URL" not in os.environ:
        home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenmill" / "prefect"
        home.mkdir(parents=True, exist_ok=True)
        os.environ["PREFECT_HOME"] = os.environ[TOKENMILL_PREFECT_HOME_ENV] = str(home)


class _HideUserErrorTracebacks(logging.Filter):
    """Console only: a TokenmillError is a message for the user, not a bug; its traceback stays in the API logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, TokenmillError):
            record.exc_info, record.exc_text = None, None
        return True


def hide_user_error_tracebacks() -> None:
    """Strip tracebacks of user errors from Prefect's console output (``--debug`` keeps them)."""
    for handler in logging.getLogger().handlers:
        if type(handler).__name__ == "PrefectConsoleHandler":
            handler.addFilter(_HideUserErrorTracebacks())


def retry_unless_user_error(task: object, task_run: object, state: State) -> bool:
    """Prefect ``retry_condition_fn``: retry I/O, crashes and killed children, never bad input (it stays bad)."""
    error = state.result(raise_on_failure=False)
    return not isinstance(error, TokenmillError) or getattr(error, "retryable", False)
