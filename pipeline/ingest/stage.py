"""Ingest stage: source files -> ``docs/part-NNNNN.parquet`` (documents) + ``rejects/part-NNNNN.parquet`` +
``attributes/part-NNNNN.parquet`` (what the filters measured).

Two steps, so a Prefect task per part can be retried alone: :func:`plan_ingest` groups the sources'
files into parts and persists that plan (``docs/plan.json``), :func:`ingest_part` reads one part,
normalises and filters every record and writes its outputs, then its marker ``stages/ingest/part-NNNNN.json``.
Given the run's near-dedupe settings, it also leaves the part's MinHash signatures for the dedupe stage
(``dedupe/minhash/part-NNNNN.parquet``), made from the text while it is in memory.
"""

from __future__ import annotations

import os
import stat
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import ManifestError
from core.files.atomic import read_json
from core.layout import part_unit
from core.rundir import RunPaths, fingerprint
from core.schemas import ATTRIBUTES_SCHEMA, REJECTS_SCHEMA, documents_schema
from core.stage import Inputs, Progress, Stage, read_marker, run_stage, stage_status
from pipeline.config import NearDedupeConfig
from pipeline.filters.normalisation import normalise_text
from pipeline.filters.screen import Attributes, measure_text, redact_pii
from pipeline.filters.thresholds import decision_settings, measurement_settings
from pipeline.globs import glob_reaches, glob_regex
from pipeline.ingest.part_files import (
    ParquetSink,
    SignatureCollector,
    attribute_row,
    document_row,
    reject_row,
)
from pipeline.ingest.readers import Record, Reject, escape_file_name, file_kind, read_file
from pipeline.ingest.redecide import redecide_part
from pipeline.ingest.streams import decompressed_size_estimate
from pipeline.ingest.unmatched_source import local_names, matched_before, unmatched_source_error
from pipeline.ingest.worker_preload import INGEST_PRELOAD  # noqa: F401  (flows.pipeline takes it from here)
from pipeline.manifest import (
    CorpusManifest,
    FilterConfig,
    ManifestFile,
    SourceConfig,
    as_manifest_files,
    load_manifest,
    resolve_source_path,
)
from pipeline.objects import ObjectPath, list_objects

PLAN_VERSION = 1
NEW_FILES_SHOWN = 5
"""How many of a new part's files ``tokenmill status`` names."""
PROGRESS_EVERY_RECORDS = 1_000
"""``ingest_part`` reports progress after each file and every this many records within a file."""


@dataclass(frozen=True)
class IngestPart:
    """One unit of ingest work: some files of one source, written as ``part-{part_id:05d}``."""

    part_id: int
    source: str
    manifest_path: str
    files: tuple[str, ...]
    num_bytes: int = field(default=0, compare=False)
    """Size of its files at plan time (bytes): the total a progress bar counts towards."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (Prefect parameters)."""
        return {"part_id": self.part_id, "source": self.source, "manifest_path": self.manifest_path,
                "files": list(self.files), "num_bytes": self.num_bytes}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IngestPart:
        return cls(int(data["part_id"]), str(data["source"]), str(data["manifest_path"]), tuple(data["files"]),
                   int(data.get("num_bytes", 0)))


@dataclass(frozen=True)
class SourceFile:
    """A file of a source as listed at plan time; its size and version tell a later plan that it changed."""

    rel: str
    size: int
    version: int | str
    """A local file's mtime in ns; an object's ETag (:func:`pipeline.objects.object_version`)."""



def part_marker(paths: RunPaths, part_id: int) -> Path:
    """``stages/ingest/part-NNNNN.json``: written last, so its presence means the part is complete."""
    return paths.marker("ingest", part_unit(part_id))


def part_finished(paths: RunPaths, part_id: int) -> bool:
    """Whether the part's documents and marker (``stages/ingest/``) exist.

    The documents are checked too: a marker never vouches for a part whose ``docs/`` was deleted (to re-ingest).
    """
    return paths.document_part(part_id).is_file() and part_marker(paths, part_id).is_file()


# ---- planning -----------------------------------------------------------------------------------


