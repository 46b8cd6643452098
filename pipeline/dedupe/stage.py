"""Dedupe stage: ``docs/part-*.parquet`` -> ``dedupe/duplicates.parquet`` (exact, then near via MinHash + LSH).

Incremental by design: signatures and LSH band keys are cached per part (``dedupe/minhash/``,
``dedupe/bands/``), and a document kept by an earlier dedupe run is never removed later, because its
tokens may already be in shards. Such "locked" documents win every exact group and near cluster they
are in; otherwise the survivor is the earliest document by (part_id, row). Rows are in the order ingest wrote
them: each split in row groups of its own (one written as it fills, the rest at the end, train's before
val's), so within one part a train member usually comes first.

Memory holds the per-document catalog (~0.15 KB/doc: ids, uri, content hash) and the near-duplicate
candidates, never all signatures (0.5 KB/doc at 128 permutations): band keys are made one signature row
group at a time, and candidates' signatures read from the row groups that hold them
(:mod:`pipeline.dedupe.near_dedupe`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from core.documents import document_part_files, document_part_fingerprint
from core.files.atomic import read_json
from core.layout import CLUSTERS_FILE as CLUSTERS_FILE  # re-exported (tests)
from core.layout import part_unit
from core.rundir import RunPaths
from core.schemas import DOCUMENTS_SCHEMA, DUPLICATES_SCHEMA
from core.stage import Inputs, Progress, Stage, run_stage
from pipeline.config import DedupeConfig
from pipeline.dedupe import minhash
from pipeline.dedupe.near_dedupe import BANDS_DIR, MINHASH_DIR, DocsPart, NearIndex, PairScorer

VERSION = 2
"""Dedupe decision rules; part of the state fingerprint. 2: exact Jaccard decides pairs near the threshold."""
__all__ = ["BANDS_DIR", "MINHASH_DIR", "DocsPart", "dedupe_documents"]
CATALOG_COLUMNS = ["doc_id", "source", "source_id", "uri", "content_hash"]

CLUSTERS_SCHEMA = pa.schema(
    [
        pa.field("cluster_id", pa.int64(), nullable=False),  # the survivor's doc_id
        pa.field("doc_id", pa.int64(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("uri", pa.string(), nullable=False),
        pa.field("kept", pa.bool_(), nullable=False),
        pa.field("similarity", pa.float64(), nullable=False),  # Jaccard to the survivor (see PairScorer)
    ],
    metadata={"artifact": "near_duplicate_clusters"},
)
"""``dedupe/clusters.parquet``: one row per member of every near-duplicate cluster (for inspection)."""


@dataclass
class Decisions:
    """Per document (catalog order): the document it duplicates (itself when kept), kind and similarity."""

    survivor: np.ndarray
    kind: np.ndarray
    similarity: np.ndarray
    cluster_members: np.ndarray  # documents in near clusters of two or more (index into the catalog)
    cluster_survivors: np.ndarray  # each member's cluster survivor
    cluster_similarity: np.ndarray  # each member's Jaccard to it (see PairScorer)


def dedupe_documents(paths: RunPaths, config: DedupeConfig) -> dict[str, int]:
    """Exact then near dedupe over every finished docs part; writes ``dedupe/`` and returns counts.

    Returns ``{"num_documents_in", "num_exact_duplicates", "num_near_duplicates", "num_kept"}``. Outputs
    are deterministic (same parts and settings -> same bytes); a repeat call with nothing new returns
    the summary recorded in ``stages/dedupe.json`` without work (:class:`DedupeStage` through
    :func:`core.stage.run_stage`).
    """
    return run_stage(DedupeStage(paths, config)).summary


class DedupeStage(Stage):
    """``docs/`` -> ``dedupe/duplicates.parquet``. ``dedupe/state.json`` keeps the parts seen (stage state:
    their documents stay locked, so a refresh never removes a document whose tokens may be in shards)."""

    name = "dedupe"
    reads = ("ingest",)
    progress_unit = None

    def __init__(self, paths: RunPaths, config: DedupeConfig) -> None:
        super().__init__(paths)
        self.config = config

    @classmethod
    def build(cls, run: Any) -> DedupeStage:
        return cls(run.paths, run.recipe.dedupe)

    def inputs(self, unit: str | None) -> Inputs:
        return dedupe_inputs(finished_parts(self.paths), self.config)

    def outputs(self, unit: str | None) -> list[Path]:
        return [self.paths.duplicates]

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        parts = finished_parts(self.paths)
        state_path = self.paths.dedupe_state
        state = read_json(state_path) if state_path.is_file() else {"parts": {}}
        catalog, part_ids = load_catalog(parts)
        locked = locked_documents(catalog, part_ids, parts, state, self.paths)
        decisions = decide(catalog, part_ids, locked, parts, self.paths, self.config)
        summary = write_outputs(catalog, decisions, self.paths)
        self.paths.write_json(state_path, {"parts": {str(part.part_id): part.fingerprint for part in parts}})
        return summary


def dedupe_inputs(parts: list[DocsPart], config: DedupeConfig) -> Inputs:
    """The dedupe stage's inputs: its settings (not decontaminate's), its rules, the MinHash implementation and
    words (a run deduped on other words is deduped again), and the fingerprint of every finished part."""
    return Inputs(settings=config.model_dump(exclude={"decontaminate"}),  # a later stage's settings; not dedupe's
                  upstream={f"ingest/{part_unit(part.part_id)}": part.fingerprint for part in parts},
                  version=f"{VERSION}/{minhash.IMPLEMENTATION}/{minhash.WORDS_VERSION}")


def dedupe_fingerprint(parts: list[DocsPart], config: DedupeConfig) -> str:
    """The dedupe stage's one fingerprint (:func:`dedupe_inputs`)."""
    return dedupe_inputs(parts, config).fingerprint()


