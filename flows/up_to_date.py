"""Whether a command would find nothing to do, decided before Prefect is imported or a server is started.

A fully skipped ``tokenmill run`` spent ~10 s on orchestration alone (the temporary server, Prefect's imports,
~20 flow and task runs reported to it) to learn, stage by stage, that nothing had changed. Each stage decides
from its own inputs: the recipe, the manifests, the source files, the files the recipe names, the installed
versions and the run dir's own files. So when ``run``, ``prepare`` or ``train`` finishes, it records a *seal*:
one fingerprint over all of those, with every run-dir file identified by size, mtime and inode, and the summary
it printed. A later call of the same command that computes the same fingerprint would skip every stage, so it
prints that summary and exits in about a second, with no flow run. Any change, by anyone (a new corpus file, a
refresh, an edited manifest, a deleted or rewritten shard, a newer library), changes the fingerprint, and the
command runs its flow, which decides stage by stage as before. A run whose evaluation left a failed result is
not sealed: the next run retries it.

The seal is stricter than the stages (a stage's marker rewritten with the same content breaks it), never looser:
it can only send a command down the full path, never skip work a stage would have done.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import warnings
from pathlib import Path
from typing import Any

from core.atomic import read_json
from core.rundir import RunPaths, file_stats, fingerprint, path_inside_run
from flows.recipe import ResolvedRun
from flows.stage_times import installed_versions
from pipeline.ingest import collect_sources, list_source_files

SEAL_VERSION = 1


def sealed_summary(run: ResolvedRun, command: str) -> dict[str, Any] | None:
    """The summary ``command`` printed when it last finished, if nothing it reads changed since; else None.

    Call it holding the run dir's lock (no other process is writing the run dir).
    """
    seal_file = run.paths.command_seal(command)
    if not seal_file.is_file() or not path_inside_run(run.paths.root, seal_file):
        return None
    try:
        seal = read_json(seal_file)
    except (OSError, ValueError):
        return None  # a damaged seal only costs the full path, which rewrites it
    if not isinstance(seal, dict) or seal.get("version") != SEAL_VERSION or not isinstance(seal.get("summary"), str):
        return None
    if seal.get("fingerprint") != inputs_fingerprint(run, command):
        return None
    try:
        summary = json.loads(_with_run_dir(seal["summary"], run.paths.root))
    except ValueError:
        return None
    return summary if isinstance(summary, dict) else None


def write_seal(run: ResolvedRun, command: str, summary: dict[str, Any]) -> None:
    """Record that ``command`` finished on the run dir as it is now, with ``summary`` (JSON-serialisable).

    The summary is kept in its skipped form (:func:`as_skipped`), as JSON text: the order of its keys is the
    flow's, not write_json's sorted one. The run dir's own path in it (``run_dir``, ``report``, ``model_dir``)
    is kept as RUN_DIR_MARK: a run dir holds no absolute path of its own.
    """
    text = json.dumps(as_skipped(summary), default=str)
    run.paths.write_json(run.paths.command_seal(command), {
        "version": SEAL_VERSION, "command": command, "sealed_unix_s": round(time.time(), 3),
        "fingerprint": inputs_fingerprint(run, command), "summary": _without_run_dir(text, run.paths.root)})


RUN_DIR_MARK = "${RUN_DIR}"
"""Where a seal's summary named the run dir; the run dir it is read from takes its place."""


def _run_dir_in_json(root: Path) -> re.Pattern[str]:
    """The run dir's path as it appears in JSON text, as a whole path (``/x/run`` never matches ``/x/run2``)."""
    return re.compile(re.escape(json.dumps(str(root))[1:-1]) + r'(?=["/])')


def _without_run_dir(text: str, root: Path) -> str:
    return _run_dir_in_json(root).sub(lambda _: RUN_DIR_MARK, text)


def _with_run_dir(text: str, root: Path) -> str:
    return text.replace(RUN_DIR_MARK, json.dumps(str(root))[1:-1])