def collect_sources(manifests: list[Path] | list[ManifestFile]) -> dict[str, tuple[Path, SourceConfig]]:
    """``{source name: (absolute manifest path, source)}``; a name defined twice is a ManifestError.

    ``manifests``: as the caller loaded them (a flow's resolved run), or their paths (loaded here).
    """
    sources: dict[str, tuple[Path, SourceConfig]] = {}
    for loaded in as_manifest_files(manifests):
        manifest_path = loaded.path
        for source in loaded.manifest.sources:
            if source.name in sources:
                raise ManifestError(
                    f"{manifest_path}: source '{source.name}' is also defined in {sources[source.name][0]}; "
                    "source names must be unique across a recipe's manifests, rename one."
                )
            sources[source.name] = (manifest_path, source)
    return sources


def source_root(source: SourceConfig, manifest_path: Path) -> Path | ObjectPath:
    """Folder that uris are relative to: the source folder, or the parent of a single file/dataset (or object)."""
    path = resolve_source_path(source, manifest_path)
    if isinstance(path, ObjectPath):
        return path if path.is_dir() else path.parent
    return path if path.is_dir() and source.format != "hf_disk" else path.parent


RUN_DIR_SIGNATURES = (("ingest_plan",), ("recipe", "lock_file"))
"""A folder holding ``docs/plan.json``, or both ``run.yaml`` and ``.lock``, is a tokenmill run dir."""


def list_source_files(source: SourceConfig, manifest_path: Path, run_dir: Path | None = None) -> list[SourceFile]:
    """The source's files (``glob`` minus ``exclude``, which may also name folders), sorted by path.

    One walk that prunes excluded folders: globbing first and filtering after would walk, say, the
    11k files of ``site-packages`` under the stdlib only to drop them. Folders that are tokenmill run dirs
    (``run_dir``, the run being planned, or any other: :data:`RUN_DIR_SIGNATURES`) are not entered, with a
    warning: a run never ingests its own or another run's outputs.

    Symbolic links, files and folders alike: one that resolves inside the source folder is read under its
    own path (a linked file is listed, a linked folder is not walked twice); one that resolves outside it,
    and any FIFO, socket or device, is listed so that :func:`pipeline.ingest.readers.refusal` records it as an
    ``outside_source`` / ``not_a_regular_file`` reject when its part is read; a link leading nowhere
    (dangling, or a loop) holds nothing and is skipped with a warning.
    Raises ManifestError when the source path is not a regular file or folder, or lies inside ``run_dir``, and
    when the source matches no file (a glob typo, an exclude that excludes everything, an empty dataset folder)
    unless ``run_dir``'s plan lists files of it already (a refresh that finds nothing new).
    """
    path = resolve_source_path(source, manifest_path)
    if isinstance(path, ObjectPath):
        files = _list_source_objects(path, source)
    else:
        _check_source_path(path, source, manifest_path, run_dir)
        files = _list_local_files(path, source, run_dir)
    if not files and not matched_before(run_dir, source.name):
        if isinstance(path, ObjectPath):
            raise unmatched_source_error(source, manifest_path, path.url, [rel for rel, _, _ in list_objects(path)])
        raise unmatched_source_error(source, manifest_path, str(path), local_names(path))
    return files


def _list_local_files(path: Path, source: SourceConfig, run_dir: Path | None) -> list[SourceFile]:
    """:func:`list_source_files` of a local file or folder."""
    if source.format == "hf_disk" and path.is_dir() and not any(child.is_file() for child in path.rglob("*")):
        return []  # an empty dataset folder holds nothing to read
    if not path.is_dir() or source.format == "hf_disk":
        return [_stat_file(path, path.name)]
    include = glob_regex(source.glob)
    excludes = [glob_regex(pattern) for pattern in source.exclude]
    run_root = run_dir.resolve() if run_dir is not None else None
    files = []
    for folder, subfolders, names in os.walk(path):
        prefix = Path(folder).relative_to(path).as_posix() + "/" if folder != str(path) else ""
        walked = []
        for name in sorted(d for d in subfolders if not any(x.fullmatch(prefix + d) for x in excludes)):
            entry = Path(folder) / name
            if entry.is_symlink():  # a folder link: listed when it leads outside (for its reject), never walked
                if not _is_inside(entry, path) and glob_reaches(source.glob, prefix + name):
                    files.append(_lstat_file(entry, prefix + name))
            elif _is_run_dir(entry, run_root):
                warnings.warn(f"source '{source.name}': {escape_file_name(prefix + name)}"
                              "/ is a tokenmill run dir inside the source folder; it is not read "
                              "(keep run dirs out of source folders)", stacklevel=3)
            else:
                walked.append(name)
        subfolders[:] = walked
        for name in names:
            rel = prefix + name
            if include.fullmatch(rel) and not any(x.fullmatch(rel) for x in excludes):
                files += _listed_file(path / rel, rel, path, source.name)
    return sorted(files, key=lambda file: file.rel)


