"""trainer/metrics/trackers.py: every tracker's real local backend holds train_metrics' loss per step; a broken one
warns."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.trainer.conftest import MakeRunDir
from trainer.metrics.sink import read_metric_rows
from trainer.train import main

TRACKER_ENV = ("WANDB_MODE", "WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID",
               "TRACKIO_DIR")


def train_with_warnings(run_dir: Path, *args: str) -> list[str]:
    """Run the trainer in this process; the ``train.trackers`` warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["--run-dir", str(run_dir), *args]) == 0
    return [str(w.message) for w in caught if str(w.message).startswith("train.trackers")]


def wandb_losses(run_dir: Path) -> dict[int, float]:
    """``train/loss`` per step from the offline ``.wandb`` logs, read by wandb's own ``leet inspect --json``."""
    losses = {}
    for log in sorted((run_dir / "metrics" / "wandb" / "wandb").glob("offline-run-*/run-*.wandb")):
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                             capture_output=True, text=True, check=True, timeout=120).stdout
        for record in map(json.loads, out.splitlines()):
            if record["type"] == "history" and "train/loss" in record["history"]["item"]:
                losses[record["history"]["step"]["num"]] = record["history"]["item"]["train/loss"]
    return losses


def wandb_config(run_dir: Path) -> dict[str, object]:
    log = next((run_dir / "metrics" / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    config: dict[str, object] = {}
    for record in map(json.loads, out.splitlines()):
        if record["type"] == "config":
            config.update(record["config"].get("update", {}))
    return config


def trackio_losses(run_dir: Path) -> dict[int, float]:
    with sqlite3.connect(run_dir / "metrics" / "trackio" / "tokenmill.db") as db:
        rows = db.execute("SELECT step, metrics FROM metrics WHERE run_name = ?", (run_dir.name,)).fetchall()
    return {step: json.loads(metrics)["train/loss"] for step, metrics in rows if "train/loss" in json.loads(metrics)}


def test_every_tracker_stores_the_train_metrics_and_a_resume_continues_its_run(
        make_run_dir: MakeRunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for name in TRACKER_ENV:
        monkeypatch.delenv(name, raising=False)
    run_dir = make_run_dir(train={"max_steps": 4, "log_every": 1, "checkpoint_every": 2, "eval_every": 4,
                                  "trackers": ["tensorboard", "wandb", "mlflow", "trackio"]})
    assert train_with_warnings(run_dir, "--until-step", "2") == []
    first_ids = json.loads((run_dir / "metrics" / "trackers.json").read_text())
    assert train_with_warnings(run_dir) == []  # resumes from the step-2 checkpoint
    ids = json.loads((run_dir / "metrics" / "trackers.json").read_text())
    assert ids == first_ids and ids["mlflow_store"] == "metrics/mlflow/mlflow.db"  # same runs; no absolute path

    expected = {row["step"]: row["loss"] for row in read_metric_rows(run_dir / "metrics" / "train.jsonl")}
    assert sorted(expected) == [1, 2, 3, 4]
    events = EventAccumulator(str(run_dir / "metrics" / "tensorboard" / "train")).Reload()
    stored = {
        "tensorboard": {event.step: event.value for event in events.Scalars("train/loss")},
        "wandb": wandb_losses(run_dir),
        "trackio": trackio_losses(run_dir),
    }
    client = MlflowClient(f"sqlite:///{run_dir / 'metrics' / 'mlflow' / 'mlflow.db'}")
    stored["mlflow"] = {m.step: m.value for m in client.get_metric_history(ids["mlflow_run_id"], "train/loss")}
    for name, losses in stored.items():
        assert losses.keys() == expected.keys(), name
        assert list(losses.values()) == pytest.approx([expected[step] for step in losses], rel=1e-6), name

    # The recipe is the config: nested keys flattened with dots, as docs/recipe.md names them.
    params = client.get_run(ids["mlflow_run_id"]).data.params
    assert params["train.max_steps"] == "4" and params["model.dims.hidden_size"] == "32"
    assert wandb_config(run_dir)["train.trackers"] == json.dumps(["tensorboard", "wandb", "mlflow", "trackio"])
    assert len(client.search_runs([client.get_experiment_by_name("tokenmill").experiment_id])) == 1


def test_a_tracker_that_cannot_start_is_one_warning_and_the_run_finishes(
        make_run_dir: MakeRunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "no-such-store://anywhere")
    run_dir = make_run_dir(train={"max_steps": 2, "log_every": 1, "trackers": ["mlflow", "tensorboard"]})
    messages = train_with_warnings(run_dir)
    assert len(messages) == 1 and messages[0].startswith("train.trackers: mlflow did not start (")
    assert "MLFLOW_TRACKING_URI" in messages[0] and "\n" not in messages[0]
    assert [row["step"] for row in read_metric_rows(run_dir / "metrics" / "train.jsonl")] == [1, 2]
    assert list((run_dir / "metrics" / "tensorboard" / "train").glob("events.out.tfevents.*"))
    assert (run_dir / "model" / "model.safetensors").is_file()


def test_the_older_tensorboard_switch_folds_into_trackers() -> None:
    from pydantic import ValidationError

    from trainer.config import TrainConfig

    assert TrainConfig().trackers == ["tensorboard"]
    assert TrainConfig(tensorboard=False).trackers == []
    assert TrainConfig(tensorboard=False, trackers=["tensorboard", "wandb"]).trackers == ["wandb"]
    assert TrainConfig(tensorboard=True, trackers=["mlflow", "mlflow"]).trackers == ["tensorboard", "mlflow"]
    with pytest.raises(ValidationError, match="tracker_project"):
        TrainConfig(tracker_project="x' OR name LIKE '%")  # it goes into MLflow's experiment search filter
