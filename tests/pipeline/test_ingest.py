"""pipeline/ingest/stage.py on a slice of the real standard library plus planted broken files."""

from __future__ import annotations

import json
import shutil
import sysconfig
import warnings
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
import zstandard

from core.documents import doc_id_for
from core.errors import ManifestError, SourceReadError
from core.rundir import RunPaths
from core.schemas import DOCUMENTS_SCHEMA, REJECTS_SCHEMA
from pipeline.filters.screen import content_hash
from pipeline.ingest.stage import (
    IngestPart,
    SourceFile,
    glob_regex,
    group_files,
    ingest_part,
    largest_first,
    part_marker,
    plan_ingest,
)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
PART_BYTES = 64 * 1024


def copy_stdlib_sample(folder: Path, count: int = 30) -> list[Path]:
    """Top-level stdlib modules of 2-40 KB: distinct, real source files."""
    folder.mkdir(parents=True, exist_ok=True)
    chosen = [p for p in sorted(STDLIB.glob("*.py")) if 2_000 < p.stat().st_size < 40_000][:count]
    return [Path(shutil.copy(p, folder / p.name)) for p in chosen]


def write_manifest(path: Path, sources: list[dict], **extra: object) -> Path:
    path.write_text(yaml.safe_dump({"name": "corpus", "sources": sources, **extra}), encoding="utf-8")
    return path


def ingest_all(manifests: list[Path], paths: RunPaths, part_bytes: int = PART_BYTES) -> list[dict]:
    return [ingest_part(part, 0.1, paths) for part in plan_ingest(manifests, paths, part_bytes)]