def _list_source_objects(root: ObjectPath, source: SourceConfig) -> list[SourceFile]:
    """The objects under a ``s3://`` prefix matched as local files are: ``glob`` minus ``exclude`` on the key
    relative to the prefix (an excluded folder excludes every key under it); versioned by ETag."""
    include = glob_regex(source.glob)
    excludes = [glob_regex(pattern) for pattern in source.exclude]
    listed = list_objects(root)
    if len(listed) == 1 and listed[0][0] == root.name and not root.is_dir():
        return [SourceFile(*listed[0])]
    files = []
    for rel, size, version in listed:
        folders = ["/".join(rel.split("/")[:depth]) for depth in range(1, rel.count("/") + 1)]
        if include.fullmatch(rel) and not any(x.fullmatch(name) for x in excludes for name in [*folders, rel]):
            files.append(SourceFile(rel, size, version))
    return files


def _check_source_path(path: Path, source: SourceConfig, manifest_path: Path, run_dir: Path | None) -> None:
    """A source path must be a regular file or a folder (a FIFO would hang the read, a device never end),
    and must not be this run's own outputs."""
    mode = path.stat().st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise ManifestError(
            f"{manifest_path}: sources[{source.name}].path {source.path!r} is a {file_kind(mode)} "
            f"(resolved to {path}), not a regular file or a folder; tokenmill reads regular files only: "
            "point path at a file or a folder of files."
        )
    if run_dir is not None and path.is_relative_to(run_dir.resolve()):
        raise ManifestError(
            f"{manifest_path}: sources[{source.name}].path {source.path!r} is inside the run dir {run_dir}; "
            "a run never reads its own outputs: point path at the input files, or use another --run-dir."
        )


def _is_run_dir(folder: Path, run_root: Path | None) -> bool:
    """Whether ``folder`` is the run being planned or looks like any tokenmill run dir."""
    if run_root is not None and folder.resolve() == run_root:
        return True
    layout = RunPaths(folder)
    return any(all(getattr(layout, name).is_file() for name in signature) for signature in RUN_DIR_SIGNATURES)


def _is_inside(entry: Path, root: Path) -> bool:
    try:
        return entry.resolve(strict=True).is_relative_to(root)
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop, up to Python 3.12
        return False


def _listed_file(path: Path, rel: str, root: Path, source_name: str) -> list[SourceFile]:
    """``[the file as listed]``, or ``[]`` for a link that leads nowhere (a warning says so) or a file gone."""
    try:
        target = path.stat()
    except (OSError, RuntimeError):
        if path.is_symlink():
            warnings.warn(f"source '{source_name}': {escape_file_name(rel)} is a symbolic link that leads nowhere "
                          "(its target is missing, or it loops); it is skipped", stacklevel=3)
        return []
    if path.is_symlink() and not _is_inside(path, root):
        return [_lstat_file(path, rel)]  # its size and time are the link's own: nothing outside is looked at
    return [SourceFile(rel, target.st_size, target.st_mtime_ns)]


def _lstat_file(path: Path, rel: str) -> SourceFile:
    stat_result = path.lstat()
    return SourceFile(rel, stat_result.st_size, stat_result.st_mtime_ns)


def _stat_file(path: Path, rel: str) -> SourceFile:
    if path.is_dir():  # an hf_disk dataset folder counts as one file
        stats = [child.stat() for child in path.rglob("*") if child.is_file()]
        return SourceFile(rel, sum(s.st_size for s in stats), max((s.st_mtime_ns for s in stats), default=0))
    stat_result = path.stat()
    return SourceFile(rel, stat_result.st_size, stat_result.st_mtime_ns)


def group_files(files: list[SourceFile], part_size_bytes: int) -> Iterator[list[SourceFile]]:
    """Consecutive files in groups of about ``part_size_bytes``; a bigger file is a group of its own."""
    group: list[SourceFile] = []
    group_bytes = 0
    for file in files:
        if group and group_bytes + file.size > part_size_bytes:
            yield group
            group, group_bytes = [], 0
        group.append(file)
        group_bytes += file.size
    if group:
        yield group


