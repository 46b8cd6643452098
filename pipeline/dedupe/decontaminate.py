"""Decontaminate stage (after dedupe): kept train documents -> ``rejects/contaminated.parquet``.

A train document is contaminated when it shares a word n-gram (``ngram`` ASCII-lower-cased, whitespace-separated
words; 13 by default) with a kept validation document or a user-given evaluation file. Each one becomes a
``contaminated`` reject (REJECTS_SCHEMA, raw = its text) whose detail names the matching val ``doc_id`` or
eval ``file:line`` and the n-gram; :func:`core.documents.removed_doc_ids` then leaves it out of the
documents. Documents of parts checked by an earlier run with the same settings keep their decision (their
tokens may already be in shards), so a refresh checks only new train documents against the val split. The
other direction of a refresh, a new val document quoting a train document of an earlier part (already
packed, so trained on), rejects the val document instead: the model has seen its text.

Memory: the reference n-grams (16 bytes each: hash + owner) of the val split and eval files, plus one
batch of train documents.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from core.documents import doc_id_for
from core.errors import ConfigError
from core.files.atomic import read_json
from core.layout import DUPLICATES_FILE, part_unit
from core.rundir import RunPaths, fingerprint
from core.schemas import REJECTS_SCHEMA
from core.stage import Inputs, Progress, Stage, read_marker, run_stage
from pipeline.config import DecontaminateConfig
from pipeline.dedupe import minhash
from pipeline.dedupe.stage import DocsPart, finished_parts
from pipeline.filters.normalisation import normalise_text
from pipeline.ingest.readers import Record, read_file
from pipeline.manifest import SourceConfig

BATCH_ROWS = 512
MAX_DETAIL_NGRAM_CHARS = 200
TASK_DETAIL = re.compile(r" with eval task (\S+) item ")
"""A reject's detail naming the evaluation task whose item it shares an n-gram with."""
_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.zstd")


@dataclass
class ReferenceNgrams:
    """Sorted unique n-gram hashes of the reference texts, each with the label of its first owner."""

    hashes: np.ndarray
    owners: np.ndarray
    labels: list[str]

    def match_slots(self, ngram_hashes: np.ndarray) -> np.ndarray:
        """Per n-gram hash: its index in ``hashes`` when it is a reference n-gram, else -1."""
        if not len(self.hashes):
            return np.full(len(ngram_hashes), -1, dtype=np.int64)
        slots = np.minimum(np.searchsorted(self.hashes, ngram_hashes), len(self.hashes) - 1)
        return np.where(self.hashes[slots] == ngram_hashes, slots, -1)


@dataclass
class TrainMatches:
    """Kept train documents sharing reference n-grams: where in the document (n-gram positions) and which."""

    doc_ids: list[int] = field(default_factory=list)
    part_ids: list[int] = field(default_factory=list)
    positions: list[np.ndarray] = field(default_factory=list)
    slots: list[np.ndarray] = field(default_factory=list)
    num_checked: int = 0


def decontaminate_documents(paths: RunPaths, config: DecontaminateConfig, *,
                            base_dir: Path | None = None, eval_tasks: dict[str, Path] | None = None) -> dict[str, Any]:
    """Write ``rejects/contaminated.parquet`` for the kept train documents that share an n-gram with val/eval
    (and, on a refresh, the new val documents quoting a train document packed earlier).

    ``base_dir`` is the folder relative eval file paths are taken from (the recipe's folder; default the
    working directory). ``eval_tasks``: ``{task name: its texts (eval/texts/<task>.jsonl)}`` of the recipe's
    evaluation tasks; they are always checked against (the stage runs for them even when not ``enabled``), and a
    document they contaminate is counted per task in ``contaminated_by_task``. Returns ``{"enabled",
    "eval_tasks", "num_train_checked", "num_contaminated", "num_reference_ngrams", "num_boilerplate_ngrams",
    "contaminated_by_reference", "contaminated_by_task"}``: ``enabled`` is the recipe's own setting (the optional
    check against the val split and eval files), ``eval_tasks`` the documents the always-on check against the
    evaluation tasks removed (``contaminated_by_reference``: ``val`` / ``eval`` / ``eval_task`` /
    ``earlier_train``; ``contaminated_by_task``: ``{task: documents}``). A repeat
    call with nothing new returns the recorded summary (:class:`DecontaminateStage`). Raises ConfigError when an
    eval file does not exist, SourceReadError when it cannot be read.
    """
    return run_stage(DecontaminateStage(paths, config, base_dir, eval_tasks)).as_summary()


