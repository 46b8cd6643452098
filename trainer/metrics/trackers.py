"""Experiment trackers: the rows MetricsSink writes to metrics/*.jsonl -> TensorBoard, W&B, MLflow and trackio.

Accelerate's tracker classes do the talking; this module decides where each one stores its data (inside the run
dir unless the backend's own environment variable says otherwise), logs the resolved recipe as the run's config,
remembers the W&B and MLflow run ids in ``metrics/trackers.json`` so a resumed run continues the same tracker
run, and keeps a tracker that fails from failing training: it is one warning and training goes on without it.
Only the main process (rank 0) builds trackers.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelerate.tracking import GeneralTracker, MLflowTracker, TensorBoardTracker, TrackioTracker, WandBTracker

from core.layout import RELATIVE, run_key
from core.rundir import RunPaths

TRACKER_PROJECT = "train"
"""TensorBoard's folder under ``metrics/tensorboard/``: the event files land in ``metrics/tensorboard/train/``."""

TRACKER_NAMES = ("tensorboard", "wandb", "mlflow", "trackio")
"""What ``train.trackers`` may list."""

TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
INSTALL_HINT = "pip install 'tokenmill[trackers]'"
RUN_DIR_STORE = run_key(RELATIVE.mlflow_store)
"""``mlflow_store`` of a run made in the run dir's own SQLite store (MLFLOW_TRACKING_URI unset)."""


class Trackers:
    """The started trackers; a tracker that raises is reported once and dropped, never stopping training."""

    def __init__(self, trackers: dict[str, GeneralTracker]) -> None:
        self.trackers = trackers

    def log(self, values: dict[str, float], step: int) -> None:
        """Send ``values`` at ``step`` to every live tracker (MetricsSink's ``tracker``)."""
        for name, tracker in list(self.trackers.items()):
            self._call(name, "stopped logging", lambda t=tracker: t.log(values, step=step))

    def finish(self) -> None:
        """Flush and close every tracker (also when training stopped with an error)."""
        for name, tracker in list(self.trackers.items()):
            self._call(name, "did not close cleanly", tracker.finish)
        self.trackers = {}

    def _call(self, name: str, failed: str, call: Callable[[], object]) -> None:
        try:
            call()
        except Exception as err:  # a tracker's backend (disk, server, SDK) must not end a week-long run
            del self.trackers[name]
            warn_tracker(name, failed, err, "metrics/*.jsonl still have every row")


def warn_tracker(name: str, failed: str, err: BaseException | None, fix: str) -> None:
    """One warning line naming the tracker, what went wrong and what to do; training goes on."""
    reason = f" ({type(err).__name__}: {first_line(err)})" if err is not None else ""
    warnings.warn(f"train.trackers: {name} {failed}{reason}; training goes on without it. {fix}", stacklevel=3)


def first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:300] if lines else ""


def start_trackers(names: list[str], paths: RunPaths, project: str, recipe: dict[str, Any],
                   resuming: bool) -> Trackers:
    """Start the trackers in ``names`` (main process only), each with the flattened recipe as its config.

    ``resuming``: training continues from a checkpoint, so W&B and MLflow continue the run ids stored in
    ``metrics/trackers.json``; a fresh start begins new tracker runs.
    """
    ids = read_tracker_ids(paths) if resuming else {}
    ids["resuming"] = "yes" if resuming else ""
    config = flatten_config(recipe)
    started: dict[str, GeneralTracker] = {}
    for name in names:
        if importlib.util.find_spec(TRACKER_PACKAGES[name]) is None:
            warn_tracker(name, "is not installed", None, f"{INSTALL_HINT}, or remove it from train.trackers")
            continue
        try:
            tracker = BUILDERS[name](paths, project, ids)
            tracker.start()
            tracker.store_init_configuration(config)
        except Exception as err:  # a backend that cannot start (bad URI, full disk) costs its logs, not the run
            warn_tracker(name, "did not start", err, FIXES[name])
            continue
        started[name] = tracker
    remember_tracker_ids(paths, started, ids)
    return Trackers(started)


def flatten_config(recipe: dict[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """``{"train.lr": 0.001, ...}``: the scalar types every tracker's config accepts; lists and None as JSON."""
    flat: dict[str, str | int | float | bool] = {}
    for key, value in recipe.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_config(value, f"{name}."))
        elif isinstance(value, str | int | float | bool):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, default=str)
    return flat


def tensorboard_tracker(paths: RunPaths, project: str, ids: dict[str, str]) -> GeneralTracker:
    return TensorBoardTracker(TRACKER_PROJECT, logging_dir=str(paths.tensorboard))