def read_parts(folder: Path) -> list[dict]:
    return [row for part in sorted(folder.glob("part-*.parquet")) for row in pq.read_table(part).to_pylist()]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A folder of real stdlib files plus broken ones, and a manifest reading it as text."""
    folder = tmp_path / "corpus"
    copy_stdlib_sample(folder / "lib")
    (folder / "broken").mkdir()
    (folder / "broken" / "latin1.py").write_bytes("# caf\u00e9\nx = 1\n".encode("latin-1"))
    (folder / "broken" / "nul.py").write_bytes(b"\x00\x01\x02" * 400 + b"tail")
    (folder / "broken" / "blank.py").write_text("   \n\t\n  ", encoding="utf-8")
    return write_manifest(tmp_path / "corpus.yaml", [{"name": "lib", "path": "corpus", "format": "text"}])


def test_every_file_becomes_exactly_one_document_or_reject(corpus: Path, tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    summaries = ingest_all([corpus], paths)
    assert len(summaries) > 3  # 64 KB parts over ~500 KB of source
    docs, rejects = read_parts(paths.docs), read_parts(paths.rejects)
    files = sorted(p.relative_to(corpus.parent / "corpus").as_posix()
                   for p in (corpus.parent / "corpus").rglob("*") if p.is_file())
    assert sorted([d["uri"] for d in docs] + [r["uri"] for r in rejects]) == files
    assert sum(s["num_documents"] for s in summaries) == len(docs)
    assert sum(s["num_records"] for s in summaries) == len(files)
    assert {r["uri"]: r["reason"] for r in rejects} == {
        "broken/latin1.py": "invalid_utf8", "broken/nul.py": "binary", "broken/blank.py": "empty"}
    for reject in rejects:
        assert reject["raw"] == (corpus.parent / "corpus" / reject["uri"]).read_bytes() and reject["detail"]
    for doc in docs:
        assert doc["doc_id"] == doc_id_for("lib", doc["uri"]) and doc["source"] == "lib"
        assert doc["content_hash"] == content_hash(doc["text"]) and doc["num_chars"] == len(doc["text"])
        assert doc["split"] in {"train", "val"} and not doc["text"].endswith("\n")
    assert pq.read_schema(next(paths.docs.glob("part-*.parquet"))).equals(DOCUMENTS_SCHEMA, check_metadata=True)
    assert pq.read_schema(next(paths.rejects.glob("part-*.parquet"))).equals(REJECTS_SCHEMA)
    text_chunk = pq.ParquetFile(next(paths.docs.glob("part-*.parquet"))).metadata.row_group(0).column(4)
    assert text_chunk.path_in_schema == "text" and "RLE_DICTIONARY" not in text_chunk.encodings  # read ~25% faster


def test_progress_callback_counts_every_record_and_byte_of_the_part(corpus: Path, tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    [part] = plan_ingest([corpus], paths, 1 << 30)
    read: list[tuple[int, int]] = []
    summary = ingest_part(part, 0.1, paths, on_progress=lambda records, num_bytes: read.append((records, num_bytes)))
    assert len(read) > 1 and sum(records for records, _ in read) == summary["num_records"] > 0
    assert sum(num_bytes for _, num_bytes in read) == summary["num_bytes"] == part.num_bytes


def test_rerun_skips_done_parts_and_fresh_run_is_byte_identical(corpus: Path, tmp_path: Path) -> None:
    first, second = RunPaths(tmp_path / "run1"), RunPaths(tmp_path / "run2")
    summaries = ingest_all([corpus], first)
    outputs = sorted(p.relative_to(first.root) for p in first.root.rglob("part-*"))
    stamps = {p: (first.root / p).stat().st_mtime_ns for p in outputs}
    plan = json.loads((first.docs / "plan.json").read_text())
    parts = [IngestPart(p["part_id"], p["source"], str(corpus), tuple(p["files"])) for p in plan["parts"]]
    assert [ingest_part(part, 0.1, first) for part in parts] == [{**done, "skipped": True} for done in summaries]
    assert {p: (first.root / p).stat().st_mtime_ns for p in outputs} == stamps
    ingest_all([corpus], second)
    for relative in outputs:
        assert (first.root / relative).read_bytes() == (second.root / relative).read_bytes(), relative
    assert str(tmp_path) not in "".join(p.read_bytes().decode("latin-1") for p in first.root.rglob("*") if p.is_file())


def test_killed_run_replans_the_same_unfinished_parts(corpus: Path, tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    planned = plan_ingest([corpus], paths, PART_BYTES)
    ingest_part(planned[0], 0.1, paths)
    ingest_part(planned[2], 0.1, paths)
    again = plan_ingest([corpus], paths, PART_BYTES)
    assert again == [planned[1], *planned[3:]]
    assert [IngestPart.from_dict(json.loads(json.dumps(p.to_dict()))) for p in again] == again


def test_refresh_plans_only_new_files_into_new_parts(corpus: Path, tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    first = ingest_all([corpus], paths)
    folder = corpus.parent / "corpus"
    shutil.copy(folder / "lib" / "bisect.py", folder / "lib" / "renamed_bisect.py")
    copy_stdlib_sample(folder / "more", count=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing old changed: no warning
        new_parts = plan_ingest([corpus], paths, PART_BYTES)
    new_files = sorted(f for part in new_parts for f in part.files)
    assert new_files == sorted(["lib/renamed_bisect.py", *[f"more/{p.name}" for p in (folder / "more").iterdir()]])
    assert min(part.part_id for part in new_parts) == len(first)
    for part in new_parts:
        ingest_part(part, 0.1, paths)
    assert plan_ingest([corpus], paths, PART_BYTES) == []


def test_changed_ingested_file_warns_and_is_not_reread(corpus: Path, tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    ingest_all([corpus], paths)
    (corpus.parent / "corpus" / "lib" / "bisect.py").write_text("# rewritten\n", encoding="utf-8")
    with pytest.warns(UserWarning, match="lib/bisect.py changed after it was ingested"):
        assert plan_ingest([corpus], paths, PART_BYTES) == []


def test_exclude_globs_single_file_sources_and_duplicate_names(tmp_path: Path) -> None:
    copy_stdlib_sample(tmp_path / "data" / "keep", count=4)
    copy_stdlib_sample(tmp_path / "data" / "skipdir", count=2)
    (tmp_path / "data" / "keep" / "notes.txt").write_text("not python", encoding="utf-8")
    one = write_manifest(tmp_path / "one.yaml", [
        {"name": "folder", "path": "data", "format": "text", "glob": "**/*.py", "exclude": ["skipdir"]},
        {"name": "single", "path": "data/keep/notes.txt", "format": "text"},
    ])
    paths = RunPaths(tmp_path / "run")
    parts = plan_ingest([one], paths, 1 << 30)
    by_source = {part.source: part.files for part in parts}
    assert by_source["single"] == ("notes.txt",)
    assert all(f.startswith("keep/") and f.endswith(".py") for f in by_source["folder"])
    assert len(by_source["folder"]) == 4
    assert read_parts(paths.docs) == [] and ingest_part(parts[-1], 0.0, paths)["num_documents"] == 1
    two = write_manifest(tmp_path / "two.yaml", [{"name": "single", "path": "data", "format": "text"}])
    with pytest.raises(ManifestError, match=r"source 'single' is also defined in .*one\.yaml"):
        plan_ingest([one, two], paths, PART_BYTES)


def test_group_files_keeps_big_files_alone() -> None:
    files = [SourceFile(name, size, 0) for name, size in [("a", 40), ("b", 40), ("big", 500), ("c", 10), ("d", 90)]]
    groups = [[f.rel for f in group] for group in group_files(files, 100)]
    assert groups == [["a", "b"], ["big"], ["c", "d"]]


def test_on_error_fail_stops_the_part_and_skip_records_the_file(tmp_path: Path) -> None:
    data = tmp_path / "jsonl"
    data.mkdir()
    lines = [json.dumps({"id": i, "text": f"record {i} " * 5}) for i in range(50)] + [json.dumps({"text": "tiny"})]
    (data / "good.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (data / "good.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress("\n".join(lines).encode()))
    (data / "garbage.jsonl.zst").write_bytes(b"\x00garbage" * 100)
    spec = {"name": "j", "path": "jsonl", "format": "jsonl", "id_field": "id"}
    failing = write_manifest(tmp_path / "fail.yaml", [spec], filters={"min_chars": 10})
    paths = RunPaths(tmp_path / "run_fail")
    (part,) = plan_ingest([failing], paths, 1 << 30)
    with pytest.raises(SourceReadError, match=r"garbage\.jsonl\.zst"):
        ingest_part(part, 0.1, paths)
    assert not part_marker(paths, part.part_id).exists() and not list(paths.docs.glob("part-*.parquet"))
    skipping = write_manifest(tmp_path / "skip.yaml", [{**spec, "on_error": "skip"}], filters={"min_chars": 10})
    paths = RunPaths(tmp_path / "run_skip")
    (part,) = plan_ingest([skipping], paths, 1 << 30)
    summary = ingest_part(part, 0.1, paths)
    assert summary["num_documents"] == 100 and summary["num_records"] == 103
    assert summary["rejects_by_reason"] == {"too_short": 2, "unreadable_file": 1}
    rejects = {r["uri"]: r for r in read_parts(paths.rejects)}
    assert rejects["good.jsonl:51"]["raw"] == lines[-1].encode() and rejects["good.jsonl:51"]["reason"] == "too_short"
    assert rejects["garbage.jsonl.zst"]["raw"] == (data / "garbage.jsonl.zst").read_bytes()
    assert {d["source_id"] for d in read_parts(paths.docs)} == {str(i) for i in range(50)}


def test_parquet_and_hf_disk_sources_ingest_with_row_uris(tmp_path: Path) -> None:
    (tmp_path / "tables").mkdir()
    pq.write_table(pa.table({"text": ["alpha text", None], "key": [10, 11]}), tmp_path / "tables" / "t.parquet")
    datasets.Dataset.from_dict({"text": ["beta text"]}).save_to_disk(tmp_path / "saved")
    manifest = write_manifest(tmp_path / "m.yaml", [
        {"name": "pq", "path": "tables", "format": "parquet", "id_field": "key"},
        {"name": "hf", "path": "saved", "format": "hf_disk"},
    ])
    paths = RunPaths(tmp_path / "run")
    summaries = ingest_all([manifest], paths)
    assert sorted((s["source"], s["num_documents"], s["num_rejects"]) for s in summaries) == [
        ("hf", 1, 0), ("pq", 1, 1)]
    assert sorted((d["source"], d["uri"], d["source_id"]) for d in read_parts(paths.docs)) == [
        ("hf", "saved#row=0", None), ("pq", "t.parquet#row=0", "10")]
    assert [(r["uri"], r["reason"], r["source_id"]) for r in read_parts(paths.rejects)] == [
        ("t.parquet#row=1", "missing_text", "11")]


@pytest.mark.parametrize(
    ("pattern", "matching", "not_matching"),
    [
        ("**/*.py", ["a.py", "x/y/a.py"], ["a.pyc", "a.py/b"]),
        ("site-packages", ["site-packages"], ["x/site-packages"]),
        ("**/__pycache__", ["__pycache__", "a/b/__pycache__"], ["a/__pycache__x"]),
        ("test/**", ["test", "test/a/b.py"], ["tests/a"]),
        ("docs/**/*.md", ["docs/a.md", "docs/x/y/a.md"], ["a.md", "docsa.md"]),
        ("x[!0-9]?.json[l]", ["xab.jsonl"], ["x1b.jsonl", "xab.json", "x/b.jsonl"]),
    ],
)
def test_glob_regex_follows_pathlib_glob_rules(pattern: str, matching: list[str], not_matching: list[str]) -> None:
    regex = glob_regex(pattern)
    assert all(regex.fullmatch(path) for path in matching)
    assert not any(regex.fullmatch(path) for path in not_matching)


def test_hf_local_source_and_hub_names_refused(tmp_path: Path) -> None:
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "a.json").write_text(json.dumps([{"text": "a json array record"}]), encoding="utf-8")
    pq.write_table(pa.table({"text": ["a parquet row"]}), tmp_path / "local" / "b.parquet")
    manifest = write_manifest(tmp_path / "m.yaml", [{"name": "hf", "path": "local", "format": "hf_local"}])
    paths = RunPaths(tmp_path / "run")
    ingest_all([manifest], paths)
    assert sorted((d["uri"], d["text"]) for d in read_parts(paths.docs)) == [
        ("a.json#row=0", "a json array record"), ("b.parquet#row=0", "a parquet row")]
    for fmt in ("hf_local", "hf_disk"):
        hub = write_manifest(tmp_path / "hub.yaml", [{"name": "hub", "path": "allenai/c4", "format": fmt}])
        with pytest.raises(ManifestError) as caught:
            plan_ingest([hub], RunPaths(tmp_path / "hub_run"), PART_BYTES)
        message = str(caught.value)
        assert "\n" not in message and "'allenai/c4' is not an existing local path" in message
        assert "save_to_disk" in message


BASE64_LINE = "QmluYXJ5IGRhdGEgZW5jb2RlZCBhcyBiYXNlNjQgbG9va3MgbGlrZSBvbmUgbG9uZyB3b3Jk"


def test_quality_filters_and_pii_redaction_from_the_manifest(tmp_path: Path) -> None:
    lines = [
        {"id": "mail1", "text": "Please write to ann@example.org about the build on host 10.0.0.12 today."},
        {"id": "mail2", "text": "Please write to bob@corp.example.com about the build on host 10.0.0.77 today."},
        {"id": "v6", "text": "The resolver listens on 2001:db8::8a2e:370:7334 and nowhere else at all."},
        {"id": "blob", "text": "\n".join([BASE64_LINE] * 9)},
        {"id": "art", "text": "+-----+-----+\n|  a  |  b  |\n+-----+-----+\n|  1  |  2  |\n+-----+-----+"},
        {"id": "spam", "text": "\n".join(["Click here for a free prize!"] * 20)},
    ]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")
    spec = {"name": "web", "path": "data.jsonl", "format": "jsonl", "id_field": "id"}
    redacting = write_manifest(tmp_path / "m.yaml", [spec], filters={"redact_pii": True})
    paths = RunPaths(tmp_path / "run")
    (summary,) = ingest_all([redacting], paths)
    assert summary["rejects_by_reason"] == {"duplicate_lines": 1, "mean_word_length": 1, "symbol_ratio": 1}
    assert summary["redactions_by_kind"] == {"email": 2, "ip": 3}
    docs = {d["source_id"]: d for d in read_parts(paths.docs)}
    assert docs["mail1"]["text"] == "Please write to <EMAIL> about the build on host <IP> today."
    assert docs["mail1"]["content_hash"] == docs["mail2"]["content_hash"]  # redacted before hashing
    assert docs["v6"]["text"] == "The resolver listens on <IP> and nowhere else at all."
    rejects = {r["source_id"]: r for r in read_parts(paths.rejects)}
    assert rejects["blob"]["raw"] == (json.dumps(lines[3]).encode())  # the original line, not redacted
    plain = write_manifest(tmp_path / "plain.yaml", [spec])
    (summary,) = ingest_all([plain], RunPaths(tmp_path / "plain_run"))
    assert summary["redactions_by_kind"] == {} and summary["num_documents"] == 3


def write_short_docs(path: Path, count: int) -> None:
    """``count`` distinct short jsonl documents (~70 characters each)."""
    lines = [json.dumps({"text": " ".join(f"w{(i * 7919 + k * 104729) % 5003}" for k in range(12))})
             for i in range(count)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def spy_parquet_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """``(first column, rows)`` of every table a ParquetWriter writes (``pq.write_table`` included), in order; a
    documents table is named ``documents`` (attributes also start with ``doc_id``)."""
    writes: list[tuple[str, int]] = []
    write_table = pq.ParquetWriter.write_table

    def spy(self: pq.ParquetWriter, table: pa.Table, *args: object, **kwargs: object) -> None:
        writes.append(("documents" if "content_hash" in table.column_names else table.column_names[0], table.num_rows))
        write_table(self, table, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetWriter, "write_table", spy)
    return writes


def test_near_signatures_go_to_disk_in_bounded_blocks_while_a_big_file_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file bigger than a part is a part of its own: held until the part ends, its signatures (512 bytes a
    document at 128 permutations, several times short documents' text) made memory grow with the file."""
    from pipeline.config import NearDedupeConfig
    from pipeline.dedupe import minhash, near_dedupe
    from pipeline.ingest import part_files

    near = NearDedupeConfig(num_perm=16)
    monkeypatch.setattr(part_files, "ROW_GROUP_ROWS", 300)
    monkeypatch.setattr(near_dedupe, "SIGNATURE_BLOCK_BYTES", 200 * 4 * near.num_perm, raising=False)
    write_short_docs(tmp_path / "big.jsonl", 2_000)
    manifest = write_manifest(tmp_path / "m.yaml", [{"name": "s", "path": "big.jsonl", "format": "jsonl"}])
    paths = RunPaths(tmp_path / "run")
    (part,) = plan_ingest([manifest], paths, 1024)
    writes = spy_parquet_writes(monkeypatch)
    assert ingest_part(part, 0.0, paths, near=near)["num_documents"] == 2_000
    blocks = [rows for column, rows in writes if column == "signature"]
    assert max(blocks) <= 200 and sum(blocks) == 2_000
    docs_writes = [index for index, (column, _) in enumerate(writes) if column == "documents"]
    assert len(docs_writes) == 7 and writes.index(("signature", blocks[0])) < docs_writes[-1]
    # The cache's format is unchanged: what dedupe reads back is what it computes from the documents' text.
    cache = paths.dedupe / near_dedupe.MINHASH_DIR / "part-00000.parquet"
    texts = pq.read_table(paths.docs / "part-00000.parquet", columns=["text"]).column("text")
    stored = pq.read_table(cache).column("signature").combine_chunks()
    assert stored.type.list_size == near.num_perm
    expected = minhash.signatures(texts, near.num_perm, near.ngram)
    assert (stored.values.to_numpy().reshape(-1, near.num_perm) == expected).all()
    assert [path.name for path in cache.parent.iterdir()] == [cache.name]