DISABLED_SUMMARY = {"enabled": False, "eval_tasks": 0, "num_train_checked": 0, "num_contaminated": 0,
                    "num_reference_ngrams": 0, "num_boilerplate_ngrams": 0, "contaminated_by_reference": {},
                    "contaminated_by_task": {}}
"""What a stage with nothing to check against (off, and no evaluation task) returns."""


class DecontaminateStage(Stage):
    """Kept train documents -> ``rejects/contaminated.parquet``. ``dedupe/decontaminate.json`` is its state (the
    parts checked with these settings: their decisions stand on a refresh)."""

    name = "decontaminate"
    reads = ("ingest", "dedupe", "eval-tasks")

    def __init__(self, paths: RunPaths, config: DecontaminateConfig, base_dir: Path | None = None,
                 eval_tasks: dict[str, Path] | None = None) -> None:
        """``eval_tasks`` None: the tasks the eval-tasks stage checked (its marker), as the flow runs it."""
        super().__init__(paths)
        self.config, self.base_dir, self.given_tasks = config, base_dir, eval_tasks

    @classmethod
    def build(cls, run: Any) -> DecontaminateStage:
        return cls(run.paths, run.recipe.dedupe.decontaminate, run.base)

    def tasks(self) -> dict[str, Path]:
        if self.given_tasks is not None:
            return dict(sorted(self.given_tasks.items()))
        recorded = read_marker(self.paths, "eval-tasks")
        names = recorded["summary"].get("tasks", {}) if recorded is not None else {}
        return {name: self.paths.eval_text(name) for name in sorted(names)}

    def checked(self) -> DecontaminateConfig | None:
        """The settings the check runs with (only the evaluation tasks when off), or None: nothing to check."""
        if not self.config.enabled:
            return self.config.model_copy(update={"against_val": False, "eval_files": []}) if self.tasks() else None
        return self.config

    def inputs(self, unit: str | None) -> Inputs:
        config, tasks = self.checked(), self.tasks()
        if config is None:
            return Inputs(settings={"enabled": False})
        files = {f"eval_file:{path}": _file_digest(path) for path in _eval_paths(config, self.base_dir)}
        files.update({f"eval_task:{name}": _file_digest(path) for name, path in tasks.items()})
        upstream = {f"ingest/{part_unit(part.part_id)}": part.fingerprint for part in finished_parts(self.paths)}
        upstream["dedupe"] = (read_marker(self.paths, "dedupe") or {}).get("fingerprint", "")
        files[DUPLICATES_FILE] = _file_digest(self.paths.duplicates)  # what is read, by content
        return Inputs(settings={**config.model_dump(exclude={"enabled"}), "enabled": self.config.enabled},
                      files={name: str(digest) for name, digest in files.items()}, upstream=upstream)

    def outputs(self, unit: str | None) -> list[Path]:
        return [] if self.checked() is None else [self.paths.contaminated]

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        config = self.checked()
        if config is None:
            (self.paths.contaminated).unlink(missing_ok=True)
            return dict(DISABLED_SUMMARY)
        summary = _decontaminate(self.paths, config, _eval_paths(config, self.base_dir), self.tasks())
        return as_recipe_says(summary, self.config.enabled)