def plan_ingest(manifests: list[Path] | list[ManifestFile], paths: RunPaths, part_size_bytes: int) -> list[IngestPart]:
    """Parts still to ingest in plan order, planning new files into new parts; the plan persists in
    ``docs/plan.json``. Start them in :func:`largest_first` order.

    A file is planned once: a killed run gets its unfinished parts back unchanged, and a refresh puts
    only new files (by path) into parts numbered after the existing ones. A planned file that changed
    after its part was ingested is not re-read (a warning names it). Raises ManifestError when two
    manifests define the same source name. ``manifests``: as loaded by the caller, or their paths.
    """
    loaded = as_manifest_files(manifests)
    parts = planned_parts(loaded, paths, part_size_bytes)
    decisions = {str(item.path): fingerprint("ingest_decision", decision_settings(item.manifest.filters))
                 for item in loaded}
    return [part for part in parts if not part_finished(paths, part.part_id)
            or _decided_otherwise(paths, part.part_id, decisions[part.manifest_path])]


def planned_parts(manifests: list[Path] | list[ManifestFile], paths: RunPaths, part_size_bytes: int,
                  write: bool = True) -> list[IngestPart]:
    """Every part of the plan whose source the recipe has, in plan order, new files planned into new parts;
    ``write``: persist the plan (``docs/plan.json``), else only say what it would be (``tokenmill status``)."""
    sources = collect_sources(manifests)
    plan_path = paths.ingest_plan
    plan = read_json(plan_path) if plan_path.is_file() else {"version": PLAN_VERSION, "parts": [], "files": {}}
    before = repr(plan)
    for name, (manifest_path, source) in sorted(sources.items()):
        _plan_source(plan, name, list_source_files(source, manifest_path, paths.root), part_size_bytes, paths)
    if write and repr(plan) != before:
        paths.write_json(plan_path, plan)
    return [
        IngestPart(part["part_id"], part["source"], str(sources[part["source"]][0]), tuple(part["files"]),
                   sum(plan["files"][part["source"]].get(rel, [0])[0] for rel in part["files"]))
        for part in plan["parts"] if part["source"] in sources
    ]


def _decided_otherwise(paths: RunPaths, part_id: int, decided: str) -> bool:
    """Whether a finished part was decided with other thresholds (a marker of before attributes records none)."""
    marker = paths.marker("ingest", part_unit(part_id))
    return marker.is_file() and read_json(marker).get("decided", decided) != decided


def largest_first(parts: list[IngestPart], manifests: dict[str, CorpusManifest] | None = None) -> list[IngestPart]:
    """``parts`` by decompressed bytes, most first (ties by part_id): the order to start them in on workers.

    Workers that take the parts in this order finish together (longest-processing-time-first scheduling);
    in plan order a big part planned last (a ``.jsonl.gz`` file of its own: 9 MB on disk, 35 MB of text)
    ran alone on one core while the other idled. Part ids, files and outputs do not depend on the order.
    ``manifests``: ``{manifest path: manifest}`` as the caller loaded them (:func:`by_path`); else read here.
    """
    roots: dict[tuple[str, str], Path | ObjectPath] = {}
    for part in parts:
        if (part.manifest_path, part.source) not in roots:
            manifest_path = Path(part.manifest_path)
            _, source = _part_source(part, manifest_path, _loaded(part, manifests))
            roots[part.manifest_path, part.source] = source_root(source, manifest_path)

    def size(part: IngestPart) -> int:
        root = roots[part.manifest_path, part.source]
        if isinstance(root, ObjectPath):
            return part.num_bytes  # the sizes listed at plan time: no request per object only to order the work
        return sum(decompressed_size_estimate(root / rel) for rel in part.files)

    sizes = {part.part_id: size(part) for part in parts}
    return sorted(parts, key=lambda part: (-sizes[part.part_id], part.part_id))


def _plan_source(plan: dict[str, Any], name: str, listed: list[SourceFile], part_size_bytes: int,
                 paths: RunPaths) -> None:
    known: dict[str, list[int]] = plan["files"].setdefault(name, {})
    ingested = {rel for part in plan["parts"] if part["source"] == name
                and part_finished(paths, part["part_id"]) for rel in part["files"]}
    for file in listed:
        recorded = known.get(file.rel)
        if recorded is None or recorded == [file.size, file.version]:
            continue
        if file.rel in ingested:
            warnings.warn(
                f"source '{name}': {file.rel} changed after it was ingested; it is not re-read. To ingest "
                "the new content, add it under a new file name (or use a new run dir).",
                stacklevel=3,
            )
        else:
            known[file.rel] = [file.size, file.version]
    next_id = 1 + max((part["part_id"] for part in plan["parts"]), default=-1)
    for group in group_files([file for file in listed if file.rel not in known], part_size_bytes):
        plan["parts"].append({"part_id": next_id, "source": name, "files": [file.rel for file in group]})
        known.update({file.rel: [file.size, file.version] for file in group})
        next_id += 1


