"""How far two dedupers agree on what they removed: Jaccard of the removed sets, and whether each removal has a
partner in the corpus at exact shingle Jaccard >= the threshold (tokenmill's word 5-gram shingles)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

AGREEMENT_BANDS = 32
AGREEMENT_ROWS = 4
"""Candidate partners: 32 bands of 4 of 128 permutations make a pair at Jaccard 0.8 a candidate with
p = 1 - (1 - 0.8**4)**32 > 0.9999999, so the partner counts are exact checks of nearly every true pair."""


def read_corpus(folder: Path) -> tuple[list[str], list[str]]:
    """(ids, texts) of ``folder/*.jsonl`` in file order."""
    names, texts = [], []
    for path in sorted(folder.glob("*.jsonl")):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                record = json.loads(line)
                names.append(record["id"])
                texts.append(record["text"])
    return names, texts


def agreement(corpus: Path, ours: set[str], theirs: set[str], threshold: float) -> dict[str, float | int]:
    """Removed-set Jaccard, sizes, and per side the share of removals with an exact-Jaccard partner."""
    names, texts = read_corpus(corpus)
    position = {name: index for index, name in enumerate(names)}
    partnered = documents_with_partner(texts, sorted(position[name] for name in ours | theirs), threshold)
    union = len(ours | theirs)
    return {
        "tokenmill_removed": len(ours), "datatrove_removed": len(theirs), "both_removed": len(ours & theirs),
        "jaccard": len(ours & theirs) / union if union else 1.0,
        "tokenmill_with_partner": _share([position[name] in partnered for name in ours]),
        "datatrove_with_partner": _share([position[name] in partnered for name in theirs]),
    }


def documents_with_partner(texts: list[str], docs: list[int], threshold: float) -> set[int]:
    """Those of ``docs`` with another document at exact shingle Jaccard >= ``threshold``."""
    from pipeline.dedupe import kernels, minhash

    array = pa.array(texts, pa.large_string())
    signatures = np.concatenate([minhash.signatures(array.slice(start, 512), 128, 5)
                                 for start in range(0, len(texts), 512)])
    left, right = minhash.candidate_pairs(minhash.band_keys(signatures, AGREEMENT_BANDS, AGREEMENT_ROWS))
    wanted = np.isin(left, docs) | np.isin(right, docs)
    left, right = left[wanted], right[wanted]
    shingles = {doc: shingle_set(texts[doc]) for doc in minhash.sorted_unique(np.r_[left, right]).tolist()}
    found: set[int] = set()
    for a, b in zip(left.tolist(), right.tolist(), strict=True):
        if (a not in found or b not in found) and kernels.sorted_set_jaccard(shingles[a], shingles[b]) >= threshold:
            found.update((a, b))
    return found & set(docs)


def shingle_set(text: str) -> np.ndarray:
    """Sorted distinct word 5-gram hashes of one text, as tokenmill's MinHash shingles it."""
    from pipeline.dedupe import minhash

    words, offsets = minhash.word_hashes(pa.array([text], pa.large_string()))
    shingles, _ = minhash.shingle_hashes(words, offsets, 5)
    return minhash.sorted_unique(shingles)


def _share(flags: list[bool]) -> float:
    return float(np.mean(flags)) if flags else 1.0