def _decontaminate(paths: RunPaths, config: DecontaminateConfig, eval_files: list[Path],
                   tasks: dict[str, Path]) -> dict[str, Any]:
    """The check itself; the parts checked with these settings before keep their decisions (stage state)."""
    output = paths.contaminated
    parts = finished_parts(paths)
    settings = fingerprint("decontaminate", config.model_dump(exclude={"enabled"}),
                           [(path.name, _file_digest(path)) for path in eval_files],
                           [(name, _file_digest(path)) for name, path in tasks.items()])
    state_path = paths.decontaminate_state
    state = read_json(state_path) if state_path.is_file() else {}
    checked = state.get("parts", {}) if state.get("settings") == settings and output.is_file() else {}
    locked = {part.part_id for part in parts if checked.get(str(part.part_id)) == part.fingerprint}
    removed = _duplicate_doc_ids(paths)
    reference = build_reference(parts, removed, config, eval_files, tasks)
    new_parts = [part for part in parts if part.part_id not in locked]
    matches = find_matches(new_parts, removed, reference, config.ngram)
    chosen, num_boilerplate = choose_contaminated(matches, reference, config.max_ngram_train_docs)
    carried = _carried_rows(output, parts, locked)
    if config.against_val and locked:
        not_trained = pa.concat_arrays([removed, pa.array([doc_id_for(row["source"], row["uri"]) for row in carried],
                                                          pa.int64())])
        earlier_train = [part for part in parts if part.part_id in locked]
        chosen |= val_quoting_earlier_train(new_parts, earlier_train, removed, not_trained, config)
    rows = carried + _reject_rows(parts, chosen, config.ngram)
    summary = _write_rejects(paths, output, rows, matches.num_checked, len(reference.hashes), num_boilerplate)
    paths.write_json(state_path, {"settings": settings,
                                  "parts": {str(part.part_id): part.fingerprint for part in parts}})
    return summary


def as_recipe_says(summary: dict[str, Any], enabled: bool) -> dict[str, Any]:
    """The summary in the recipe's terms: ``enabled`` as ``dedupe.decontaminate.enabled`` says (an enabled stage
    with nothing but tasks to check has the fingerprint of a disabled one), ``eval_tasks`` on its own."""
    by_reference = summary.get("contaminated_by_reference") or {}
    said = {**summary, "enabled": enabled, "eval_tasks": by_reference.get("eval_task", 0)}
    return dict(sorted(said.items()))  # a marker's order (sorted keys): a skipped stage returns what it recorded


def build_reference(parts: list[DocsPart], removed: pa.Array, config: DecontaminateConfig,
                    eval_files: list[Path], eval_tasks: dict[str, Path] | None = None) -> ReferenceNgrams:
    """The n-grams of the evaluation tasks' items, the kept val documents (when ``against_val``) and every eval
    file's records. An n-gram is labelled by its first owner, so a task's items come first: the built-in task is
    made of val documents, and a document it contaminates is counted for the task."""
    hashes: list[np.ndarray] = []
    owners: list[np.ndarray] = []
    labels: list[str] = []
    for name, path in (eval_tasks or {}).items():
        for texts, uris in _eval_batches(path, "text"):
            _add_reference(pa.array(texts, pa.large_string()), [f"eval task {name} item {uri}" for uri in uris],
                           config.ngram, hashes, owners, labels)
    columns = ["doc_id", "text", "split"]
    batches = _kept_batches([part.path for part in parts], removed, "val", columns) if config.against_val else ()
    for batch in batches:
        _add_reference(batch.column("text"), [f"val doc_id {i}" for i in batch.column("doc_id").to_pylist()],
                       config.ngram, hashes, owners, labels)
    for path in eval_files:
        for texts, uris in _eval_batches(path, config.eval_text_field):
            _add_reference(pa.array(texts, pa.large_string()), [f"eval file {uri}" for uri in uris], config.ngram,
                           hashes, owners, labels)
    if not hashes:
        return ReferenceNgrams(np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.int64), labels)
    unique, first = np.unique(np.concatenate(hashes), return_index=True)
    return ReferenceNgrams(unique, np.concatenate(owners)[first], labels)