# ---- ingesting one part -------------------------------------------------------------------------


def ingest_part(part: IngestPart, val_fraction: float, paths: RunPaths,
                on_progress: Callable[[int, int], None] | None = None,
                near: NearDedupeConfig | None = None, manifest: CorpusManifest | None = None) -> dict[str, Any]:
    """Read, normalise and filter one part; write its documents, rejects and (last) its marker.

    Returns ``{"part_id", "source", "num_records", "num_documents", "num_rejects", "rejects_by_reason",
    "redactions_by_kind", "num_bytes"}`` (redactions are counted in every record that reached the filters);
    a part already done with the same settings returns its recorded summary at once
    (:class:`IngestStage`, ``skipped``).
    ``on_progress(num_records, num_bytes)`` is told what was read since its last call (a file's bytes count
    once the file is read), so a caller can show rates; the totals add up to the summary's.
    Raises SourceReadError for an unreadable file of an ``on_error: fail`` source.

    With ``near`` (the run's near-dedupe settings), the part's MinHash signatures are computed here, from
    each row group's text while it is in memory, and left as the dedupe stage's signature cache: dedupe
    then need not decode the part's text again. Without it, a signature cache from earlier is removed.

    Besides documents and rejects (with the text a filter rejected), every parsed record's measured values go to
    ``attributes/part-NNNNN.parquet``. A part done with the same files and measurement settings but other thresholds
    (:mod:`pipeline.filters.thresholds`) is re-decided from those (:func:`pipeline.ingest.redecide.redecide_part`): no
    source file is opened. ``manifest``: the part's manifest as the caller loaded it (a flow's resolved run); read from
    ``part.manifest_path`` when None.
    """
    stage = IngestStage(paths, [part], val_fraction, near,
                        None if manifest is None else {part.manifest_path: manifest})
    progress = None if on_progress is None else _per_call(on_progress)
    return run_stage(stage, part_unit(part.part_id), on_progress=progress).as_summary()


def _per_call(on_progress: Callable[[int, int], None]) -> Progress:
    """The runner's running totals as ``on_progress(num_records, num_bytes)`` read since the last call."""
    told = {"records": 0, "bytes": 0}

    def progress(done: int, total: int | None, counts: dict[str, int] | None = None) -> None:
        records = (counts or {}).get("records", told["records"])
        on_progress(records - told["records"], done - told["bytes"])
        told.update(records=records, bytes=done)

    return progress