def test_a_failed_part_leaves_no_partial_signature_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.config import NearDedupeConfig
    from pipeline.dedupe import near_dedupe
    from pipeline.ingest import part_files

    near = NearDedupeConfig(num_perm=16)
    monkeypatch.setattr(part_files, "ROW_GROUP_ROWS", 300)
    monkeypatch.setattr(near_dedupe, "SIGNATURE_BLOCK_BYTES", 200 * 4 * near.num_perm, raising=False)
    data = tmp_path / "data"
    data.mkdir()
    write_short_docs(data / "a.jsonl", 1_000)
    (data / "b.jsonl.zst").write_bytes(b"\x00garbage" * 100)
    spec = {"name": "s", "path": "data", "format": "jsonl", "on_error": "fail"}
    paths = RunPaths(tmp_path / "run")
    (part,) = plan_ingest([write_manifest(tmp_path / "m.yaml", [spec])], paths, 1 << 30)
    writes = spy_parquet_writes(monkeypatch)
    with pytest.raises(SourceReadError, match=r"b\.jsonl\.zst"):
        ingest_part(part, 0.0, paths, near=near)
    assert ("signature", 200) in writes  # blocks were written before the failure
    assert not list((paths.dedupe / near_dedupe.MINHASH_DIR).iterdir())
    assert not part_marker(paths, part.part_id).exists()


