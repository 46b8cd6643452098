"""pipeline/dedupe/stage.py and pipeline/dedupe/minhash.py on real stdlib files with planted exact and near copies."""

from __future__ import annotations

import re
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from benchmarks.dedupe import normalised_words
from core.documents import DUPLICATES_FILE, iter_documents
from core.rundir import RunPaths
from core.schemas import DUPLICATES_SCHEMA
from pipeline.config import DedupeConfig, NearDedupeConfig
from pipeline.dedupe import minhash, near_dedupe
from pipeline.dedupe.stage import BANDS_DIR, CLUSTERS_FILE, MINHASH_DIR, dedupe_documents
from pipeline.ingest.stage import ingest_part, part_marker, plan_ingest

STDLIB = Path(sysconfig.get_paths()["stdlib"])
PART_BYTES = 128 * 1024
# 5-word shingles: editing 1% of the words gives Jaccard ~0.90, 2% ~0.82. A 0.7 threshold keeps the planted
# copies 3+ standard deviations of the 128-permutation estimate (~0.035) away from the decision.
CONFIG = DedupeConfig(near=NearDedupeConfig(threshold=0.7))


def copy_stdlib_sample(folder: Path, count: int = 30) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    chosen = [p for p in sorted(STDLIB.glob("*.py")) if 2_000 < p.stat().st_size < 40_000][:count]
    return [Path(shutil.copy(p, folder / p.name)) for p in chosen]


def write_manifest(tmp_path: Path, folder: str = "corpus") -> Path:
    manifest = {"name": "corpus", "sources": [{"name": "lib", "path": folder, "format": "text"}]}
    path = tmp_path / f"{folder}.yaml"
    path.write_text(yaml.safe_dump(manifest), encoding="utf-8")
    return path


def ingest_all(manifest: Path, paths: RunPaths) -> None:
    for part in plan_ingest([manifest], paths, PART_BYTES):
        ingest_part(part, 0.1, paths)


def edit_words(text: str, every: int) -> str:
    """Replace every ``every``-th whitespace-separated word: a near duplicate with ~1/every words changed."""
    counter = iter(range(10**9))
    return re.sub(r"\S+", lambda m: "EDITED" if next(counter) % every == every - 1 else m.group(0), text)


def shingle_jaccard(a: str, b: str, ngram: int = 5) -> float:
    def shingles(text: str) -> set[tuple[str, ...]]:
        words = normalised_words(text)  # as minhash.word_hashes splits
        return {tuple(words[i : i + ngram]) for i in range(max(len(words) - ngram + 1, 1))}

    left, right = shingles(a), shingles(b)
    return len(left & right) / len(left | right)


def duplicates_by_uri(paths: RunPaths) -> dict[str, dict]:
    return {row["uri"]: row for row in pq.read_table(paths.dedupe / DUPLICATES_FILE).to_pylist()}


def doc_ids_by_uri(paths: RunPaths) -> dict[str, int]:
    table = pa.concat_tables(pq.read_table(p, columns=["uri", "doc_id"]) for p in sorted(paths.docs.glob("*.parquet")))
    return dict(zip(table.column("uri").to_pylist(), table.column("doc_id").to_pylist(), strict=True))


@pytest.fixture
def planted(tmp_path: Path) -> tuple[Path, list[Path]]:
    """30 distinct stdlib modules plus an exact, a whitespace-changed and two word-edited (1%, 2%) copies."""
    folder = tmp_path / "corpus"
    originals = copy_stdlib_sample(folder)
    texts = [p.read_text(encoding="utf-8") for p in originals]
    (folder / "zz_copy.py").write_text(texts[0], encoding="utf-8")
    reformatted = texts[1].replace("    ", "\t").replace("\n", "  \r\n")
    (folder / "zz_whitespace.py").write_bytes(reformatted.encode("utf-8"))
    long_ones = sorted(range(2, len(texts)), key=lambda i: -len(texts[i].split()))
    (folder / "zz_near1.py").write_text(edit_words(texts[long_ones[0]], 100), encoding="utf-8")
    (folder / "zz_near2.py").write_text(edit_words(texts[long_ones[1]], 50), encoding="utf-8")
    order = [originals[0], originals[1], originals[long_ones[0]], originals[long_ones[1]]]
    return write_manifest(tmp_path), order