class IngestStage(Stage):
    """Source files -> one part's documents, rejects and attributes; one unit per planned part (``part-NNNNN``).

    Its marker records, beside the summary, the part (files), the ``measured`` and ``decided`` fingerprints and
    ``documents``: the fingerprint of the part's kept documents, which the later stages key on. A part re-decided
    under new thresholds keeps ``documents`` while its kept documents stay the same, so they stay skipped.
    """

    name = "ingest"
    progress_unit = "bytes"
    in_worker_process = True
    retries = 2

    def __init__(self, paths: RunPaths, parts: list[IngestPart], val_fraction: float,
                 near: NearDedupeConfig | None = None, manifests: dict[str, CorpusManifest] | None = None) -> None:
        """``manifests``: ``{manifest path: manifest}`` as the command loaded them (:func:`by_path`); a part's
        manifest not in it is read from its path."""
        super().__init__(paths)
        self.parts = {part_unit(part.part_id): part for part in parts}
        self.val_fraction, self.near = val_fraction, near
        self.loaded = dict(manifests or {})
        self.manifests: list[ManifestFile] = []
        self.part_size_bytes = 0
        self._recorded: dict[str | None, dict[str, Any] | None] = {}
        self._extras: dict[str | None, dict[str, Any]] = {}
        self._new_files: dict[str, tuple[str, ...]] = {}  # tokenmill status: the parts a re-run would plan
        self._notes: list[str] = []

    @classmethod
    def build(cls, run: Any) -> IngestStage:
        """The recipe's sources; the parts are planned by :meth:`plan` (the flow, first) or on asking :meth:`units`.

        A run read from its run.yaml (``tokenmill status RUN_DIR``) has no manifest files, only their recorded
        content: its units are the parts of the written plan, read with the recorded sources' settings."""
        manifests = list(run.manifests)  # loaded once by the command: no stage reads a manifest file again
        stage = cls(run.paths, [], run.recipe.data.val_fraction, run.recipe.dedupe.near, by_path(manifests))
        stage.manifests, stage.part_size_bytes = manifests, run.recipe.data.part_size_bytes
        if not manifests and run.record is not None:
            stage._plan_as_recorded(run.record.path, run.record.manifests or [])
        return stage

    def _plan_as_recorded(self, record_path: Path, recorded: list[CorpusManifest]) -> None:
        """The written plan's parts of the ``recorded`` manifests' sources (keyed by their place in run.yaml: the
        manifest files' folder is unknown, so no source file can be listed)."""
        self.loaded = {f"{record_path}#manifests[{index}]": manifest for index, manifest in enumerate(recorded)}
        keys = {source.name: key for key, manifest in self.loaded.items() for source in manifest.sources}
        plan = read_json(self.paths.ingest_plan) if self.paths.ingest_plan.is_file() else {"parts": []}
        self.parts = {part_unit(part["part_id"]): IngestPart(part["part_id"], part["source"], keys[part["source"]],
                                                             tuple(part["files"]))
                      for part in plan["parts"] if part["source"] in keys}
        self._notes = ["sources not listed: give the recipe to see new files"]

    def plan(self, write: bool = True) -> list[IngestPart]:
        """Plan the sources' new files into new parts (``docs/plan.json``; ``write=False``: only say what the plan
        would be, for ``tokenmill status``); every part of the plan, largest first."""
        parts = largest_first(planned_parts(self.manifests, self.paths, self.part_size_bytes, write=write),
                              self.loaded)
        self.parts = {part_unit(part.part_id): part for part in parts}
        return parts

    def units(self) -> list[str]:
        if not self.parts and self.manifests:
            self._plan_for_status()
        return list(self.parts)

    def _plan_for_status(self) -> None:
        """The plan a re-run would make, not written: a part it adds names its new files, and what planning warns
        of (a file changed after its part was ingested, which is not re-read) becomes a note."""
        written = read_json(self.paths.ingest_plan)["parts"] if self.paths.ingest_plan.is_file() else []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            parts = self.plan(write=False)
        planned = {part["part_id"] for part in written}
        self._new_files = {part_unit(part.part_id): part.files for part in parts if part.part_id not in planned}
        self._notes = [str(warning.message) for warning in caught]

    def pending_reasons(self, unit: str | None) -> list[str]:
        files = [escape_file_name(rel) for rel in self._new_files.get(str(unit), ())]
        if not files:
            return []
        more = f" and {len(files) - NEW_FILES_SHOWN} more" if len(files) > NEW_FILES_SHOWN else ""
        return [f"new files: {', '.join(files[:NEW_FILES_SHOWN])}{more}"]

    def status_notes(self) -> list[str]:
        return list(self._notes)

    def label(self, unit: str | None) -> str:
        return f"ingest {unit}"

    def inputs(self, unit: str | None) -> Inputs:
        part = self.parts[str(unit)]
        manifest, source = _part_source(part, Path(part.manifest_path), _loaded(part, self.loaded))
        # what run() re-decides from, as it is before the runner removes the marker
        self._recorded[unit] = read_marker(self.paths, self.name, unit)
        return Inputs(settings={"files": list(part.files), **_part_settings(manifest, source, self.val_fraction)},
                      version=str(ATTRIBUTES_VERSION))

    def outputs(self, unit: str | None) -> list[Path]:
        return [self.paths.document_part(self.parts[str(unit)].part_id)]

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        part = self.parts[str(unit)]
        manifest_path = Path(part.manifest_path)
        manifest, source = _part_source(part, manifest_path, _loaded(part, self.loaded))
        measured, decided = _part_fingerprints(part, manifest, source, self.val_fraction)
        record = {"part_id": part.part_id, "source": part.source, "files": list(part.files)}
        recorded = self._recorded.get(unit)
        if recorded is not None and _redecidable(part, measured, recorded, self.paths):
            summary, documents = redecide_part(part.part_id, manifest.filters, self.val_fraction, self.paths,
                                               (measured, decided), self.near, recorded, source.records)
        else:
            documents = fingerprint(measured, decided)
            with SignatureCollector(self.paths, part.part_id, documents, self.near) as signatures:
                summary = _write_part(part, source, manifest.filters, source_root(source, manifest_path),
                                      self.val_fraction, self.paths, _bytes_read(on_progress, part.num_bytes),
                                      signatures)
                signatures.write()
        self._extras[unit] = {"part": record, "measured": measured, "decided": decided, "documents": documents}
        return summary

    def marker_extras(self, unit: str | None, summary: dict[str, Any]) -> dict[str, Any]:
        return self._extras.pop(unit)