def finished_parts(paths: RunPaths) -> list[DocsPart]:
    """Finished docs parts in part order, with the fingerprints of their kept documents."""
    return [
        DocsPart(int(path.stem.split("-")[1]), path, document_part_fingerprint(paths, path))
        for path in document_part_files(paths)
    ]


def load_catalog(parts: list[DocsPart]) -> tuple[pa.Table, np.ndarray]:
    """Every document's metadata (no text) in (part_id, row) order, and each row's part_id."""
    tables = [pq.read_table(part.path, columns=CATALOG_COLUMNS) for part in parts]
    part_ids = np.concatenate([np.full(t.num_rows, p.part_id) for t, p in zip(tables, parts, strict=True)]
                              or [np.empty(0, dtype=np.int64)])
    if not tables:
        return DOCUMENTS_SCHEMA.empty_table().select(CATALOG_COLUMNS), part_ids
    return pa.concat_tables(tables), part_ids


def locked_documents(catalog: pa.Table, part_ids: np.ndarray, parts: list[DocsPart], state: dict[str, Any],
                     paths: RunPaths) -> np.ndarray:
    """Mask of documents an earlier dedupe run kept: in a part it saw (same fingerprint), not removed."""
    seen = [part.part_id for part in parts if state["parts"].get(str(part.part_id)) == part.fingerprint]
    if not seen or not paths.duplicates.is_file():  # no usable history: decide afresh
        return np.zeros(catalog.num_rows, dtype=bool)
    removed = pq.read_table(paths.duplicates, columns=["doc_id"]).column("doc_id")
    was_removed = pc.is_in(catalog.column("doc_id"), value_set=removed.combine_chunks()).to_numpy(
        zero_copy_only=False)
    return np.isin(part_ids, seen) & ~was_removed


def preferred_survivor(groups: np.ndarray, locked: np.ndarray) -> np.ndarray:
    """Per element: the index of its group's survivor (first locked member, else first member)."""
    num = len(groups)
    index = np.arange(num)
    rank = np.where(locked, index, index + num)
    best = np.full(int(groups.max(initial=-1)) + 1, 2 * num, dtype=np.int64)
    np.minimum.at(best, groups, rank)
    return best[groups] % max(num, 1)


def decide(catalog: pa.Table, part_ids: np.ndarray, locked: np.ndarray, parts: list[DocsPart], paths: RunPaths,
           config: DedupeConfig) -> Decisions:
    """Exact groups by content hash, then near clusters among the exact survivors."""
    num_docs = catalog.num_rows
    index = np.arange(num_docs)
    survivor = index.copy()
    if config.exact and num_docs:
        codes = pc.dictionary_encode(catalog.column("content_hash").combine_chunks()).indices.to_numpy()
        survivor = np.where(locked, index, preferred_survivor(codes, locked))
    kind = np.where(survivor != index, "exact", "")
    similarity = np.where(survivor != index, 1.0, 0.0)
    empty = np.empty(0, dtype=np.int64)
    decisions = Decisions(survivor, kind, similarity, empty, empty, np.empty(0))
    if config.near.enabled and num_docs:
        doc_offsets = np.searchsorted(part_ids, [part.part_id for part in parts]).tolist()
        apply_near(decisions, NearIndex(parts, doc_offsets, paths, config), locked, config)
    return decisions