def test_planted_copies_are_found_and_distinct_files_kept(planted: tuple[Path, list[Path]], tmp_path: Path) -> None:
    manifest, originals = planted
    paths = RunPaths(tmp_path / "run")
    ingest_all(manifest, paths)
    summary = dedupe_documents(paths, CONFIG)
    ids = doc_ids_by_uri(paths)
    found = {uri: (row["kind"], row["duplicate_of"]) for uri, row in duplicates_by_uri(paths).items()}
    assert found == {
        "zz_copy.py": ("exact", ids[originals[0].name]),
        "zz_whitespace.py": ("exact", ids[originals[1].name]),
        "zz_near1.py": ("near", ids[originals[2].name]),
        "zz_near2.py": ("near", ids[originals[3].name]),
    }
    assert summary == {"num_documents_in": 34, "num_exact_duplicates": 2, "num_near_duplicates": 2, "num_kept": 30}
    kept = sum(batch.num_rows for batch in iter_documents(paths))
    assert kept == summary["num_kept"] == summary["num_documents_in"] - len(found)
    duplicates = duplicates_by_uri(paths)
    for name, original in [("zz_near1.py", originals[2]), ("zz_near2.py", originals[3])]:
        true = shingle_jaccard(original.read_text(encoding="utf-8"), (manifest.parent / "corpus" / name).read_text())
        assert abs(duplicates[name]["similarity"] - true) < 0.12 and duplicates[name]["similarity"] >= 0.7
    assert pq.read_schema(paths.dedupe / DUPLICATES_FILE).equals(DUPLICATES_SCHEMA, check_metadata=True)
    clusters = pq.read_table(paths.dedupe / CLUSTERS_FILE).to_pylist()
    assert sorted(row["uri"] for row in clusters if not row["kept"]) == ["zz_near1.py", "zz_near2.py"]


def test_dedupe_is_deterministic_cached_and_resumable(planted: tuple[Path, list[Path]], tmp_path: Path) -> None:
    manifest, _ = planted
    first, second = RunPaths(tmp_path / "run1"), RunPaths(tmp_path / "run2")
    for paths in (first, second):
        ingest_all(manifest, paths)
        dedupe_documents(paths, CONFIG)
    outputs = [DUPLICATES_FILE, CLUSTERS_FILE, f"{MINHASH_DIR}/part-00000.parquet"]
    for name in outputs:
        assert (first.dedupe / name).read_bytes() == (second.dedupe / name).read_bytes(), name
    stamps = {name: (first.dedupe / name).stat().st_mtime_ns for name in outputs}
    summary = dedupe_documents(first, CONFIG)
    assert {name: (first.dedupe / name).stat().st_mtime_ns for name in outputs} == stamps  # nothing redone
    (first.dedupe / "state.json").unlink()  # as if killed before the state and the marker were written
    first.marker("dedupe").unlink()
    before = (first.dedupe / DUPLICATES_FILE).read_bytes()
    assert dedupe_documents(first, CONFIG) == summary
    assert (first.dedupe / DUPLICATES_FILE).read_bytes() == before
    assert (first.dedupe / outputs[2]).stat().st_mtime_ns == stamps[outputs[2]]  # signatures came from the cache


