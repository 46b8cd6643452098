"""Benchmark of the dedupe stage (exact + near) against datasketch's MinHash + MinHashLSH, in one process.

Same texts for both sides: the standard library's ``.py`` files, replicated with random word edits and
shuffled paragraphs up to the wanted size (so the copies are a mix of near duplicates and distinct
documents), plus a planted subset of families (exact copies, whitespace changes, word edits at several
rates, shuffled paragraphs, added headers) and hard negatives (distinct files behind one long licence
header) whose exact shingle Jaccard is the ground truth.

``ours`` is :func:`pipeline.dedupe.stage.dedupe_documents` over the ingested documents (exact groups, MinHash,
LSH, DuckDB band grouping, verification, clusters, outputs written) plus what the ingest stage computes
for it: the exact-dedupe content hash and the MinHash signatures (made from each row group's text as
ingest writes it, so dedupe need not decode the text again). ``baseline`` is what a user would write
with datasketch: a hash set of the whitespace-collapsed text for exact copies, then
``MinHash(num_perm).update_batch`` over the same word 5-gram shingles and ``MinHashLSH(threshold)`` query +
insert. Throughput is per core (MB per CPU-second)
because ours uses Rust and DuckDB threads; wall-clock MB/s is printed too. Each side first runs once on the
planted subset, untimed, so one-time costs per process (numba compiling, DuckDB's first connection) stay out.
Then each side is timed ``--repeats`` times (3; ours from a fresh ``dedupe/`` folder each time) and its least
CPU time counts, as ``timeit`` does: on a shared machine, noise only ever adds time (single runs of either
side varied by ±10%).

Run from the repo root: ``.venv/bin/python -m benchmarks.dedupe --quick``. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.corpus import stdlib_docstring_texts, stdlib_texts

NGRAM = 5
NUM_PERM = 128
THRESHOLD = 0.8
EDIT_RATES = (0.01, 0.02, 0.03, 0.05, 0.10, 0.20)
LICENCE_HEADER = """# Licensed to the Apache Software Foundation (ASF) under one or more contributor license agreements.
# See the NOTICE file distributed with this work for additional information regarding copyright
# ownership. The ASF licenses this file to you under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License. You may obtain a copy of the
# License at http://www.apache.org/licenses/LICENSE-2.0 Unless required by applicable law or agreed to
# in writing, software distributed under the License is distributed on an "AS IS" BASIS, WITHOUT
# WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied. See the License for the specific
# language governing permissions and limitations under the License.
"""


@dataclass(frozen=True)
class PlantedDoc:
    """One document of the benchmark: its family (the original it derives from) and how it was made."""

    name: str
    family: int
    kind: str
    text: str


# ---- corpus -------------------------------------------------------------------------------------


def choose_distinct(texts: list[str], count: int, rng: np.random.Generator, max_jaccard: float = 0.3) -> list[str]:
    """``count`` texts at random (kept in path order), none sharing more than ``max_jaccard`` of its
    shingles with another, so every planted family is independent of the others."""
    picked = sorted(rng.choice(len(texts), min(len(texts), count * 3 // 2 + 5), replace=False))
    candidates = [texts[i] for i in picked]
    similar = exact_similar_pairs([shingle_set(text) for text in candidates], max_jaccard)
    dropped = {right for _, right in similar}
    return [text for index, text in enumerate(candidates) if index not in dropped][:count]


def edit_words(text: str, rate: float, rng: np.random.Generator) -> str:
    """Replace about ``rate`` of the words, at random positions, by fresh random tokens (layout kept)."""
    words = iter(rng.random(len(text.split())) < rate)
    fresh = iter(rng.integers(0, 2**40, len(text.split())))
    return re.sub(r"\S+", lambda match: f"w{next(fresh):x}" if next(words) else match.group(0), text)


def shuffle_paragraphs(text: str, rng: np.random.Generator) -> str:
    """The blank-line-separated paragraphs in a random order."""
    paragraphs = text.split("\n\n")
    return "\n\n".join(paragraphs[i] for i in rng.permutation(len(paragraphs)))


def change_whitespace(text: str) -> str:
    """Tabs for 4-space indents, CRLF line ends, trailing spaces: an exact copy after normalisation."""
    return text.replace("    ", "\t").replace("\n", "  \r\n")


def add_header(text: str, family: int) -> str:
    """Two comment lines on top, as a mirror or a code generator would add."""
    return f"# Mirrored from https://example.org/m/{family}.py on 2024-05-0{family % 9 + 1}\n# Do not edit.\n{text}"


def change_punctuation(text: str, rng: np.random.Generator) -> str:
    """Punctuation as another copy has it: about half the commas dropped, ";" and ":" as ",", "--" as an em dash,
    parentheses as commas."""
    text = re.sub(r",", lambda _: "," if rng.random() < 0.5 else "", text)
    return text.replace(";", ",").replace(":", ",").replace("--", "—").replace(" (", ", ").replace(")", ",")


def curl_quotes(text: str) -> str:
    """Typographic quotes for straight ones: ``"x"`` as “x”, ``'x'`` as ‘x’, apostrophes as ’."""
    text = re.sub(r'"([^"\n]*)"', "“\\1”", text)
    return re.sub(r"(?<!\w)'([^'\n]*)'", "‘\\1’", text).replace("'", "’")


def change_case(text: str, rng: np.random.Generator) -> str:
    """Every line upper-cased, title-cased or lower-cased at random (a shouted or re-cased copy)."""
    styles = (str.upper, str.title, str.lower)
    return "\n".join(styles[rng.integers(3)](line) for line in text.split("\n"))


def change_spacing(text: str) -> str:
    """Space moved around punctuation: ``a, b.`` as ``a ,b .`` and lines re-wrapped with non-breaking spaces."""
    text = re.sub(r"([,.;:!?]) ", r" \1", text)
    return text.replace("\n\n", "\u2029").replace("\n", "\u00a0").replace("\u2029", "\n\n")


def plant_prose_families(originals: list[str], rng: np.random.Generator, first_family: int) -> list[PlantedDoc]:
    """Each prose original with copies that differ only in punctuation, quotes, case or spacing (the same
    normalised words), one with all of those plus 1% word edits, and a 10% word edit (a negative)."""
    docs = []
    for family, text in enumerate(originals, start=first_family):
        variants = [("original", text), ("punctuation", change_punctuation(text, rng)), ("quotes", curl_quotes(text)),
                    ("case", change_case(text, rng)), ("spacing", change_spacing(text)),
                    ("typography", change_spacing(curl_quotes(change_case(change_punctuation(
                        edit_words(text, 0.01, rng), rng), rng)))),
                    ("prose-edit10%", edit_words(text, 0.10, rng))]
        docs.extend(PlantedDoc(f"f{family:04d}-{kind}", family, kind, body) for kind, body in variants)
    return docs


def plant_families(originals: list[str], rng: np.random.Generator, edit_rates: tuple[float, ...] = EDIT_RATES
                   ) -> list[PlantedDoc]:
    """Each original with an exact copy, a whitespace change, word edits at each rate, shuffled
    paragraphs and an added header; families are numbered from 0 in the order of ``originals``."""
    docs = []
    for family, text in enumerate(originals):
        variants = [("original", text), ("exact", text), ("whitespace", change_whitespace(text)),
                    *[(f"edit{round(rate * 100)}%", edit_words(text, rate, rng)) for rate in edit_rates],
                    ("shuffled", shuffle_paragraphs(text, rng)), ("header", add_header(text, family))]
        docs.extend(PlantedDoc(f"f{family:04d}-{kind}", family, kind, body) for kind, body in variants)
    return docs


def hard_negatives(bodies: list[str], first_family: int) -> list[PlantedDoc]:
    """Distinct small files behind the same long licence header: similar-looking, mostly not duplicates."""
    return [PlantedDoc(f"f{first_family + i:04d}-licence", first_family + i, "licence", LICENCE_HEADER + body)
            for i, body in enumerate(bodies)]


# ---- ground truth -------------------------------------------------------------------------------


_NORMALISED_WORD = re.compile(r"[^\W_]+")


def normalised_words(text: str) -> list[str]:
    """Case-folded runs of letters and digits (``\\w`` without ``_``), every digit as ``0``: the words tokenmill's
    MinHash compares, written independently of it (they differ only on combining marks, which ``\\w`` excludes)."""
    return _NORMALISED_WORD.findall(re.sub(r"\d", "0", text.casefold()))


def shingle_set(text: str, ngram: int = NGRAM) -> set[int]:
    """Hashes of the normalised-word ``ngram``-grams (:func:`normalised_words`); a text shorter than ``ngram``
    words is one shingle of all its words."""
    words = normalised_words(text)
    return {hash(tuple(words[i : i + ngram])) for i in range(max(len(words) - ngram + 1, 1))}


def jaccard(left: set[int], right: set[int]) -> float:
    common = len(left & right)
    return common / (len(left) + len(right) - common) if left or right else 1.0


def exact_similar_pairs(sets: list[set[int]], threshold: float) -> dict[tuple[int, int], float]:
    """Every pair ``(i, j)``, i < j, with exact Jaccard >= ``threshold``, by prefix filtering.

    Exact, not sampled: with shingles ordered rarest first, two sets with Jaccard >= t must share one of
    the first ``|x| - ceil(t*|x|) + 1`` shingles of each (the AllPairs prefix lemma), so only pairs sharing
    a prefix shingle are compared, and each of those exactly.
    """
    frequency = Counter(shingle for shingles in sets for shingle in shingles)
    index: dict[int, list[int]] = defaultdict(list)
    candidates: set[tuple[int, int]] = set()
    for doc, shingles in enumerate(sets):
        ordered = sorted(shingles, key=lambda shingle: (frequency[shingle], shingle))
        for shingle in ordered[: len(ordered) - math.ceil(threshold * len(ordered)) + 1]:
            candidates.update((earlier, doc) for earlier in index[shingle])
            index[shingle].append(doc)
    pairs = {pair: jaccard(sets[pair[0]], sets[pair[1]]) for pair in candidates}
    return {pair: value for pair, value in sorted(pairs.items()) if value >= threshold}


def components(num_docs: int, edges: list[tuple[int, int]]) -> np.ndarray:
    """Cluster label per document from duplicate edges (union-find)."""
    parent = list(range(num_docs))

    def root(node: int) -> int:
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for left, right in edges:
        parent[root(left)] = root(right)
    return np.array([root(node) for node in range(num_docs)])


def score(docs: list[PlantedDoc], sets: list[set[int]], truth: dict[tuple[int, int], float],
          edges: list[tuple[int, int]]) -> dict[str, dict[str, float]]:
    """Recall (pairs with true Jaccard >= THRESHOLD that end in one cluster) and precision (duplicate edges
    whose true Jaccard >= THRESHOLD), overall and per kind of variant (against its family's original)."""
    labels = components(len(docs), edges)
    found = [labels[i] == labels[j] for i, j in truth]
    correct = [jaccard(sets[i], sets[j]) >= THRESHOLD for i, j in edges]
    results = {"all": {"pairs": len(truth), "recall": _share(found), "edges": len(edges),
                       "precision": _share(correct)}}
    original = {doc.family: index for index, doc in enumerate(docs) if doc.kind == "original"}
    for kind in dict.fromkeys(doc.kind for doc in docs if doc.kind != "original"):
        members = [i for i, doc in enumerate(docs) if doc.kind == kind]
        pairs = [(original[docs[i].family], i) for i in members if docs[i].family in original]
        if not pairs:  # hard negatives have no original: every pair of them
            pairs = [(a, b) for position, a in enumerate(members) for b in members[position + 1 :]]
        similarity = [jaccard(sets[a], sets[b]) for a, b in pairs]
        positives = [pair for pair, value in zip(pairs, similarity, strict=True) if value >= THRESHOLD]
        kind_edges = [edge for edge, ok in zip(edges, correct, strict=True) if docs[edge[0]].kind == kind]
        results[kind] = {"mean_jaccard": float(np.mean(similarity)) if similarity else float("nan"),
                         "pairs": len(positives), "recall": _share([labels[a] == labels[b] for a, b in positives]),
                         "edges": len(kind_edges),
                         "precision": _share([jaccard(sets[a], sets[b]) >= THRESHOLD for a, b in kind_edges])}
    return results


def _share(flags: list[bool]) -> float:
    return float(np.mean(flags)) if flags else 1.0


def format_scores(title: str, scores: dict[str, dict[str, float]]) -> str:
    lines = [title, f"{'variant':<12}{'true J':>8}{'pairs>=0.8':>12}{'recall':>8}{'edges':>8}{'precision':>11}"]
    for kind, row in scores.items():
        mean = f"{row['mean_jaccard']:.3f}" if "mean_jaccard" in row else ""
        lines.append(f"{kind:<12}{mean:>8}{row['pairs']:>12}{row['recall']:>8.3f}{row['edges']:>8}"
                     f"{row['precision']:>11.3f}")
    return "\n".join(lines)


# ---- the two sides ------------------------------------------------------------------------------


def write_jsonl(folder: Path, names: list[str], texts: list[str], docs_per_file: int = 2000) -> Path:
    """The texts as ``corpus/NNNN.jsonl`` files (``id`` = name) and a manifest reading them; returns it."""
    import yaml

    corpus = folder / "corpus"
    corpus.mkdir(parents=True)
    for number, start in enumerate(range(0, len(texts), docs_per_file)):
        with open(corpus / f"{number:04d}.jsonl", "w", encoding="utf-8") as handle:
            for name, text in zip(names[start:start + docs_per_file], texts[start:start + docs_per_file],
                                  strict=True):
                handle.write(json.dumps({"id": name, "text": text}) + "\n")
    manifest = folder / "corpus.yaml"
    manifest.write_text(yaml.safe_dump({"name": "bench", "sources": [{
        "name": "bench", "path": "corpus", "format": "jsonl", "id_field": "id"}],
        "filters": {"max_chars": 10**8}}), encoding="utf-8")
    return manifest


def ingest(manifest: Path, run_dir: Path):
    from core.rundir import RunPaths
    from pipeline.ingest.stage import ingest_part, plan_ingest

    paths = RunPaths(run_dir)
    for part in plan_ingest([manifest], paths, 32 << 20):
        ingest_part(part, 0.0, paths)
    return paths


def run_ours(paths, names: list[str]) -> tuple[list[tuple[int, int]], dict[str, float]]:
    """Dedupe the ingested run; returns duplicate edges (removed, survivor) as indices into ``names``
    and timings. What ingest computes for dedupe is re-timed here and counted as ours: each document's
    content hash, and each row group's MinHash signatures (written as the dedupe stage's cache, as ingest
    does with the run's near settings)."""
    import pyarrow.parquet as pq

    from core.documents import DUPLICATES_FILE, document_part_files
    from pipeline.config import DedupeConfig, NearDedupeConfig
    from pipeline.dedupe.stage import dedupe_documents, finished_parts
    from pipeline.filters.screen import content_hash
    from pipeline.ingest.part_files import SignatureCollector

    config = DedupeConfig(near=NearDedupeConfig(threshold=THRESHOLD, num_perm=NUM_PERM, ngram=NGRAM))
    parts = finished_parts(paths)
    row_groups = [[pq.ParquetFile(part.path).read_row_group(group) for group in
                   range(pq.ParquetFile(part.path).num_row_groups)] for part in parts]  # in memory during ingest
    texts = [text for groups in row_groups for group in groups for text in group.column("text").to_pylist()]
    started, cpu = time.perf_counter(), time.process_time()
    for text in texts:
        content_hash(text)
    for part, groups in zip(parts, row_groups, strict=True):
        signatures = SignatureCollector(paths, part.part_id, part.fingerprint, config.near)
        for group in groups:
            signatures.add(group)
        signatures.write()
    dedupe_documents(paths, config)
    timing = {"wall_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu}
    position = {name: index for index, name in enumerate(names)}
    catalog = {row["doc_id"]: row["source_id"] for part in document_part_files(paths)
               for row in pq.read_table(part, columns=["doc_id", "source_id"]).to_pylist()}
    duplicates = pq.read_table(paths.dedupe / DUPLICATES_FILE).to_pylist()
    edges = [(position[row["source_id"]], position[catalog[row["duplicate_of"]]]) for row in duplicates]
    return edges, timing


def run_datasketch(texts: list[str]) -> tuple[list[tuple[int, int]], dict[str, float]]:
    """Exact hash set, then MinHash + MinHashLSH query-then-insert; edges to every earlier match."""
    import xxhash
    from datasketch import MinHash, MinHashLSH

    started, cpu = time.perf_counter(), time.process_time()
    lsh = MinHashLSH(threshold=THRESHOLD, num_perm=NUM_PERM)
    seen: dict[int, int] = {}
    edges = []
    for index, text in enumerate(texts):
        key = xxhash.xxh3_64_intdigest(" ".join(text.split()).encode("utf-8"))
        if key in seen:
            edges.append((index, seen[key]))
            continue
        seen[key] = index
        words = text.lower().split()
        minhash = MinHash(num_perm=NUM_PERM)
        minhash.update_batch([" ".join(words[i : i + NGRAM]).encode("utf-8")
                              for i in range(max(len(words) - NGRAM + 1, 1))])
        edges.extend((index, match) for match in lsh.query(minhash))
        lsh.insert(index, minhash)
    return edges, {"wall_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu}


# ---- main ---------------------------------------------------------------------------------------


def warm_up(folder: Path, planted: list[PlantedDoc]) -> None:
    """Both sides once on the planted subset, untimed: one-time costs per process (numba compiling or loading
    its cache, DuckDB's first connection, imports) are not throughput. Prints what ours took."""
    started = time.perf_counter()
    names = [doc.name for doc in planted]
    run_ours(ingest(write_jsonl(folder, names, [doc.text for doc in planted]), folder / "run"), names)
    print(f"warm-up (untimed): tokenmill {time.perf_counter() - started:.2f} s incl. numba compile or cache load")
    run_datasketch([doc.text for doc in planted])


def planted_benchmark(num_families: int, rng: np.random.Generator, num_prose_families: int = 0) -> list[PlantedDoc]:
    """Families of ``num_families`` distinct stdlib files (300-5000 words), then ``num_families // 2`` hard
    negatives (distinct 20-80-word files behind one 110-word licence header: Jaccard ~0.4-0.7), then
    ``num_prose_families`` of real prose (stdlib docstrings) with punctuation, quote, case and spacing edits."""
    originals = choose_distinct(stdlib_texts(10**9, min_words=300, max_words=5000), num_families, rng)
    small = choose_distinct(stdlib_texts(10**9, min_words=20, max_words=80), max(num_families // 2, 10), rng)
    docs = plant_families(originals, rng) + hard_negatives(small, len(originals))
    if num_prose_families:
        prose = choose_distinct(stdlib_docstring_texts(10**9, min_words=300, max_words=5000), num_prose_families, rng)
        docs += plant_prose_families(prose, rng, first_family=len(originals) + len(small))
    return docs


def build_corpus(bulk_bytes: int, num_families: int, seed: int = 0) -> tuple[list[PlantedDoc], list[str]]:
    """(planted subset, bulk texts): families + hard negatives, and the stdlib replicated with edits."""
    rng = np.random.default_rng(seed)
    planted = planted_benchmark(num_families, rng, num_prose_families=num_families // 2)
    base = stdlib_texts(10**9)
    bulk, total, replica = [], 0, 0
    while total < bulk_bytes:
        for text in base:
            if replica:  # copies after the first: a random edit rate up to 30%, every fourth one shuffled too
                text = edit_words(text, rng.uniform(0.0, 0.3), rng)
                text = shuffle_paragraphs(text, rng) if rng.random() < 0.25 else text
            bulk.append(text)
            total += len(text.encode("utf-8"))
            if total >= bulk_bytes:
                break
        replica += 1
    return planted, bulk


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="about 12 MB of text (well under 2 minutes)")
    parser.add_argument("--mb", type=int, default=None, help="MB of bulk text (default 110, quick 10)")
    parser.add_argument("--families", type=int, default=None, help="planted families (default 150, quick 60)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side; the least CPU time counts")
    args = parser.parse_args(argv)
    bulk_mb = args.mb or (10 if args.quick else 110)
    planted, bulk = build_corpus(bulk_mb * 1_000_000, args.families or (60 if args.quick else 150))
    names = [doc.name for doc in planted] + [f"bulk{i:06d}" for i in range(len(bulk))]
    texts = [doc.text for doc in planted] + bulk
    sets = [shingle_set(doc.text) for doc in planted]
    truth = exact_similar_pairs(sets, THRESHOLD)
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-dedupe-") as tmp:
        warm_up(Path(tmp) / "warm-up", planted)
        paths = ingest(write_jsonl(Path(tmp), names, texts), Path(tmp) / "run")
        ours = best_of(args.repeats, lambda: run_ours(paths, names), before=lambda: shutil.rmtree(paths.dedupe))
    baseline = best_of(args.repeats, lambda: run_datasketch(texts))
    report(planted, sets, truth, texts, {"ours": ours, "baseline": baseline})


def best_of(repeats: int, run: Callable[[], tuple[list, dict[str, float]]],
            before: Callable[[], None] | None = None) -> tuple[list, dict[str, float]]:
    """The run with the least CPU time of ``repeats`` (as ``timeit`` takes the best: the noise of a shared
    machine only ever adds time); every run must find the same edges. The CPU times of all runs are kept."""
    results = []
    for _ in range(repeats):
        if before is not None and results:
            before()  # a fresh start: no caches or state from the previous run
        results.append(run())
    edges, timing = min(results, key=lambda result: result[1]["cpu_s"])
    if any(sorted(other) != sorted(edges) for other, _ in results):
        raise AssertionError("repeated runs found different duplicates")
    return edges, {**timing, "all_cpu_s": [result[1]["cpu_s"] for result in results]}


def report(planted: list[PlantedDoc], sets: list[set[int]], truth: dict, texts: list[str], sides: dict) -> None:
    num_bytes = sum(len(text.encode("utf-8")) for text in texts)
    print(f"corpus: {len(texts)} documents, {num_bytes / 1e6:.1f} MB (stdlib .py, replicated with edits); planted "
          f"subset {len(planted)} documents, {len(truth)} pairs with exact Jaccard >= {THRESHOLD}")
    labels = {"ours": "tokenmill dedupe (exact + MinHash/LSH)", "baseline": "datasketch MinHash + MinHashLSH"}
    print(f"{'side':<40}{'wall s':>8}{'CPU s':>8}{'docs/s':>10}{'MB/s':>8}{'MB/CPU-s':>10}{'recall':>8}"
          f"{'precision':>10}")
    per_core = {}
    for side, (edges, timing) in sides.items():
        subset = [edge for edge in edges if edge[0] < len(planted) and edge[1] < len(planted)]
        scores = score(planted, sets, truth, subset)
        per_core[side] = num_bytes / 1e6 / timing["cpu_s"]
        print(f"{labels[side]:<40}{timing['wall_s']:>8.1f}{timing['cpu_s']:>8.1f}"
              f"{len(texts) / timing['wall_s']:>10.0f}{num_bytes / 1e6 / timing['wall_s']:>8.1f}"
              f"{per_core[side]:>10.1f}{scores['all']['recall']:>8.3f}{scores['all']['precision']:>10.3f}")
        runs = ", ".join(f"{cpu_s:.2f}" for cpu_s in timing["all_cpu_s"])
        print(f"  {side}: CPU s of each run: {runs} (the best counts)")
        print(format_scores(f"  {side}: planted subset by variant (pairs against the family's original)", scores))
    ratio = per_core["ours"] / per_core["baseline"]
    print(json.dumps({"name": "dedupe", "ours": round(per_core["ours"], 2), "baseline": round(per_core["baseline"], 2),
                      "unit": "MB/CPU-s", "ratio": round(ratio, 2)}))


if __name__ == "__main__":
    main()
