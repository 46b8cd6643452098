"""Near-dedupe quality on a benchmark built from real stdlib files, against exact shingle Jaccard.

Families of planted variants (exact copies, whitespace changes, word edits at 1-20%, shuffled paragraphs,
added headers), hard negatives (distinct files behind one long licence header) and real prose (stdlib
docstrings) with punctuation, quote, case and spacing edits go through the real ingest and dedupe stages at
threshold 0.8. Ground truth is the exact Jaccard of normalised-word 5-gram shingles (lower-cased letter and
digit runs, digits as 0), computed independently of tokenmill (``benchmarks.dedupe``). ``pytest -s`` prints
the table.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from benchmarks.corpus import stdlib_docstring_texts, stdlib_texts
from benchmarks.dedupe import (
    NGRAM,
    NUM_PERM,
    THRESHOLD,
    choose_distinct,
    exact_similar_pairs,
    format_scores,
    ingest,
    jaccard,
    plant_prose_families,
    planted_benchmark,
    run_ours,
    score,
    shingle_set,
    write_jsonl,
)
from core.documents import document_part_files, iter_documents
from core.rundir import RunPaths
from pipeline.config import DedupeConfig, NearDedupeConfig
from pipeline.dedupe.stage import CLUSTERS_FILE, dedupe_documents
from pipeline.ingest.stage import ingest_part, plan_ingest

NUM_FAMILIES = 60
NUM_PROSE_FAMILIES = 30
TYPOGRAPHIC_KINDS = ("punctuation", "quotes", "case", "spacing", "typography")


@pytest.fixture(scope="module")
def benchmark_scores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, float]]:
    planted = planted_benchmark(NUM_FAMILIES, np.random.default_rng(7), NUM_PROSE_FAMILIES)
    folder = tmp_path_factory.mktemp("quality")
    paths = ingest(write_jsonl(folder, [doc.name for doc in planted], [doc.text for doc in planted]), folder / "run")
    edges, _ = run_ours(paths, [doc.name for doc in planted])
    sets = [shingle_set(doc.text) for doc in planted]
    scores = score(planted, sets, exact_similar_pairs(sets, THRESHOLD), edges)
    print("\n" + format_scores(f"tokenmill near dedupe at threshold {THRESHOLD}, {len(planted)} documents", scores))
    return scores


def test_recall_and_precision_at_threshold(benchmark_scores: dict[str, dict[str, float]]) -> None:
    overall = benchmark_scores["all"]
    assert overall["pairs"] > 5 * NUM_FAMILIES  # the benchmark has real positives to find
    assert overall["recall"] >= 0.95
    assert overall["precision"] >= 0.95


def test_exact_and_whitespace_copies_are_all_found(benchmark_scores: dict[str, dict[str, float]]) -> None:
    for kind in ("exact", "whitespace"):
        assert benchmark_scores[kind]["pairs"] == NUM_FAMILIES
        assert benchmark_scores[kind]["recall"] == 1.0


def test_typographic_copies_of_prose_are_all_found(benchmark_scores: dict[str, dict[str, float]]) -> None:
    """Copies differing only in punctuation, quotes, case or spacing have the same normalised words."""
    for kind in TYPOGRAPHIC_KINDS:
        assert benchmark_scores[kind]["pairs"] == NUM_PROSE_FAMILIES, kind
        assert benchmark_scores[kind]["recall"] == 1.0, kind
    assert benchmark_scores["prose-edit10%"]["pairs"] == 0  # 10% of the words changed: not a copy


def test_typographic_copies_are_not_copies_on_whitespace_words() -> None:
    """What the prose variants test: on whitespace-separated words (the words before normalisation) most of them
    fall below the threshold, so a dedupe on those words would miss them."""
    rng = np.random.default_rng(5)
    planted = plant_prose_families(choose_distinct(stdlib_docstring_texts(10**9, 300, 5000), 8, rng), rng, 0)
    original = {doc.family: doc.text for doc in planted if doc.kind == "original"}

    def whitespace_shingles(text: str) -> set[int]:
        words = text.encode("utf-8").lower().split()
        return {hash(tuple(words[i : i + NGRAM])) for i in range(max(len(words) - NGRAM + 1, 1))}

    for kind in ("punctuation", "spacing", "typography"):
        docs = [doc for doc in planted if doc.kind == kind]
        before = [jaccard(whitespace_shingles(original[doc.family]), whitespace_shingles(doc.text)) for doc in docs]
        after = [jaccard(shingle_set(original[doc.family]), shingle_set(doc.text)) for doc in docs]
        assert np.mean(before) < THRESHOLD <= min(after), (kind, before, after)


def test_benchmark_spans_both_sides_of_the_threshold(benchmark_scores: dict[str, dict[str, float]]) -> None:
    # 1% edits stay above 0.8, 5%+ fall well below it: the benchmark tests both recall and precision.
    assert benchmark_scores["edit1%"]["mean_jaccard"] > 0.85
    assert benchmark_scores["edit5%"]["mean_jaccard"] < 0.7
    assert benchmark_scores["edit20%"]["pairs"] == 0
    assert benchmark_scores["licence"]["mean_jaccard"] > 0.4  # distinct files behind one header look alike
    assert benchmark_scores["licence"]["edges"] == benchmark_scores["licence"]["pairs"]  # yet stay apart


def test_prefix_filtered_ground_truth_equals_brute_force() -> None:
    texts = stdlib_texts(400_000, min_words=20, max_words=400)
    rng = np.random.default_rng(3)
    variants = texts + [" ".join(w if rng.random() > 0.02 else "x" for w in t.split()) for t in texts[:20]]
    sets = [shingle_set(text) for text in variants]
    brute = {(i, j): jaccard(sets[i], sets[j]) for i, j in itertools.combinations(range(len(sets)), 2)}
    for threshold in (0.5, 0.8):
        expected = {pair: value for pair, value in brute.items() if value >= threshold}
        assert exact_similar_pairs(sets, threshold) == expected
        assert len(expected) >= 10




def test_near_duplicate_clusters_land_on_one_side_of_the_split(tmp_path: Path) -> None:
    """Each document's split comes from its own hash, so the copies of one original start out on both sides;
    after dedupe only one member per cluster is kept, so no pair at Jaccard >= threshold spans train and val."""
    planted = planted_benchmark(20, np.random.default_rng(11))
    manifest = write_jsonl(tmp_path, [doc.name for doc in planted], [doc.text for doc in planted])
    paths = RunPaths(tmp_path / "run")
    for part in plan_ingest([manifest], paths, 32 << 20):
        ingest_part(part, 0.5, paths)
    texts = {doc.name: doc.text for doc in planted}

    def cross_split_pairs(table: pa.Table) -> dict[tuple[int, int], float]:
        rows = table.to_pylist()
        pairs = exact_similar_pairs([shingle_set(texts[row["source_id"]]) for row in rows], THRESHOLD)
        return {pair: value for pair, value in pairs.items() if rows[pair[0]]["split"] != rows[pair[1]]["split"]}

    columns = ["doc_id", "source_id", "split"]
    ingested = pa.concat_tables(pq.read_table(part, columns=columns) for part in document_part_files(paths))
    assert len(cross_split_pairs(ingested)) >= 20  # without dedupe, near copies would leak across the split

    dedupe_documents(paths, DedupeConfig(near=NearDedupeConfig(threshold=THRESHOLD, num_perm=NUM_PERM, ngram=NGRAM)))
    kept = pa.Table.from_batches(list(iter_documents(paths, columns=columns)))
    assert cross_split_pairs(kept) == {}
    clusters = pq.read_table(paths.dedupe / CLUSTERS_FILE).to_pylist()
    kept_ids = set(kept.column("doc_id").to_pylist())
    for cluster_id in {row["cluster_id"] for row in clusters}:
        members = [row["doc_id"] for row in clusters if row["cluster_id"] == cluster_id]
        assert sum(doc_id in kept_ids for doc_id in members) == 1