def test_signatures_made_at_ingest_are_the_ones_dedupe_would_make(planted: tuple[Path, list[Path]],
                                                                  tmp_path: Path) -> None:
    manifest, _ = planted
    at_ingest, at_dedupe = RunPaths(tmp_path / "at_ingest"), RunPaths(tmp_path / "at_dedupe")
    parts = plan_ingest([manifest], at_ingest, PART_BYTES)
    assert len(parts) > 1
    for part in parts:
        ingest_part(part, 0.1, at_ingest, near=CONFIG.near)
    ingest_all(manifest, at_dedupe)
    caches = sorted(path.name for path in (at_ingest.dedupe / MINHASH_DIR).iterdir())
    assert caches == [f"part-{part.part_id:05d}.parquet" for part in parts] and not at_dedupe.dedupe.exists()
    stamps = {name: (at_ingest.dedupe / MINHASH_DIR / name).stat().st_mtime_ns for name in caches}
    for paths in (at_ingest, at_dedupe):
        dedupe_documents(paths, CONFIG)
    # dedupe used the caches as they were, and they hold the same bytes as those it makes from the Parquet text
    assert {name: (at_ingest.dedupe / MINHASH_DIR / name).stat().st_mtime_ns for name in caches} == stamps
    for name in [*(f"{MINHASH_DIR}/{cache}" for cache in caches), DUPLICATES_FILE, CLUSTERS_FILE]:
        assert (at_ingest.dedupe / name).read_bytes() == (at_dedupe.dedupe / name).read_bytes(), name

    # Other MinHash settings than ingest used: the cache does not match, and dedupe makes its own.
    other = CONFIG.model_copy(update={"near": NearDedupeConfig(threshold=0.7, num_perm=64)})
    at_ingest.dedupe.joinpath("state.json").unlink()
    dedupe_documents(at_ingest, other)
    signatures = pq.read_table(at_ingest.dedupe / MINHASH_DIR / caches[0]).column("signature")
    assert signatures.type.list_size == 64

    # A part ingested again (its marker lost) drops the caches of its earlier documents, with or without near.
    marker = part_marker(at_ingest, 0)
    marker.unlink()
    ingest_part(parts[0], 0.1, at_ingest)
    assert not (at_ingest.dedupe / MINHASH_DIR / caches[0]).exists()
    assert not (at_ingest.dedupe / BANDS_DIR / caches[0]).exists()


def test_config_switches_exact_and_near(planted: tuple[Path, list[Path]], tmp_path: Path) -> None:
    manifest, _ = planted
    paths = RunPaths(tmp_path / "run")
    ingest_all(manifest, paths)
    dedupe_documents(paths, DedupeConfig(near=NearDedupeConfig(enabled=False)))  # exact only
    assert {uri: row["kind"] for uri, row in duplicates_by_uri(paths).items()} == {
        "zz_copy.py": "exact", "zz_whitespace.py": "exact"}
    other = RunPaths(tmp_path / "run_near_only")
    ingest_all(manifest, other)
    dedupe_documents(other, CONFIG.model_copy(update={"exact": False}))
    found = duplicates_by_uri(other)
    assert {uri: row["kind"] for uri, row in found.items()} == dict.fromkeys(
        ["zz_copy.py", "zz_whitespace.py", "zz_near1.py", "zz_near2.py"], "near")
    assert found["zz_copy.py"]["similarity"] == 1.0


def test_refresh_keeps_earlier_survivors_and_removes_new_copies(planted: tuple[Path, list[Path]],
                                                                tmp_path: Path) -> None:
    manifest, originals = planted
    paths = RunPaths(tmp_path / "run")
    ingest_all(manifest, paths)
    dedupe_documents(paths, CONFIG)
    kept_before = {row["doc_id"] for batch in iter_documents(paths, columns=["doc_id"]) for row in batch.to_pylist()}
    cache = paths.dedupe / MINHASH_DIR / "part-00000.parquet"
    cache_stamp = cache.stat().st_mtime_ns
    folder = manifest.parent / "corpus"
    shutil.copy(originals[2], folder / "zzz_renamed_again.py")
    (folder / "zzz_near_again.py").write_text(edit_words(originals[3].read_text(), 80), encoding="utf-8")
    new_parts = plan_ingest([manifest], paths, PART_BYTES)
    assert sorted(f for part in new_parts for f in part.files) == ["zzz_near_again.py", "zzz_renamed_again.py"]
    for part in new_parts:
        ingest_part(part, 0.1, paths)
    summary = dedupe_documents(paths, CONFIG)
    duplicates = duplicates_by_uri(paths)
    ids = doc_ids_by_uri(paths)
    assert kept_before.isdisjoint(row["doc_id"] for row in duplicates.values())
    assert duplicates["zzz_renamed_again.py"]["duplicate_of"] == ids[originals[2].name]
    assert duplicates["zzz_near_again.py"]["duplicate_of"] == ids[originals[3].name]
    assert summary["num_kept"] == len(kept_before)
    assert cache.stat().st_mtime_ns == cache_stamp  # only the new part was hashed