def val_quoting_earlier_train(new_parts: list[DocsPart], earlier_parts: list[DocsPart], removed: pa.Array,
                              not_trained: pa.Array, config: DecontaminateConfig) -> dict[int, tuple[int, int, str]]:
    """New val documents sharing an n-gram with a train document of an earlier run's parts.

    Those train documents are packed (trained on) already, so the val document goes: ``{val doc_id: (part_id,
    n-gram position in it, "train doc_id N, packed earlier")}``. ``not_trained``: train documents that never
    reached the shards (dedupe-removed or contaminated). Every new val document holding a shared n-gram is
    found, not only the first; the ``max_ngram_train_docs`` boilerplate rule applies as for train documents.
    """
    hashes, owners, positions, owner_docs = [], [], [], []
    for part in new_parts:
        for batch in _kept_batches([part.path], removed, "val", ["doc_id", "text", "split"]):
            ngrams, offsets = document_ngrams(batch.column("text"), config.ngram)
            counts = np.diff(offsets)
            hashes.append(ngrams)
            owners.append(np.repeat(np.arange(len(owner_docs), len(owner_docs) + batch.num_rows), counts))
            positions.append(np.arange(len(ngrams)) - np.repeat(offsets[:-1], counts))
            owner_docs.extend((doc_id, part.part_id) for doc_id in batch.column("doc_id").to_pylist())
    if not hashes or not sum(len(piece) for piece in hashes):
        return {}
    all_hashes = np.concatenate(hashes)
    order = np.argsort(all_hashes, kind="stable")
    sorted_hashes = all_hashes[order]
    starts = np.flatnonzero(np.r_[True, sorted_hashes[1:] != sorted_hashes[:-1]])
    bounds = np.r_[starts, len(sorted_hashes)]
    reference = ReferenceNgrams(sorted_hashes[starts], np.zeros(len(starts), dtype=np.int64), [])
    matches = find_matches(earlier_parts, not_trained, reference, config.ngram)
    boilerplate = boilerplate_slots(matches, len(starts), config.max_ngram_train_docs)
    all_owners, all_positions = np.concatenate(owners)[order], np.concatenate(positions)[order]
    chosen: dict[int, tuple[int, int, str]] = {}
    for train_doc_id, slots in zip(matches.doc_ids, matches.slots, strict=True):
        for slot in minhash.sorted_unique(slots[~boilerplate[slots]]).tolist():
            for owner, position in zip(all_owners[bounds[slot]:bounds[slot + 1]].tolist(),
                                       all_positions[bounds[slot]:bounds[slot + 1]].tolist(), strict=True):
                val_doc_id, part_id = owner_docs[owner]
                chosen.setdefault(val_doc_id, (part_id, position, f"train doc_id {train_doc_id}, packed earlier"))
    return chosen