def _bytes_read(on_progress: Progress, total: int) -> Callable[[int, int], None]:
    """``on_progress(num_records, num_bytes)`` per file as the runner's ``(bytes so far, total, {"records"})``."""
    done = {"records": 0, "bytes": 0}

    def progress(num_records: int, num_bytes: int) -> None:
        done["records"] += num_records
        done["bytes"] += num_bytes
        on_progress(done["bytes"], total or None, {"records": done["records"]})

    return progress


def parts_to_ingest(parts: list[IngestPart], val_fraction: float, paths: RunPaths,
                    manifests: dict[str, CorpusManifest] | None = None) -> list[IngestPart]:
    """The parts that :func:`ingest_part` would (re)write: not yet done, or done with other files or settings.

    Lets a caller size its worker pool by the work left: a re-run that finds every part done starts none.
    ``manifests``: as in :func:`largest_first`.
    """
    stage = IngestStage(paths, parts, val_fraction, manifests=manifests)
    return [part for part in parts if stage_status(stage, part_unit(part.part_id)).state != "done"]


def _part_settings(manifest: CorpusManifest, source: SourceConfig, val_fraction: float) -> dict[str, Any]:
    """What a part's outputs depend on besides its files: how its source is read, what is measured, the
    thresholds its verdicts are decided with (:mod:`pipeline.filters.thresholds`), the val split."""
    return {"source": _reading_settings(source),
            "measurement": measurement_settings(manifest.filters),
            "thresholds": decision_settings(manifest.filters), "val_fraction": val_fraction}


def _part_fingerprints(part: IngestPart, manifest: CorpusManifest, source: SourceConfig,
                       val_fraction: float) -> tuple[str, str]:
    """``(measured, decided)``: what the part's attributes depend on (files, reading and measurement settings),
    and the thresholds its verdicts were decided with (:mod:`pipeline.filters.thresholds`)."""
    settings = _reading_settings(source)
    measured = fingerprint("ingest_part", ATTRIBUTES_VERSION, list(part.files), settings,
                           measurement_settings(manifest.filters), val_fraction)
    return measured, fingerprint("ingest_decision", decision_settings(manifest.filters))


def _reading_settings(source: SourceConfig) -> dict[str, Any]:
    """How the source's files are read; ``records`` only when not the default (``text``), so the parts of a text
    source keep the fingerprints of before the key existed."""
    settings = source.model_dump(include={"name", "format", "text_field", "id_field", "on_error"})
    return settings if source.records == "text" else {**settings, "records": source.records}


ATTRIBUTES_VERSION = 1
"""In the measurement fingerprint: a part ingested before attributes were stored is ingested again (once)."""


def _redecidable(part: IngestPart, measured: str, recorded: dict[str, Any], paths: RunPaths) -> bool:
    """Whether the part was measured with these settings (its ``recorded`` marker says) and its attributes are
    there: only thresholds changed."""
    files = (paths.document_part(part.part_id), paths.rejects_part(part.part_id), paths.attributes_part(part.part_id))
    return recorded.get("measured") == measured and all(file.is_file() for file in files)


def by_path(manifests: list[ManifestFile]) -> dict[str, CorpusManifest]:
    """``{manifest path: manifest}``: what :func:`largest_first` and :func:`parts_to_ingest` look a part's up in."""
    return {str(item.path): item.manifest for item in manifests}


def _loaded(part: IngestPart, manifests: dict[str, CorpusManifest] | None) -> CorpusManifest | None:
    return None if manifests is None else manifests.get(part.manifest_path)