def test_documents_kept_earlier_are_never_removed_by_chained_clusters(tmp_path: Path) -> None:
    # Unigram sets: J(A,B) = 70/130 = 0.54 (not duplicates), J(A,C) = J(B,C) = 85/115 = 0.74 (duplicates).
    folder = tmp_path / "corpus"
    folder.mkdir()
    words = [f"w{chr(97 + i // 26)}{chr(97 + i % 26)}" for i in range(130)]  # no digits: all read as 0
    (folder / "a.txt").write_text(" ".join(words[0:100]), encoding="utf-8")
    (folder / "b.txt").write_text(" ".join(words[30:130]), encoding="utf-8")
    manifest = write_manifest(tmp_path)
    config = DedupeConfig(near=NearDedupeConfig(threshold=0.65, ngram=1, num_perm=256))
    incremental = RunPaths(tmp_path / "incremental")
    ingest_all(manifest, incremental)
    assert dedupe_documents(incremental, config)["num_kept"] == 2
    (folder / "c.txt").write_text(" ".join(words[15:115]), encoding="utf-8")
    ingest_all(manifest, incremental)
    dedupe_documents(incremental, config)
    assert set(duplicates_by_uri(incremental)) == {"c.txt"}
    at_once = RunPaths(tmp_path / "at_once")  # without history, the chain A-C-B is one cluster
    ingest_all(manifest, at_once)
    dedupe_documents(at_once, config)
    assert set(duplicates_by_uri(at_once)) == {"b.txt", "c.txt"}


@pytest.mark.parametrize("implementation", [minhash.IMPLEMENTATION, minhash.NUMPY_IMPLEMENTATION])
def test_minhash_estimates_true_shingle_jaccard(implementation: str) -> None:
    text = (STDLIB / "argparse.py").read_text(encoding="utf-8")
    variants = [text, edit_words(text, 100), edit_words(text, 30), edit_words(text, 10), "short text", "short text"]
    sigs = minhash.signatures(pa.array(variants), 128, 5, implementation=implementation)
    assert sigs.shape == (6, 128) and sigs.dtype == np.uint32
    for other in (1, 2, 3):
        estimate = minhash.estimated_jaccard(sigs, np.array([0]), np.array([other]))[0]
        true = shingle_jaccard(text, variants[other])
        # The estimate is a mean of 128 Bernoulli(J) draws: within 4 standard errors (~0.17 at J=0.33) unless
        # the hashing is biased (over 300 stdlib files at J~0.3: mean error +0.1 and sd 0.92 standard errors).
        assert abs(estimate - true) < 4 * np.sqrt(true * (1 - true) / 128)
    assert minhash.estimated_jaccard(sigs, np.array([4]), np.array([5]))[0] == 1.0
    assert minhash.estimated_jaccard(sigs, np.array([0]), np.array([4]))[0] < 0.1


def test_lsh_params_make_an_s_curve_around_the_threshold() -> None:
    bands, rows = minhash.lsh_params(0.8, 128)
    assert bands * rows <= 128

    def candidate(similarity: float) -> float:
        return 1 - (1 - similarity**rows) ** bands

    assert candidate(0.8) > 0.95 and candidate(0.3) < 0.01