def apply_near(decisions: Decisions, index: NearIndex, locked: np.ndarray, config: DedupeConfig) -> None:
    """Cluster the exact survivors by verified similarity; remove all but each cluster's survivor."""
    is_member = decisions.survivor == np.arange(len(decisions.survivor))
    members = np.flatnonzero(is_member)
    left_docs, right_docs = index.candidate_pairs(np.flatnonzero(~is_member))
    scorer = PairScorer(index, minhash.sorted_unique(np.concatenate([left_docs, right_docs])))
    verified = scorer.similarity(left_docs, right_docs) >= config.near.threshold
    left, right = np.searchsorted(members, left_docs[verified]), np.searchsorted(members, right_docs[verified])
    labels = minhash.connected_components(len(members), left, right)
    cluster_survivor = preferred_survivor(labels, locked[members])
    in_cluster = np.bincount(labels, minlength=len(members))[labels] > 1
    similarity = np.ones(len(members))  # a member outside every cluster is its own survivor
    similarity[in_cluster] = scorer.similarity(members[in_cluster], members[cluster_survivor[in_cluster]])
    removed = (cluster_survivor != np.arange(len(members))) & ~locked[members]
    decisions.survivor[members[removed]] = members[cluster_survivor[removed]]
    decisions.kind[members[removed]] = "near"
    decisions.similarity[members[removed]] = similarity[removed]
    # An exact copy of a document removed as a near duplicate points at the final survivor.
    exact_of_removed = (decisions.kind == "exact") & (decisions.kind[decisions.survivor] == "near")
    via = decisions.survivor[exact_of_removed]
    decisions.survivor[exact_of_removed] = decisions.survivor[via]
    decisions.kind[exact_of_removed] = "near"
    decisions.similarity[exact_of_removed] = decisions.similarity[via]
    decisions.cluster_members = members[in_cluster]
    decisions.cluster_survivors = members[cluster_survivor[in_cluster]]
    decisions.cluster_similarity = similarity[in_cluster]


def write_outputs(catalog: pa.Table, decisions: Decisions, paths: RunPaths) -> dict[str, int]:
    """Write ``duplicates.parquet`` (sorted by doc_id) and ``clusters.parquet``; return the counts."""
    index = np.arange(catalog.num_rows)
    removed = np.flatnonzero(decisions.survivor != index)
    doc_ids = catalog.column("doc_id").combine_chunks().to_numpy()
    duplicates = pa.table(
        {
            "doc_id": doc_ids[removed],
            "source": catalog.column("source").take(removed),
            "source_id": catalog.column("source_id").take(removed),
            "uri": catalog.column("uri").take(removed),
            "duplicate_of": doc_ids[decisions.survivor[removed]],
            "kind": pa.array(decisions.kind[removed].tolist(), pa.string()),
            "similarity": decisions.similarity[removed],
        },
        schema=DUPLICATES_SCHEMA,
    )
    with paths.atomic_write(paths.duplicates) as tmp:
        pq.write_table(duplicates.sort_by("doc_id"), tmp, compression="zstd")
    write_clusters(catalog, decisions, doc_ids, paths)
    num_exact = int(np.count_nonzero(decisions.kind == "exact"))
    num_near = int(np.count_nonzero(decisions.kind == "near"))
    return {"num_documents_in": catalog.num_rows, "num_exact_duplicates": num_exact,
            "num_near_duplicates": num_near, "num_kept": catalog.num_rows - num_exact - num_near}


def write_clusters(catalog: pa.Table, decisions: Decisions, doc_ids: np.ndarray, paths: RunPaths) -> None:
    """``clusters.parquet``: every near cluster's members, sorted by (cluster_id, doc_id)."""
    members = decisions.cluster_members
    clusters = pa.table(
        {
            "cluster_id": doc_ids[decisions.cluster_survivors],
            "doc_id": doc_ids[members],
            "source": catalog.column("source").take(members),
            "uri": catalog.column("uri").take(members),
            "kept": decisions.survivor[members] == members,
            "similarity": decisions.cluster_similarity,
        },
        schema=CLUSTERS_SCHEMA,
    )
    with paths.atomic_write(paths.clusters) as tmp:
        pq.write_table(clusters.sort_by([("cluster_id", "ascending"), ("doc_id", "ascending")]), tmp,
                       compression="zstd")