def _part_source(part: IngestPart, manifest_path: Path,
                 manifest: CorpusManifest | None) -> tuple[CorpusManifest, SourceConfig]:
    manifest = load_manifest(manifest_path) if manifest is None else manifest
    for source in manifest.sources:
        if source.name == part.source:
            return manifest, source
    raise ManifestError(f"{manifest_path}: no source '{part.source}' (part {part.part_id} was planned from it); "
                        "restore the source or start a new run dir.")


def _write_part(part: IngestPart, source: SourceConfig, filters: FilterConfig, root: Path | ObjectPath,
                val_fraction: float, paths: RunPaths, on_progress: Callable[[int, int], None],
                signatures: SignatureCollector) -> dict[str, Any]:
    reasons: Counter[str] = Counter()
    redactions: Counter[str] = Counter()
    num_documents = 0
    with (paths.atomic_write(paths.document_part(part.part_id)) as docs_tmp,
          paths.atomic_write(paths.rejects_part(part.part_id)) as rejects_tmp,
          paths.atomic_write(paths.attributes_part(part.part_id)) as attributes_tmp):
        docs = ParquetSink(docs_tmp, documents_schema(source.records != "text"), on_flush=signatures.add,
                           group_column="split")
        rejects = ParquetSink(rejects_tmp, REJECTS_SCHEMA)
        attributes = ParquetSink(attributes_tmp, ATTRIBUTES_SCHEMA)
        sizes = {rel: _file_size(root / rel, root) for rel in part.files}
        for rel in part.files:
            items = read_file(root / rel, rel, source, filters.max_chars)
            for item in _reporting(items, on_progress, sizes[rel]):
                if isinstance(item, Record):
                    row, values = _document_row(item, source.name, filters, val_fraction, redactions)
                    attributes.append(attribute_row(row, values), 0)
                else:
                    row = reject_row(item, source.name)
                if "reason" in row:
                    rejects.append(row, len(row["raw"] or b""))
                    reasons[row["reason"]] += 1
                else:
                    docs.append(row, row["num_chars"])
                    num_documents += 1
        docs.close()
        rejects.close()
        attributes.close()
    num_rejects = sum(reasons.values())
    return {"part_id": part.part_id, "source": part.source, "num_records": num_documents + num_rejects,
            "num_documents": num_documents, "num_rejects": num_rejects,
            "rejects_by_reason": dict(sorted(reasons.items())),
            "redactions_by_kind": dict(sorted(redactions.items())),
            "num_bytes": sum(sizes.values())}


def _file_size(path: Path | ObjectPath, root: Path | ObjectPath) -> int:
    """The file's size for progress; 0 for what is not read (a link leading outside ``root``, a missing file)."""
    if isinstance(path, ObjectPath):
        return path.size_if_present()  # gone since planned: its part records a missing_file reject
    if not path.exists() or (path.is_symlink() and not _is_inside(path, root.resolve())):
        return 0
    return _stat_file(path, path.name).size


def _reporting(items: Iterator[Record | Reject], on_progress: Callable[[int, int], None],
               num_bytes: int) -> Iterator[Record | Reject]:
    """Pass the items through, telling ``on_progress`` every PROGRESS_EVERY_RECORDS records and at the end."""
    num_unreported = 0
    for item in items:
        yield item
        num_unreported += 1
        if num_unreported == PROGRESS_EVERY_RECORDS:
            on_progress(num_unreported, 0)
            num_unreported = 0
    on_progress(num_unreported, num_bytes)


def _ignore(*_: int) -> None:
    """The progress callback when nobody listens."""


def _document_row(record: Record, source: str, filters: FilterConfig, val_fraction: float,
                  redactions: Counter[str]) -> tuple[dict[str, Any], Attributes]:
    """Normalise, redact (when configured: before hashing, so copies differing only in PII collapse), filter:
    ``(the documents row, or the rejects row with its text; the values the filters measured)``."""
    text = normalise_text(record.text)
    if filters.redact_pii:
        text, found = redact_pii(text)
        redactions.update(found)
    text, failed, values = measure_text(text, filters)
    if failed is not None:  # raw: what a relaxed threshold re-reads (a chat record's conversation, when no line)
        raw = record.raw if record.raw is not None else (record.record or record.text).encode("utf-8")
        row = reject_row(Reject(record.uri, failed[0], failed[1], raw, record.source_id), source)
        return {**row, "text": text}, values
    return document_row(source, record.uri, record.source_id, text, val_fraction, record.record), values
