"""One Prefect test server for the whole session (docs/library-facts.md: ~14 s to start, ~1-2 s per small flow)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import copy_stdlib_slice


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[None]:
    from prefect.events.worker import EventsWorker
    from prefect.testing.utilities import prefect_test_harness

    # Prefect's events worker is one per process and keeps the API URL it started with: one started by an
    # earlier test (another server, since stopped) would send this server's task runs nowhere.
    EventsWorker.drain_all()
    with prefect_test_harness(server_startup_timeout=90):
        yield


def write_small_recipe(root: Path, *, max_steps: int = 30, packages: tuple[str, ...] = ("json", "email"),
                       evaluate: dict[str, Any] | None = None) -> Path:
    """A recipe over a slice of the standard library, sized to train in well under a minute.

    The full evaluation after training is off unless ``evaluate`` gives its ``eval`` section: it has tests of
    its own (tests/trainer/test_full_eval.py, the quick start's), and in every other flow test it would add a
    launched process per training run.
    """
    corpus = copy_stdlib_slice(root / "corpus", packages)
    manifest = root / "manifest.yaml"
    manifest.write_text(yaml.safe_dump({
        "name": "stdlib-slice",
        "sources": [{"name": "stdlib", "path": str(corpus), "format": "text", "glob": "**/*.py"}],
    }))
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "slice",
        "run_dir": str(root / "run"),
        "data": {"manifests": ["manifest.yaml"], "val_fraction": 0.1},
        "dedupe": {"near": {"enabled": True, "threshold": 0.8, "num_perm": 64, "ngram": 5}},
        "tokenizer": {"vocab_size": 512},
        "pack": {"seq_len": 64, "rows_per_shard": 128},
        "model": {"dims": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 64}},
        "train": {"max_steps": max_steps, "micro_batch_size": 8, "lr": 0.01, "warmup_steps": 5,
                  "checkpoint_every": 10, "eval_every": 10, "eval_batches": 4, "log_every": 5},
        "eval": evaluate if evaluate is not None else {"enabled": False},
    }))
    return recipe


class Recorder(logging.Handler):
    """Keeps the messages of the log records it handles (attach it to a Prefect logger)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