def test_candidate_pairs_and_components() -> None:
    keys = np.array([[5], [7], [5], [5], [9], [7]], dtype=np.uint64)
    left, right = minhash.candidate_pairs(keys)
    assert sorted(zip(left.tolist(), right.tolist(), strict=True)) == [(0, 2), (0, 3), (1, 5), (2, 3)]
    huge = np.zeros((10_000, 1), dtype=np.uint64)
    left, _ = minhash.candidate_pairs(huge)
    assert len(left) < 10_000 * (minhash.CANDIDATE_WINDOW + 1)  # linear, not quadratic
    labels = minhash.connected_components(7, np.array([5, 1, 3]), np.array([6, 3, 6]))
    assert labels.tolist() == [0, 1, 2, 1, 4, 1, 1]


@pytest.mark.slow
def test_whole_stdlib_ingests_and_dedupes(tmp_path: Path) -> None:
    manifest = tmp_path / "stdlib.yaml"
    manifest.write_text(yaml.safe_dump({"name": "stdlib", "sources": [{
        "name": "stdlib", "path": "${PYTHON_STDLIB}", "format": "text", "glob": "**/*.py",
        "exclude": ["site-packages", "**/__pycache__"]}]}), encoding="utf-8")
    paths = RunPaths(tmp_path / "run")
    for part in plan_ingest([manifest], paths, 8 << 20):
        ingest_part(part, 0.05, paths)
    summary = dedupe_documents(paths, CONFIG)
    assert summary["num_documents_in"] > 1000
    assert summary["num_exact_duplicates"] > 0 and summary["num_near_duplicates"] > 0