def wandb_tracker(paths: RunPaths, project: str, ids: dict[str, str]) -> GeneralTracker:
    """Offline into ``metrics/wandb/`` unless WANDB_MODE / WANDB_DIR say otherwise; resumes the stored run id."""
    options: dict[str, Any] = {"name": paths.root.name, "id": ids.get("wandb_run_id") or uuid.uuid4().hex[:16],
                               "resume": "allow"}
    if "WANDB_MODE" not in os.environ:
        options["mode"] = "offline"
    if "WANDB_DIR" not in os.environ:
        (paths.wandb).mkdir(parents=True, exist_ok=True)
        options["dir"] = str(paths.wandb)
    return WandBTracker(project, **options)


def mlflow_uri(paths: RunPaths) -> str:
    """MLFLOW_TRACKING_URI when set, else a SQLite store in ``metrics/mlflow/`` (MLflow 3 refuses file stores)."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    paths.mlflow.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{paths.mlflow.resolve() / paths.mlflow_store.name}"


def mlflow_tracker(paths: RunPaths, project: str, ids: dict[str, str]) -> GeneralTracker:
    """A run in experiment ``project``; continues the stored run when it was made in the same store."""
    import mlflow  # the [trackers] extra: only when train.trackers names it

    user_uri = os.environ.get("MLFLOW_TRACKING_URI")
    store = user_uri or RUN_DIR_STORE  # no absolute path kept in the run dir
    uri = mlflow_uri(paths)
    mlflow.set_tracking_uri(uri)  # MLflowTracker talks to the process-wide store; this also sets the env var,
    if user_uri is None:  # which would send the next run started in this process to this run's store
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    run_id = ids.get("mlflow_run_id") if ids.get("mlflow_store") == store else None
    artifacts = None if user_uri else str(paths.mlflow_artifacts)
    tracker = MLflowTracker(experiment_name=project, logging_dir=artifacts, run_id=run_id, run_name=paths.root.name)
    tracker.store = store
    return tracker


def trackio_tracker(paths: RunPaths, project: str, ids: dict[str, str]) -> GeneralTracker:
    """A local trackio project in ``metrics/trackio/`` unless TRACKIO_DIR is set; resumes the run of this name."""
    target = Path(os.environ.get("TRACKIO_DIR") or paths.trackio)
    saved = os.environ.get("TRACKIO_DIR")
    os.environ["TRACKIO_DIR"] = str(target)  # trackio reads it once, when first imported
    try:
        trackio_utils = importlib.import_module("trackio.utils")
    finally:
        if saved is None:
            del os.environ["TRACKIO_DIR"]
    if Path(trackio_utils.TRACKIO_DIR).resolve() != target.resolve():
        raise RuntimeError(f"trackio was already imported in this process and logs to {trackio_utils.TRACKIO_DIR}, "
                           f"not {target}")
    return TrackioTracker(project, name=paths.root.name, resume="allow" if ids["resuming"] else "never",
                          embed=False)


BUILDERS: dict[str, Callable[[RunPaths, str, dict[str, str]], GeneralTracker]] = {
    "tensorboard": tensorboard_tracker, "wandb": wandb_tracker, "mlflow": mlflow_tracker, "trackio": trackio_tracker}
FIXES = {
    "tensorboard": "check that metrics/tensorboard/ is writable",
    "wandb": "check WANDB_MODE / WANDB_DIR (default: offline into metrics/wandb/), or remove wandb from train.trackers",
    "mlflow": "check MLFLOW_TRACKING_URI (default: sqlite in metrics/mlflow/), or remove mlflow from train.trackers",
    "trackio": "check TRACKIO_DIR (default: metrics/trackio/), or remove trackio from train.trackers",
}


def read_tracker_ids(paths: RunPaths) -> dict[str, str]:
    """The stored tracker run ids; an unreadable file means new tracker runs (with a warning), not a failed run."""
    path = paths.tracker_ids
    if not path.is_file():
        return {}
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        warnings.warn(f"{path}: unreadable ({err}); the trackers start new runs. Delete the file to silence this.",
                      stacklevel=3)
        return {}
    if not isinstance(ids, dict):
        return {}
    return {key: value for key, value in ids.items() if isinstance(key, str) and isinstance(value, str)}


def remember_tracker_ids(paths: RunPaths, started: dict[str, GeneralTracker], previous: dict[str, str]) -> None:
    """Write ``metrics/trackers.json`` with the ids of the runs just started (kept for trackers not started now)."""
    ids = {key: value for key, value in previous.items() if key != "resuming"}
    if "wandb" in started:
        ids["wandb_run_id"] = started["wandb"].run.id
    if "mlflow" in started:
        ids["mlflow_run_id"] = started["mlflow"].active_run.info.run_id
        ids["mlflow_store"] = started["mlflow"].store
    if ids:
        paths.metrics.mkdir(parents=True, exist_ok=True)
        paths.write_json(paths.tracker_ids, ids)