def document_ngrams(texts: pa.Array | pa.ChunkedArray, ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of every ``ngram``-word run per document, with per-document offsets.

    Documents shorter than ``ngram`` words have none (they cannot share a long n-gram with anything).
    """
    words, word_offsets = minhash.whitespace_word_hashes(texts)
    ngrams, offsets = minhash.shingle_hashes(words, word_offsets, ngram)
    short = np.diff(word_offsets) < ngram
    if not short.any():
        return ngrams, offsets
    keep = ~np.repeat(short, np.diff(offsets))
    counts = np.where(short, 0, np.diff(offsets))
    new_offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=new_offsets[1:])
    return ngrams[keep], new_offsets


def _add_reference(texts: pa.Array, labels_of_texts: list[str], ngram: int, hashes: list[np.ndarray],
                   owners: list[np.ndarray], labels: list[str]) -> None:
    ngrams, offsets = document_ngrams(texts, ngram)
    hashes.append(ngrams)
    owners.append(np.repeat(np.arange(len(labels), len(labels) + len(labels_of_texts)), np.diff(offsets)))
    labels.extend(labels_of_texts)


def find_matches(parts: list[DocsPart], removed: pa.Array, reference: ReferenceNgrams, ngram: int) -> TrainMatches:
    """Every kept train document of ``parts`` that shares at least one n-gram with the reference."""
    matches = TrainMatches()
    for part in parts:
        for batch in _kept_batches([part.path], removed, "train", ["doc_id", "text", "split"]):
            matches.num_checked += batch.num_rows
            ngrams, offsets = document_ngrams(batch.column("text"), ngram)
            slots = reference.match_slots(ngrams)
            doc_of_ngram = np.repeat(np.arange(batch.num_rows), np.diff(offsets))
            doc_ids = batch.column("doc_id").to_pylist()
            for row in minhash.sorted_unique(doc_of_ngram[slots >= 0]).tolist():
                found = np.flatnonzero(slots[offsets[row] : offsets[row + 1]] >= 0)
                matches.doc_ids.append(doc_ids[row])
                matches.part_ids.append(part.part_id)
                matches.positions.append(found)
                matches.slots.append(slots[offsets[row] + found])
    return matches


def choose_contaminated(matches: TrainMatches, reference: ReferenceNgrams, max_train_docs: int | None
                        ) -> tuple[dict[int, tuple[int, int, str]], int]:
    """``({doc_id: (part_id, n-gram position, owner label)}, number of boilerplate reference n-grams)``.

    With ``max_train_docs`` set, a reference n-gram found in more train documents than that is boilerplate
    (a licence header, a code template) and does not make a document contaminated on its own.
    """
    boilerplate = boilerplate_slots(matches, len(reference.hashes), max_train_docs)
    chosen = {}
    for doc_id, part_id, positions, slots in zip(matches.doc_ids, matches.part_ids, matches.positions,
                                                 matches.slots, strict=True):
        evidence = np.flatnonzero(~boilerplate[slots])
        if len(evidence):
            first = evidence[0]
            chosen[doc_id] = (part_id, int(positions[first]), reference.labels[int(reference.owners[slots[first]])])
    return chosen, int(np.count_nonzero(boilerplate))


def boilerplate_slots(matches: TrainMatches, num_slots: int, max_train_docs: int | None) -> np.ndarray:
    """Per reference n-gram: found in more than ``max_train_docs`` of the matched train documents (never when None)."""
    if max_train_docs is None or not matches.slots:
        return np.zeros(num_slots, dtype=bool)
    docs_per_slot = np.bincount(np.concatenate([minhash.sorted_unique(slots) for slots in matches.slots]),
                                minlength=num_slots)
    return docs_per_slot > max_train_docs


def _reject_rows(parts: list[DocsPart], chosen: dict[int, tuple[int, int, str]], ngram: int) -> list[dict[str, Any]]:
    """Reject rows of the chosen documents, read back part by part (only their rows are kept)."""
    rows = []
    for part in parts:
        wanted = pa.array([doc_id for doc_id, found in chosen.items() if found[0] == part.part_id], pa.int64())
        if not len(wanted):
            continue
        table = pq.read_table(part.path, columns=["doc_id", "source", "source_id", "uri", "text"])
        for document in table.filter(pc.is_in(table.column("doc_id"), value_set=wanted)).to_pylist():
            _, position, owner = chosen[document["doc_id"]]
            rows.append(_reject_row(document, position, owner, ngram))
    return rows


def _reject_row(document: dict[str, Any], position: int, owner: str, ngram: int) -> dict[str, Any]:
    words = document["text"].encode("utf-8").split()  # the words of minhash.whitespace_word_hashes, in their own case
    shared = b" ".join(words[position : position + ngram]).decode("utf-8", "replace")
    if len(shared) > MAX_DETAIL_NGRAM_CHARS:
        shared = shared[:MAX_DETAIL_NGRAM_CHARS] + "…"
    detail = f"shares the {ngram}-word n-gram {shared!r} with {owner}"
    return {"source": document["source"], "source_id": document["source_id"], "uri": document["uri"],
            "reason": "contaminated", "detail": detail, "raw": document["text"].encode("utf-8")}


def _kept_batches(part_files: list[Path], removed: pa.Array, split: str,
                  columns: list[str]) -> Iterator[pa.RecordBatch]:
    """Documents of ``split`` not removed by dedupe, batch by batch (contamination decisions ignored)."""
    for path in part_files:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS, columns=columns):
            mask = pc.and_(pc.equal(batch.column("split"), split),
                           pc.invert(pc.is_in(batch.column("doc_id"), value_set=removed)))
            kept = batch.filter(mask)
            if kept.num_rows:
                yield kept


def _carried_rows(output: Path, parts: list[DocsPart], locked: set[int]) -> list[dict[str, Any]]:
    """Reject rows an earlier run wrote for documents of the ``locked`` parts (decisions that stand)."""
    if not locked or not output.is_file():
        return []
    previous = pq.read_table(output).to_pylist()
    previous_ids = pa.array([doc_id_for(row["source"], row["uri"]) for row in previous], pa.int64())
    carried = np.zeros(len(previous), dtype=bool)
    for part in parts:
        if part.part_id in locked:
            part_ids = pq.read_table(part.path, columns=["doc_id"]).column("doc_id").combine_chunks()
            carried |= pc.is_in(previous_ids, value_set=part_ids).to_numpy(zero_copy_only=False)
    return [row for row, keep in zip(previous, carried, strict=True) if keep]


def _write_rejects(paths: RunPaths, output: Path, rows: list[dict[str, Any]], num_checked: int, num_ngrams: int,
                   num_boilerplate: int) -> dict[str, Any]:
    rows.sort(key=lambda row: (row["source"], row["uri"]))
    with paths.atomic_write(output) as tmp:
        pq.write_table(pa.Table.from_pylist(rows, schema=REJECTS_SCHEMA), tmp, compression="zstd")
    by_reference = {"val": sum(" val doc_id " in row["detail"] for row in rows),
                    "eval": sum(" eval file " in row["detail"] for row in rows),
                    "eval_task": sum(" eval task " in row["detail"] for row in rows),
                    "earlier_train": sum(" train doc_id " in row["detail"] for row in rows)}
    by_task: dict[str, int] = {}
    for row in rows:
        if (found := TASK_DETAIL.search(row["detail"])) is not None:
            by_task[found.group(1)] = by_task.get(found.group(1), 0) + 1
    return {"num_train_checked": num_checked, "num_contaminated": len(rows),
            "num_reference_ngrams": num_ngrams, "num_boilerplate_ngrams": num_boilerplate,
            "contaminated_by_reference": by_reference, "contaminated_by_task": by_task}


def _duplicate_doc_ids(paths: RunPaths) -> pa.Array:
    path = paths.duplicates
    if not path.is_file():
        return pa.array([], type=pa.int64())
    return pq.read_table(path, columns=["doc_id"]).column("doc_id").combine_chunks()


def _eval_paths(config: DecontaminateConfig, base_dir: Path | None) -> list[Path]:
    base = Path.cwd() if base_dir is None else Path(base_dir)
    paths = []
    for name in config.eval_files:
        path = (base / name).resolve()
        if not path.is_file():
            raise ConfigError(f"dedupe.decontaminate.eval_files: {name} does not exist (resolved to {path}); "
                              "fix the path (relative to the recipe's folder).")
        paths.append(path)
    return paths


def _eval_batches(path: Path, text_field: str) -> Iterator[tuple[list[str], list[str]]]:
    """``(texts, uris)`` batches of an eval file; records that are not text (bad lines) are skipped."""
    fmt = "jsonl" if path.name.lower().endswith(_JSONL_SUFFIXES) else "text"
    source = SourceConfig(name="eval", path=str(path), format=fmt, text_field=text_field)
    texts: list[str] = []
    uris: list[str] = []
    for item in read_file(path, path.name, source):
        if isinstance(item, Record):
            texts.append(normalise_text(item.text))
            uris.append(item.uri)
        if len(texts) >= BATCH_ROWS:
            yield texts, uris
            texts, uris = [], []
    if texts:
        yield texts, uris


def _file_digest(path: Path) -> str | None:
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