def test_each_split_lands_in_row_groups_of_its_own_in_record_order(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """So the pack of one split skips the other's row groups undecompressed (core.documents.iter_documents)."""
    from pipeline.ingest import part_files

    monkeypatch.setattr(part_files, "ROW_GROUP_ROWS", 300)
    write_short_docs(tmp_path / "docs.jsonl", 2_000)
    manifest = write_manifest(tmp_path / "m.yaml", [{"name": "s", "path": "docs.jsonl", "format": "jsonl"}])
    paths = RunPaths(tmp_path / "run")
    (part,) = plan_ingest([manifest], paths, 1 << 30)
    ingest_part(part, 0.3, paths)
    parquet = pq.ParquetFile(paths.docs / "part-00000.parquet")
    groups = [parquet.read_row_group(group, columns=["uri", "split"]).to_pylist()
              for group in range(parquet.num_row_groups)]
    assert all(len({row["split"] for row in group}) == 1 and len(group) <= 300 for group in groups)
    rows = [row for group in groups for row in group]
    lines = [f"docs.jsonl:{number}" for number in range(1, 2_001)]
    for split in ("train", "val"):
        uris = [row["uri"] for row in rows if row["split"] == split]
        assert len(uris) > 300 and uris == [uri for uri in lines if uri in set(uris)]  # record order kept
    assert sorted(row["uri"] for row in rows) == sorted(lines)


def test_parts_come_largest_first_by_decompressed_bytes(tmp_path: Path) -> None:
    """A part of one small ``.gz`` file holding the most text starts first, so two workers finish together."""
    import gzip

    data = tmp_path / "data"
    data.mkdir()
    write_short_docs(data / "a.jsonl", 300)
    write_short_docs(data / "b.jsonl", 600)
    with gzip.open(data / "c.jsonl.gz", "wt", encoding="utf-8") as out:
        out.write("\n".join(json.dumps({"text": "same words again " * 20}) for _ in range(3_000)) + "\n")
    assert (data / "c.jsonl.gz").stat().st_size < (data / "a.jsonl").stat().st_size
    manifest = write_manifest(tmp_path / "m.yaml", [{"name": "s", "path": "data", "format": "jsonl"}])
    parts = largest_first(plan_ingest([manifest], RunPaths(tmp_path / "run"), 1))
    assert [(part.part_id, part.files) for part in parts] == [(2, ("c.jsonl.gz",)), (1, ("b.jsonl",)),
                                                              (0, ("a.jsonl",))]


# ---- a source that matches no file is an error, not a silent absence (issue #34, class 4) --------


def two_sources(tmp_path: Path, **records: object) -> Path:
    """A folder of stdlib files and a folder of one jsonl file; ``records`` overrides the second source."""
    copy_stdlib_sample(tmp_path / "data" / "code", count=3)
    (tmp_path / "data" / "records").mkdir(parents=True)
    (tmp_path / "data" / "records" / "a.jsonl").write_text('{"text": "a record that is long enough"}\n')
    (tmp_path / "data" / "records" / "README").write_text("what the records are")
    return write_manifest(tmp_path / "m.yaml", [
        {"name": "code", "path": "data/code", "format": "text", "glob": "*.py"},
        {"name": "records", "path": "data/records", "format": "jsonl", "glob": "*.jsonl", **records}])


UNMATCHED = {
    "glob-typo": ({"glob": "*.jsnol"}, ["glob '*.jsnol' under", "the files there end in no extension (1), .jsonl (1)",
                                        "did you mean glob '*.jsonl'?"]),
    "exclude-everything": ({"exclude": ["*.jsonl"]}, ["glob '*.jsonl' minus exclude ['*.jsonl'] under"]),
    "excluded-folder": ({"glob": "**/*.jsonl", "exclude": ["**"]}, ["minus exclude ['**']"]),
    "empty-hf-dataset-folder": ({"format": "hf_disk", "path": "data/empty"}, ["there is no file there at all"]),
}


@pytest.mark.parametrize("case", list(UNMATCHED))
def test_a_source_that_matches_no_file_is_one_error_before_anything_is_planned(tmp_path: Path, case: str) -> None:
    overrides, needles = UNMATCHED[case]
    (tmp_path / "data" / "empty").mkdir(parents=True)
    manifest = two_sources(tmp_path, **overrides)
    paths = RunPaths(tmp_path / "run")
    with pytest.raises(ManifestError) as refused:
        plan_ingest([manifest], paths, PART_BYTES)
    message = str(refused.value)
    folder = (tmp_path / "data" / ("empty" if "hf" in case else "records")).resolve()
    assert message.startswith(f"{manifest.resolve()}: sources[records] matches no file") and "\n" not in message
    assert str(folder) in message and all(needle in message for needle in needles), message
    assert "fix the glob, exclude or path" in message
    assert not paths.ingest_plan.exists(), "nothing was planned"


def test_a_refresh_that_finds_no_new_file_plans_nothing_quietly(tmp_path: Path) -> None:
    manifest = two_sources(tmp_path)
    paths = RunPaths(tmp_path / "run")
    ingest_all([manifest], paths)
    (tmp_path / "data" / "records" / "a.jsonl").unlink()  # the source held files before: not a typo
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan_ingest([manifest], paths, PART_BYTES) == []