def as_skipped(summary: Any) -> Any:
    """``summary`` as a re-run that skips every stage returns it: no parts ingested, every stage ``skipped``.

    A skipped stage returns its recorded summary (its marker's, written with sorted keys) with ``"skipped": True``
    last, in place of the ``False`` it returned when it did the work; tests/test_readme_commands.py holds this
    equal to a skipped flow's own summary.
    """
    if isinstance(summary, list):
        return [as_skipped(item) for item in summary]
    if not isinstance(summary, dict):
        return summary
    if "skipped" in summary:  # a stage's summary: as its marker holds it
        recorded = json.loads(json.dumps({k: v for k, v in summary.items() if k != "skipped"}, sort_keys=True))
        return {**recorded, "skipped": True}
    skipped = {key: as_skipped(value) for key, value in summary.items()}
    if "parts_ingested" in skipped:
        skipped["parts_ingested"] = 0
    return skipped


def inputs_fingerprint(run: ResolvedRun, command: str) -> str:
    """One sha256 over everything the command's stages read to decide whether they have work to do."""
    paths = run.paths
    manifests = [item.path for item in run.manifests]
    with warnings.catch_warnings():  # the full path says them (once, when the seal was written)
        warnings.simplefilter("ignore")
        sources = {name: [str(manifest_path), [(f.rel, f.size, f.version)
                                               for f in list_source_files(source, manifest_path, paths.root)]]
                   for name, (manifest_path, source) in sorted(collect_sources(list(run.manifests)).items())}
    recipe = run.recipe.model_dump(mode="json")
    root = paths.root.resolve()
    named = sorted({str(path) for path in _named_paths(recipe, run.base) if root != path and root not in path.parents})
    # a manifest names its classifier's model file: a retrained one is a change (a recipe without one seals as before)
    classifiers = [item.manifest.filters.quality_classifier for item in run.manifests]
    models = [_model_sha256(config.model_file()) for config in classifiers if config is not None]
    return fingerprint("seal", command, recipe, str(run.base), [_sha256(path) for path in manifests], sources,
                       [_tree(path, path, paths) for path in map(Path, named)], installed_versions(),
                       _tree(paths.root, paths.root, paths), *([models] if models else []))


def _named_paths(value: Any, base: Path) -> list[Path]:
    """Every string in the recipe that names an existing file or folder (relative ones from the recipe's folder).

    Tokenizer files, base models, evaluation task folders and data files: whatever field names them, now or
    in a later recipe version. A string that only happens to match a path adds an input, never removes one.
    """
    if isinstance(value, dict):
        return [path for item in value.values() for path in _named_paths(item, base)]
    if isinstance(value, list):
        return [path for item in value for path in _named_paths(item, base)]
    if isinstance(value, str) and value and "\0" not in value:
        path = base / value
        if path.exists():
            return [path.resolve()]
    return []


def _tree(root: Path, top: Path, paths: RunPaths) -> list[tuple[str, int, str]]:
    """``top``'s files by size, mtime and inode; in the run dir less the seals, the lock and the stage-time log,
    which skipped stages append to (as :func:`flows.report.report_inputs_fingerprint` leaves it out)."""
    if top != paths.root:  # a named folder outside the run dir; one that holds it (a workspace) counts it once
        return file_stats(root, top, frozenset({paths.root.resolve()}), hash_small=False)
    return file_stats(root, top, frozenset({paths.seals, paths.lock_file, paths.stage_times}), hash_small=False)


def _model_sha256(path: Path) -> str:
    """The classifier model's sha256 as it is now (the manifest's was taken when the command loaded it), cached by
    the file's stats (:func:`pipeline.quality_classifier.check_model_file`); "missing" when it cannot be read."""
    from pipeline.quality_classifier import check_model_file

    try:
        stat = path.stat()
        return check_model_file(path, stat.st_size, stat.st_mtime_ns, stat.st_ino)[1]
    except (OSError, ValueError):
        return "missing"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"
