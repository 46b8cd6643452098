"""Process-wide defaults that make Prefect and Hugging Face libraries work offline on a laptop."""

from __future__ import annotations

import os
from pathlib import Path

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
        os.environ["PREFECT_HOME"] = str(home)
