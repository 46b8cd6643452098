"""Process-wide defaults that make Prefect and Hugging Face libraries work offline on a laptop."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
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
LIBRARY_PROGRESS_OFF = {
    # Other libraries' bars: tqdm lines written under tokenmill's own bars (on a terminal they scrolled above
    # them; in a log they were "\r"-joined lines). tokenmill shows its own progress of the same work instead:
    # lm-eval's requests scored (trainer.eval.lm_eval_progress). `tokenmill --debug` leaves them on.
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",  # datasets: "Generating test split", "Map", …
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # huggingface_hub, and transformers' "Loading weights" (it asks the hub)
    "TQDM_DISABLE": "1",  # every other tqdm bar's default (lm-eval building a task's requests)
}


QUIET_ENV = "TOKENMILL_QUIET"
"""Set (by ``tokenmill --quiet``): no progress bars and no per-stage progress lines (flows.progress.bars)."""
TOKENMILL_PREFECT_HOME_ENV = "TOKENMILL_PREFECT_HOME"
"""Names the Prefect home that tokenmill chose itself: equal to ``PREFECT_HOME``, no profile of the user's
can name a server, and tokenmill starts its own temporary one (flows.runtime.server.start_temporary_server)."""


def configure_environment() -> None:
    """Fill in settings the user has not set; must run before Prefect is imported.

    Prefect's home goes to ``~/.cache/tokenmill/prefect`` unless the user configured a home or a
    server (``PREFECT_HOME`` / ``PREFECT_API_URL``), so tokenmill never touches their own Prefect setup.
    Other libraries' progress bars are off (:data:`LIBRARY_PROGRESS_OFF`; see :func:`show_library_progress`).
    The processes tokenmill launches (trainer, evaluator) inherit all of it.
    """
    for key, value in {**DEFAULTS, **LIBRARY_PROGRESS_OFF}.items():
        if key not in os.environ:
            os.environ[key] = value
            _SET_HERE.add(key)
    if "PREFECT_HOME" not in os.environ and "PREFECT_API_URL" not in os.environ:
        home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenmill" / "prefect"
        home.mkdir(parents=True, exist_ok=True)
        os.environ["PREFECT_HOME"] = os.environ[TOKENMILL_PREFECT_HOME_ENV] = str(home)


_SET_HERE: set[str] = set()
"""The variables :func:`configure_environment` set (the user had not)."""


def show_library_progress() -> None:
    """Undo :data:`LIBRARY_PROGRESS_OFF` where tokenmill set it (``--debug``: show everything); call it before
    those libraries are imported, which read the variables then."""
    for key in LIBRARY_PROGRESS_OFF:
        if key in _SET_HERE:
            os.environ.pop(key, None)
            _SET_HERE.discard(key)


@contextlib.contextmanager
def heartbeats_unless_temporary(temporary_server: bool) -> Iterator[None]:
    """Flow runs send no heartbeats to tokenmill's temporary server; to a configured server they do.

    A heartbeat lets a server's automation mark a run that stopped sending them (``kill -9``) as crashed.
    The temporary server stops with the command, so nothing could ever watch them there; and a flow run
    that sends them waits up to a second at its end for the heartbeat thread (it sleeps in 1 s steps).
    """
    if not temporary_server:
        yield
        return
    import prefect.settings  # Prefect, after configure_environment has set what it reads
    from prefect.settings import temporary_settings  # Prefect: as above

    with temporary_settings(updates={prefect.settings.PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


INTERRUPTED = "aborted by an interrupt signal"
"""In Prefect's records of a run stopped by Ctrl-C ("Crash detected! Execution was aborted by an interrupt signal.")."""
PREFECT_HOUSEKEEPING = ("Still processing items", "Starting temporary server on", "Stopping temporary server on")
"""Prefect's own notes at start and exit (its event queue flushing, the temporary server it starts in a Prefect
home of the user's, which serves no UI): the last would come after the CLI's final line."""
RETRY_NOTICE = "Retry "
"""In Prefect's record of a failed task that will run again ("… - Retry 1/2 will start 10 second(s) from now")."""


class ConsoleFilter(logging.Filter):
    """What Prefect's console handler shows of a command run in this process; the API keeps every record.

    - A TokenmillError is a message for the user, not a bug: its traceback is left out.
    - ``say_errors_once``: the CLI ends a failed command with one ``error:`` line, so Prefect's own records
      of that error (each failing task's and flow's "Encountered exception …", their "Finished in state
      Failed(…)") are left out, as are the "Crash detected … interrupt signal" records of a Ctrl-C (the CLI
      says what was kept instead). A retry notice stays: it says what happens next.
    - ``hide_view_links``: a temporary server serves no UI, so its "View at URL" links lead nowhere.
    - Prefect's housekeeping notes (:data:`PREFECT_HOUSEKEEPING`) are left out.
    """

    def __init__(self, *, say_errors_once: bool, hide_view_links: bool) -> None:
        super().__init__()
        self.say_errors_once, self.hide_view_links = say_errors_once, hide_view_links

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        message = record.getMessage()
        if isinstance(error, TokenmillError):
            record.exc_info, record.exc_text = None, None
            return not self.say_errors_once or RETRY_NOTICE in message
        if self.say_errors_once and (INTERRUPTED in message or _failed_by_user_error(message)):
            return False
        if message.startswith(PREFECT_HOUSEKEEPING):
            return False
        return not (self.hide_view_links and message.startswith("View at "))



FAILED_BY = re.compile(r"^Finished in state (?:Failed|Crashed)\(\W{0,2}"
                       r"(?:Task|Flow) run encountered an exception:? (\w+): ")
"""Prefect's last record of a task or flow that raised: ``Finished in state Failed("Task run encountered an
exception SourceReadError: …")``; it may come from a worker process, where the exception itself was logged."""


def _failed_by_user_error(message: str) -> bool:
    found = FAILED_BY.match(message)
    return found is not None and found.group(1) in _user_error_names()


def _user_error_names() -> set[str]:
    pending, names = [TokenmillError], set()
    while pending:
        error = pending.pop()
        names.add(error.__name__)
        pending += error.__subclasses__()
    return names


def configure_console(console_filter: ConsoleFilter, *, quiet: bool) -> None:
    """Filter Prefect's console handler (``quiet``: warnings and errors only); the API's log handler is untouched."""
    for handler in logging.getLogger().handlers:
        if type(handler).__name__ == "PrefectConsoleHandler":
            handler.addFilter(console_filter)
            if quiet:
                handler.setLevel(max(handler.level, logging.WARNING))


def retry_unless_user_error(task: object, task_run: object, state: State) -> bool:
    """Prefect ``retry_condition_fn``: retry I/O, crashes and killed children, never bad input (it stays bad)."""
    error = state.result(raise_on_failure=False)
    return not isinstance(error, TokenmillError) or getattr(error, "retryable", False)