def test_empty_run_writes_empty_outputs(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    assert dedupe_documents(paths, DedupeConfig()) == {
        "num_documents_in": 0, "num_exact_duplicates": 0, "num_near_duplicates": 0, "num_kept": 0}
    assert pq.read_table(paths.dedupe / DUPLICATES_FILE).schema.equals(DUPLICATES_SCHEMA)


def test_duckdb_band_grouping_gives_the_in_memory_candidate_pairs(planted: tuple[Path, list[Path]],
                                                                   tmp_path: Path) -> None:
    manifest, _ = planted
    paths = RunPaths(tmp_path / "run")
    ingest_all(manifest, paths)
    config = DedupeConfig(near=NearDedupeConfig(threshold=0.3, ngram=1))  # unigrams: many shared buckets
    dedupe_documents(paths, config)
    band_files = sorted((paths.dedupe / BANDS_DIR).glob("part-*.parquet"))
    assert len(band_files) == len(list(paths.docs.glob("part-*.parquet"))) > 1
    parts = [pq.read_table(p, columns=["text"]).column("text") for p in sorted(paths.docs.glob("part-*.parquet"))]
    offsets = np.cumsum([0] + [len(p) for p in parts[:-1]]).tolist()
    signatures = minhash.signatures(pa.chunked_array([c for p in parts for c in p.chunks]), 128, 1)
    bands, rows = minhash.lsh_params(0.3, 128)
    keys = minhash.band_keys(signatures, bands, rows)
    in_memory = minhash.candidate_pairs(keys)
    grouped = minhash.grouped_candidate_pairs(band_files, offsets, np.empty(0, dtype=np.int64), tmp_path)
    assert len(in_memory[0]) > 50
    assert [a.tolist() for a in grouped] == [a.tolist() for a in in_memory]
    excluded = np.unique(in_memory[0][::7])
    members = np.setdiff1d(np.arange(len(signatures)), excluded)
    expected = minhash.candidate_pairs(keys[members])
    grouped = minhash.grouped_candidate_pairs(band_files, offsets, excluded, tmp_path)
    assert [a.tolist() for a in grouped] == [members[a].tolist() for a in expected]


def test_exact_verification_records_the_true_jaccard(planted: tuple[Path, list[Path]], tmp_path: Path) -> None:
    manifest, originals = planted
    paths = RunPaths(tmp_path / "run")
    ingest_all(manifest, paths)
    dedupe_documents(paths, CONFIG.model_copy(update={"near": CONFIG.near.model_copy(
        update={"exact_verify_margin": 1.0})}))  # every candidate decided by exact Jaccard
    duplicates = duplicates_by_uri(paths)
    texts = {row["uri"]: row["text"] for part in sorted(paths.docs.glob("*.parquet"))
             for row in pq.read_table(part).to_pylist()}
    for name, original in [("zz_near1.py", originals[2]), ("zz_near2.py", originals[3])]:
        assert duplicates[name]["similarity"] == pytest.approx(shingle_jaccard(texts[original.name], texts[name]))


def test_read_rows_reads_only_the_row_groups_it_needs(tmp_path: Path) -> None:
    path = tmp_path / "groups.parquet"
    texts = [f"text {i}" for i in range(10)]
    pq.write_table(pa.table({"text": pa.array(texts, pa.large_string())}), path, row_group_size=3)
    assert pq.ParquetFile(path).num_row_groups == 4
    rows = np.array([0, 4, 5, 9])
    assert near_dedupe.read_rows(path, rows, "text").to_pylist() == [texts[i] for i in rows]
    assert near_dedupe.read_rows(path, np.empty(0, dtype=np.int64), "text").to_pylist() == []


def test_dedupe_reads_a_parts_signatures_one_block_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Band keys are made one signature row group at a time, and a candidate's signature comes from the one
    row group that holds it: the stage never holds a whole part's signatures (0.5 KB a document)."""
    from pipeline.dedupe.stage import finished_parts
    from pipeline.ingest import part_files
    from tests.pipeline.test_ingest import write_manifest as write_sources
    from tests.pipeline.test_ingest import write_short_docs

    config = DedupeConfig(near=NearDedupeConfig(num_perm=16, threshold=0.7))
    monkeypatch.setattr(part_files, "ROW_GROUP_ROWS", 300)
    monkeypatch.setattr(near_dedupe, "SIGNATURE_BLOCK_BYTES", 200 * 4 * 16)
    write_short_docs(tmp_path / "big.jsonl", 2_000)
    manifest = write_sources(tmp_path / "m.yaml", [{"name": "s", "path": "big.jsonl", "format": "jsonl"}])
    paths = RunPaths(tmp_path / "run")
    (part,) = plan_ingest([manifest], paths, 1024)
    ingest_part(part, 0.0, paths, near=config.near)
    (docs_part,) = finished_parts(paths)
    texts = pq.read_table(docs_part.path, columns=["text"]).column("text")
    expected = minhash.signatures(texts, 16, config.near.ngram)

    blocks: list[int] = []
    signature_block = near_dedupe._signature_block
    monkeypatch.setattr(near_dedupe, "_signature_block",
                        lambda table, num_perm: blocks.append(table.num_rows) or signature_block(table, num_perm))
    bands, rows = minhash.lsh_params(0.7, 16)
    band_file = near_dedupe.part_band_keys(docs_part, paths, config, bands, rows)
    assert max(blocks) == 200 and sum(blocks) == 2_000
    stored = pq.read_table(band_file).sort_by([("band", "ascending"), ("row", "ascending")])
    assert stored.column("key").to_numpy().tolist() == minhash.band_keys(expected, bands, rows).T.reshape(-1).tolist()

    blocks.clear()
    wanted = np.array([3, 250, 1_999])
    assert (near_dedupe.part_signature_rows(docs_part, paths, config, wanted) == expected[wanted]).all()
    assert blocks == [200, 200, 200]  # the row groups of rows 3, 250 and 1999 only, not all ten


def test_changing_the_words_changes_the_dedupe_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run deduped on other words (an older WORDS_VERSION) is deduped again, not skipped."""
    from pipeline.dedupe.stage import dedupe_fingerprint

    parts = [near_dedupe.DocsPart(0, Path("part-00000.parquet"), "abc")]
    now = dedupe_fingerprint(parts, DedupeConfig())
    monkeypatch.setattr(minhash, "WORDS_VERSION", "ascii-words-fnv1a-2")
    assert dedupe_fingerprint(parts, DedupeConfig()) != now
    assert near_dedupe.signature_cache_metadata("abc", NearDedupeConfig())["words"] == "ascii-words-fnv1a-2"
