"""Near-dedupe quality on a benchmark built from real stdlib files, against exact shingle Jaccard.

Families of planted variants (exact copies, whitespace changes, word edits at 1-20%, shuffled paragraphs,
added headers) and hard negatives (distinct files behind one long licence header) go through the real
ingest and dedupe stages at threshold 0.8. Ground truth is the exact Jaccard of the same word 5-gram
shingles, computed independently of tokenmill (``benchmarks.dedupe``). ``pytest -s`` prints the table.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from benchmarks.corpus import stdlib_texts
from benchmarks.dedupe import (
    THRESHOLD,
    exact_similar_pairs,
    format_scores,
    ingest,
    jaccard,
    planted_benchmark,
    run_ours,
    score,
    shingle_set,
    write_jsonl,
)

NUM_FAMILIES = 60


@pytest.fixture(scope="module")
def benchmark_scores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, float]]:
    planted = planted_benchmark(NUM_FAMILIES, np.random.default_rng(7))
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


