"""Test-wide settings: offline, isolated Prefect home, a small real corpus from the standard library."""

from __future__ import annotations

import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

import pytest

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def pytest_configure(config: pytest.Config) -> None:
    home = Path(tempfile.mkdtemp(prefix="tokenmill-prefect-home-"))
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def copy_stdlib_slice(target: Path, packages: tuple[str, ...] = ("json", "email", "logging", "http")) -> Path:
    """Copy a few standard-library packages' .py files into ``target`` (a real, small corpus)."""
    for package in packages:
        for source in sorted((STDLIB / package).rglob("*.py")):
            destination = target / package / source.relative_to(STDLIB / package)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, destination)
    return target
