"""Hostile source folders (issue 15): what a source folder holds is data, never trusted, and never aborts a run.

Each class of hostile input is run through the pure stage functions (``plan_ingest`` / ``ingest_part``, what the
flow's tasks call), counting what lands in ``docs/part-*.parquet`` and ``rejects/part-*.parquet``: every valid
record is kept, every hostile one is a reject with its reason and (where there are any) its raw bytes. One
end-to-end ``tokenmill prepare`` runs over a folder mixing them all. Peak memory of the decompression bombs is
measured in a child process (a memory bound, not a timing).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
import zstandard

from core.errors import ManifestError
from core.rundir import RunPaths
from pipeline.filters.screen import REJECT_REASONS
from pipeline.ingest.readers import Record, Reject, read_file
from pipeline.ingest.stage import ingest_part, plan_ingest
from pipeline.ingest.streams import iter_lines, record_byte_limit
from pipeline.manifest import SourceConfig
from tests.chaos.conftest import record_text, tokenmill
from tests.conftest import copy_stdlib_slice

REPO_ROOT = Path(__file__).resolve().parents[2]
SECRET = "hostile-secret-4f1c: this text lives outside every source folder"


# ---- helpers -------------------------------------------------------------------------------------


def valid_texts(count: int, start: int = 0) -> list[str]:
    rng = random.Random(15 + start)
    return [record_text(rng, number) for number in range(start, start + count)]


def jsonl(texts: list[str], **fields: Any) -> bytes:
    return b"".join(json.dumps({"text": text, **fields}).encode() + b"\n" for text in texts)


def write_manifest(root: Path, sources: list[dict[str, Any]], **extra: Any) -> Path:
    manifest = root / "manifest.yaml"
    manifest.write_text(yaml.safe_dump({"name": "hostile", "sources": sources, **extra}))
    return manifest


def source(path: str = "corpus", fmt: str = "text", **options: Any) -> dict[str, Any]:
    return {"name": "s", "path": path, "format": fmt, **options}


def ingest(manifest: Path, run_dir: Path) -> RunPaths:
    """Plan and ingest every part, as the prepare flow's first stage does."""
    paths = RunPaths(run_dir)
    for part in plan_ingest([manifest], paths, 1 << 20):
        ingest_part(part, 0.0, paths)
    return paths


def rows(folder: Path) -> list[dict[str, Any]]:
    """Every row of the ``part-*.parquet`` files in ``folder`` (documents or rejects)."""
    return [row for part in sorted(folder.glob("part-*.parquet")) for row in pq.read_table(part).to_pylist()]


def texts_of(paths: RunPaths) -> list[str]:
    return sorted(row["text"] for row in rows(paths.docs))


def rejects_by_uri(paths: RunPaths) -> dict[str, dict[str, Any]]:
    found = rows(paths.rejects)
    assert all(row["reason"] in REJECT_REASONS and row["detail"] and "\n" not in row["detail"] for row in found)
    by_uri = {row["uri"]: row for row in found}
    assert len(by_uri) == len(found), "one reject per uri"
    return by_uri


def plant_text_files(folder: Path, texts: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for number, text in enumerate(texts):
        (folder / f"good-{number}.txt").write_text(text)


# ---- item 2: symbolic links that lead outside the source folder ----------------------------------


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_links_leading_outside_the_source_are_rejects_and_never_read(tmp_path: Path, on_error: str) -> None:
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "secret.txt").write_text(SECRET)
    (outside / "deep" / "more.txt").write_text(SECRET + " (in a folder)")
    corpus = tmp_path / "corpus"
    texts = valid_texts(3)
    plant_text_files(corpus, texts)
    (corpus / "passwd.txt").symlink_to("/etc/passwd")  # absolute link to a system file
    (corpus / "relative.txt").symlink_to("../outside/secret.txt")  # relative link out of the folder
    (corpus / "linked-folder").symlink_to(outside)  # a folder link: same rule as for files
    (corpus / "inner").mkdir()
    (corpus / "inner" / "alias.txt").symlink_to(corpus / "good-0.txt")  # inside the folder: read
    (corpus / "inner-folder").symlink_to(corpus / "inner")  # inside: not walked twice
    paths = ingest(write_manifest(tmp_path, [source(on_error=on_error)]), tmp_path / "run")

    assert texts_of(paths) == sorted([*texts, texts[0]]), "every valid file kept, the inside link read once"
    assert not any(SECRET in text or "root:" in text for text in texts_of(paths))
    rejects = rejects_by_uri(paths)
    assert sorted(rejects) == ["linked-folder", "passwd.txt", "relative.txt"]
    for uri, kind in (("passwd.txt", "file"), ("relative.txt", "file"), ("linked-folder", "folder")):
        assert rejects[uri]["reason"] == "outside_source" and rejects[uri]["raw"] is None
        assert f"a symbolic link to a {kind} outside the source folder" in rejects[uri]["detail"]


def test_a_file_swapped_for_an_outside_link_after_planning_is_refused_when_read(tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text(SECRET)
    corpus = tmp_path / "corpus"
    texts = valid_texts(2)
    plant_text_files(corpus, texts)
    paths = RunPaths(tmp_path / "run")
    parts = plan_ingest([write_manifest(tmp_path, [source()])], paths, 1 << 20)
    (corpus / "good-1.txt").unlink()
    (corpus / "good-1.txt").symlink_to(tmp_path / "secret.txt")
    for part in parts:
        ingest_part(part, 0.0, paths)
    assert texts_of(paths) == [texts[0]]
    assert rejects_by_uri(paths)["good-1.txt"]["reason"] == "outside_source"


def test_a_hostile_plan_naming_paths_outside_the_source_reads_none_of_them(tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text(SECRET)
    corpus = tmp_path / "corpus"
    texts = valid_texts(1)
    plant_text_files(corpus, texts)
    paths = RunPaths(tmp_path / "run")
    manifest = write_manifest(tmp_path, [source()])
    plan_ingest([manifest], paths, 1 << 20)
    plan = json.loads((paths.docs / "plan.json").read_text())
    plan["parts"][0]["files"] += [str(tmp_path / "secret.txt"), "../secret.txt", "sub/../../secret.txt"]
    (paths.docs / "plan.json").write_text(json.dumps(plan))  # a run dir is data: its plan too
    for part in plan_ingest([manifest], paths, 1 << 20):
        ingest_part(part, 0.0, paths)
    assert texts_of(paths) == texts
    rejects = rejects_by_uri(paths)
    assert sorted(rejects) == sorted([str(tmp_path / "secret.txt"), "../secret.txt", "sub/../../secret.txt"])
    assert {row["reason"] for row in rejects.values()} == {"outside_source"}


def test_links_leading_nowhere_are_skipped_with_a_warning(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    texts = valid_texts(2)
    plant_text_files(corpus, texts)
    (corpus / "dangling.txt").symlink_to(tmp_path / "missing.txt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = ingest(write_manifest(tmp_path, [source()]), tmp_path / "run")
    assert texts_of(paths) == sorted(texts) and rows(paths.rejects) == []
    assert any("dangling.txt is a symbolic link that leads nowhere" in str(w.message) for w in caught)


# ---- item 8: special files -----------------------------------------------------------------------


def test_fifos_sockets_and_devices_in_a_source_folder_are_rejects_and_never_opened(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    texts = valid_texts(2)
    plant_text_files(corpus, texts)
    os.mkfifo(corpus / "pipe.txt")  # opening it for reading would block forever
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(corpus / "socket.txt"))
    (corpus / "zero.txt").symlink_to("/dev/zero")  # a device outside the folder: never ends
    os.mkfifo(tmp_path / "inner-pipe")
    (corpus / "inner-pipe.txt").symlink_to(corpus / "pipe.txt")  # a link inside the folder, to the FIFO
    try:
        paths = ingest(write_manifest(tmp_path, [source()]), tmp_path / "run")
    finally:
        listener.close()
    assert texts_of(paths) == sorted(texts)
    rejects = rejects_by_uri(paths)
    assert {uri: row["reason"] for uri, row in rejects.items()} == {
        "pipe.txt": "not_a_regular_file", "inner-pipe.txt": "not_a_regular_file",
        "socket.txt": "not_a_regular_file", "zero.txt": "outside_source"}
    assert "a FIFO, not a regular file" in rejects["pipe.txt"]["detail"]
    assert "a socket, not a regular file" in rejects["socket.txt"]["detail"]


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_source_path_that_is_not_a_regular_file_or_folder_is_refused_at_plan_time(tmp_path: Path,
                                                                                    kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(tmp_path / "pipe.jsonl")
        path = "pipe.jsonl"
    else:
        path = "/dev/zero"
    manifest = write_manifest(tmp_path, [source(path=path, fmt="jsonl")])
    with pytest.raises(ManifestError) as raised:
        plan_ingest([manifest], RunPaths(tmp_path / "run"), 1 << 20)
    message = str(raised.value)
    expected = "is a FIFO" if kind == "fifo" else "is a character device"
    assert "\n" not in message and "manifest.yaml" in message and "sources[s].path" in message
    assert path in message and expected in message and "regular files only" in message
    assert not (tmp_path / "run" / "docs" / "plan.json").exists()


# ---- item 3: one bad record never aborts a run, no valid record is lost ---------------------------


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_lone_surrogates_in_jsonl_keys_and_ids_are_stored_escaped(tmp_path: Path, on_error: str) -> None:
    texts = valid_texts(4)
    surrogate_key = b'{"\\ud800": 1}'  # no text field: the reject's detail lists the key
    surrogate_id = json.dumps({"text": texts[3], "id": "id-\udfff"}).encode()  # a valid record with a bad id
    mixed_key = json.dumps({"text": texts[2], "\udc80 extra": [1, 2]}).encode()  # a valid record with a bad key
    lines = [*jsonl(texts[:2]).splitlines(), surrogate_key, mixed_key, surrogate_id, b'{"text": "\\udcff alone"}']
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "keys.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    manifest = write_manifest(tmp_path, [source(fmt="jsonl", id_field="id", on_error=on_error)])
    paths = ingest(manifest, tmp_path / "run")

    assert texts_of(paths) == sorted(texts)
    ids = {row["text"]: row["source_id"] for row in rows(paths.docs)}
    assert ids[texts[3]] == "id-\\udfff"
    rejects = rejects_by_uri(paths)
    assert {uri: row["reason"] for uri, row in rejects.items()} == {"keys.jsonl:3": "missing_text",
                                                                   "keys.jsonl:6": "invalid_utf8"}
    assert rejects["keys.jsonl:3"]["raw"] == surrogate_key and "\\ud800" in rejects["keys.jsonl:3"]["detail"]
    assert rejects["keys.jsonl:6"]["raw"] == lines[5]


def bytes_path(folder: Path, name: bytes) -> bytes:
    return os.path.join(os.fsencode(folder), name)


def test_file_names_that_are_not_utf8_are_read_under_an_escaped_uri(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    texts = valid_texts(4)
    plant_text_files(corpus, texts[:1])
    with open(bytes_path(corpus, b"bad\xff.txt"), "wb") as handle:
        handle.write(texts[1].encode())
    with open(bytes_path(corpus, b"latin\xe9-content\xfe.txt"), "wb") as handle:
        handle.write("caf\u00e9 in latin-1".encode("latin-1"))
    os.mkdir(bytes_path(corpus, b"folder\xc3"))
    with open(bytes_path(corpus, b"folder\xc3/notes.jsonl"), "wb") as handle:
        handle.write(jsonl(texts[2:]))
    manifest = write_manifest(tmp_path, [source(glob="**/*.txt"),
                                         {**source(fmt="jsonl", glob="**/*.jsonl"), "name": "j"}])
    paths = ingest(manifest, tmp_path / "run")
    paths_again = ingest(manifest, tmp_path / "run-again")

    documents = {row["uri"]: row for row in rows(paths.docs)}
    assert sorted(documents) == ["bad\\xff.txt", "folder\\xc3/notes.jsonl:1", "folder\\xc3/notes.jsonl:2",
                                 "good-0.txt"]
    assert documents["bad\\xff.txt"]["text"] == texts[1]
    assert {row["uri"]: row["doc_id"] for row in rows(paths_again.docs)} == \
        {uri: row["doc_id"] for uri, row in documents.items()}, "doc_ids of escaped uris are stable"
    rejects = rejects_by_uri(paths)
    assert list(rejects) == ["latin\\xe9-content\\xfe.txt"]
    assert rejects["latin\\xe9-content\\xfe.txt"]["reason"] == "invalid_utf8"
    assert rejects["latin\\xe9-content\\xfe.txt"]["raw"] == "caf\u00e9 in latin-1".encode("latin-1")


def invalid_utf8_strings(values: list[bytes], large: bool = False) -> pa.Array:
    """A string array holding bytes that are not UTF-8 (Arrow and Parquet writers do not check)."""
    return pa.array(values, pa.large_binary() if large else pa.binary()).view(
        pa.large_string() if large else pa.string())


@pytest.mark.parametrize("large", [False, True], ids=["string", "large_string"])
def test_parquet_and_hf_disk_strings_that_are_not_utf8_are_rejects_with_their_bytes(tmp_path: Path,
                                                                                   large: bool) -> None:
    texts = valid_texts(6)
    values = [texts[0].encode(), b"caf\xe9 latin-1 bytes", texts[1].encode(), b"\xff\xfe", texts[2].encode()]
    ids = [b"a", b"b", b"c\xff", b"d", b"e"]
    table = pa.table({"text": invalid_utf8_strings(values, large), "id": invalid_utf8_strings(ids)})
    (tmp_path / "corpus").mkdir()
    pq.write_table(table, tmp_path / "corpus" / "bad.parquet")
    pq.write_table(pa.table({"text": texts[3:]}), tmp_path / "corpus" / "good.parquet")
    datasets.Dataset(table).save_to_disk(str(tmp_path / "dataset"))
    manifest = write_manifest(tmp_path, [source(fmt="parquet", id_field="id"),
                                         {**source("dataset", "hf_disk", id_field="id"), "name": "h"}])
    paths = ingest(manifest, tmp_path / "run")

    assert texts_of(paths) == sorted([*texts, *texts[:3]])
    by_text = {(row["source"], row["text"]): row for row in rows(paths.docs)}
    assert by_text[("s", texts[1])]["source_id"] == "c\\xff" and by_text[("h", texts[1])]["source_id"] == "c\\xff"
    rejects = rejects_by_uri(paths)
    assert sorted(rejects) == ["bad.parquet#row=1", "bad.parquet#row=3", "dataset#row=1", "dataset#row=3"]
    for prefix in ("bad.parquet", "dataset"):
        assert rejects[f"{prefix}#row=1"]["reason"] == rejects[f"{prefix}#row=3"]["reason"] == "invalid_utf8"
        assert rejects[f"{prefix}#row=1"]["raw"] == values[1] and rejects[f"{prefix}#row=3"]["raw"] == values[3]
        assert rejects[f"{prefix}#row=3"]["source_id"] == "d"


def test_hf_local_keeps_every_record_of_a_line_with_two_objects_before_a_broken_block(tmp_path: Path) -> None:
    # datasets parses 10 MB blocks and one bad line fails its block: past the first block the line reader takes
    # over. A line holding two objects is two rows to datasets but one line: counting rows as lines lost a record.
    num_good = 43_000  # ~10.7 MB: the broken line falls in datasets' second block
    lines = [json.dumps({"id": str(i), "text": f"document {i} " * 20}).encode() for i in range(num_good)]
    lines[5] = lines[5] + json.dumps({"id": "twin", "text": "the second object on line six " * 5}).encode()
    lines[num_good - 3] += b" " + json.dumps({"id": "late-twin", "text": "after the first block"}).encode()
    path = tmp_path / "two.jsonl.gz"
    path.write_bytes(gzip.compress(b"\n".join([*lines, b'{"text": oops', *jsonl(["tail record"]).splitlines()])))
    items = list(read_file(path, path.name, SourceConfig(name="s", path=".", format="hf_local", id_field="id")))
    records = [item for item in items if isinstance(item, Record)]
    rejects = [item for item in items if isinstance(item, Reject)]
    by_datasets = [record for record in records if "#row=" in record.uri]
    assert by_datasets and len(by_datasets) < num_good, "datasets delivered the first block only"
    kept_ids = [record.source_id for record in records]
    assert set(kept_ids) >= {str(i) for i in range(num_good) if i != num_good - 3} | {"twin"}
    assert len(kept_ids) == len(set(kept_ids)), "no record read twice"
    assert kept_ids[-1] is None and records[-1].text == "tail record"
    assert [(reject.uri, reject.reason) for reject in rejects] == [
        (f"two.jsonl.gz:{num_good - 2}", "invalid_json"), (f"two.jsonl.gz:{num_good + 1}", "invalid_json")]
    assert rejects[0].raw == lines[num_good - 3], "the line with two objects is kept whole in its reject"


# ---- item 4: bounded memory on giant lines and decompression bombs -------------------------------


BOMB_BYTES = 1 << 30
"""What each bomb expands to: one 1 GiB line (the issue's case: 4.5 GB of RSS, then MemoryError)."""
PEAK_RSS_BOUND_MB = 450
"""Peak RSS of a child process that ingests every bomb (measured: 235 MB, the peak of its imports; 12.5 GB before
the bound): imports + one record at the limit
(``record_byte_limit`` of the default max_chars: 87 MiB, the most a line is buffered before it is cut) + a few
1 MiB chunks, with room to spare; independent of the bombs' expanded size."""


def write_bombs(folder: Path) -> dict[str, int]:
    """A zstd and a gzip file, each one line of BOMB_BYTES (and a valid record after it), and a sparse text file
    of BOMB_BYTES; returns ``{name: expanded bytes of the giant record}``."""
    folder.mkdir()
    block = b"A" * (1 << 20)
    with open(folder / "bomb.jsonl.zst", "wb") as raw, \
            zstandard.ZstdCompressor(level=3).stream_writer(raw) as writer:
        writer.write(b'{"text": "')
        for _ in range(BOMB_BYTES >> 20):
            writer.write(block)
        writer.write(b'"}\n' + jsonl(["A valid record after the zstd bomb, with enough words."]))
    gzip_bytes = BOMB_BYTES // 4
    with gzip.open(folder / "bomb.jsonl.gz", "wb", compresslevel=1) as writer:
        for _ in range(gzip_bytes >> 20):
            writer.write(block)
        writer.write(b"\n" + jsonl(["A valid record after the gzip bomb, with enough words."]))
    (folder / "hf").mkdir()
    shutil.copyfile(folder / "bomb.jsonl.zst", folder / "hf" / "bomb.jsonl.zst")  # read through datasets
    with open(folder / "zeros.jsonl", "wb") as handle:
        handle.truncate(BOMB_BYTES)  # sparse: a 1 GiB line of NULs on no disk space
    with open(folder / "huge.txt", "wb") as handle:
        handle.truncate(BOMB_BYTES)
    return {"bomb.jsonl.zst:1": BOMB_BYTES + 12, "bomb.jsonl.gz:1": gzip_bytes, "zeros.jsonl:1": BOMB_BYTES,
            "huge.txt": BOMB_BYTES, "hf/bomb.jsonl.zst:1": BOMB_BYTES + 12}


CHILD = """
import json, sys
from pathlib import Path
from pipeline.ingest.stage import ingest_part, plan_ingest
from core.rundir import RunPaths
paths = RunPaths(Path(sys.argv[2]))
summaries = [ingest_part(part, 0.0, paths) for part in plan_ingest([Path(sys.argv[1])], paths, 1 << 20)]
peak_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"peak_rss_mb": peak_kb / 1024, "num_documents": sum(s["num_documents"] for s in summaries)}))
"""
"""The measured process: its own peak RSS (``VmHWM``: ``ru_maxrss`` would carry over the forking pytest's)."""


@pytest.mark.slow
def test_decompression_bombs_and_giant_lines_are_too_long_in_bounded_memory(tmp_path: Path) -> None:
    expanded = write_bombs(tmp_path / "corpus")
    assert (tmp_path / "corpus" / "bomb.jsonl.zst").stat().st_size < 64 << 10, "a small file, a 1 GiB line"
    manifest = write_manifest(tmp_path, [{**source(fmt="jsonl", glob="*.jsonl*", on_error="skip"), "name": "j"},
                                         {**source(glob="*.txt"), "name": "t"},
                                         {**source(fmt="hf_local", glob="hf/*"), "name": "h"}])
    child = subprocess.run([sys.executable, "-c", CHILD, str(manifest), str(tmp_path / "run")], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["peak_rss_mb"] < PEAK_RSS_BOUND_MB, result
    paths = RunPaths(tmp_path / "run")
    assert texts_of(paths) == ["A valid record after the gzip bomb, with enough words.",
                               *["A valid record after the zstd bomb, with enough words."] * 2]
    rejects = rejects_by_uri(paths)
    assert sorted(rejects) == sorted(expanded)
    limit = record_byte_limit(2_000_000)
    for uri, num_bytes in expanded.items():
        assert rejects[uri]["reason"] == "too_long"
        assert rejects[uri]["detail"].startswith(f"{num_bytes} bytes, above the {limit}-byte limit"), uri
        assert len(rejects[uri]["raw"]) == 1 << 20 and rejects[uri]["raw"][:1] in (b"{", b"A", b"\x00"), uri


def test_zstd_frames_of_every_kind_read_as_zstandard_reads_them(tmp_path: Path) -> None:
    """The bounded zstd reader parses frame and block headers itself: checksums, no content size, skippable and
    empty frames, flushed stream frames, negative levels all decode to the same lines."""
    rng = random.Random(4)

    def lines(count: int, tag: str) -> bytes:
        return b"".join(json.dumps({"text": f"{tag} {i} " + "x" * rng.randint(0, 200_000 if i % 97 == 0 else 40)})
                        .encode() + b"\n" for i in range(count))

    stream = io.BytesIO()
    with zstandard.ZstdCompressor(level=3).stream_writer(stream, closefd=False) as writer:
        writer.write(lines(800, "flushed"))
        writer.flush(zstandard.FLUSH_FRAME)
        writer.write(lines(50, "after"))
    data = b"".join([zstandard.ZstdCompressor(level=1, write_checksum=True).compress(lines(900, "checksum")),
                     zstandard.ZstdCompressor(level=19, write_content_size=False).compress(lines(500, "no-size")),
                     struct.pack("<II", 0x184D2A53, 5) + b"skip!", zstandard.ZstdCompressor().compress(b""),
                     zstandard.ZstdCompressor(level=-5).compress(lines(900, "fast")), stream.getvalue()])
    path = tmp_path / "frames.jsonl.zst"
    path.write_bytes(data)
    expected = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True).read()
    read = list(iter_lines(path, path.name, record_byte_limit(2_000_000)))
    assert [line for _, line, _ in read] == expected.split(b"\n")[:-1]
    assert all(num_bytes == len(line) for _, line, num_bytes in read)


def test_a_parquet_value_above_the_record_limit_is_too_long_with_a_truncated_raw(tmp_path: Path) -> None:
    texts = valid_texts(3)
    limit = record_byte_limit(1)  # 12 bytes + 64 MiB of slack
    big = ("word " * (limit // 5 + 100_000)).encode()
    assert len(big) > limit
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": pa.array([texts[0].encode(), big, *(t.encode() for t in texts[1:])],
                                              pa.large_binary()).view(pa.large_string())}), path)
    del big
    items = list(read_file(path, path.name, SourceConfig(name="s", path=".", format="parquet"), max_chars=1))
    assert [item.text for item in items if isinstance(item, Record)] == texts
    [reject] = [item for item in items if isinstance(item, Reject)]
    assert (reject.uri, reject.reason) == ("t.parquet#row=1", "too_long")
    assert reject.raw == b"word " * ((1 << 20) // 5) + b"word"[: (1 << 20) % 5]
    assert reject.detail.startswith(f"{5 * (limit // 5 + 100_000)} bytes, above the {limit}-byte limit")


# ---- item 6: run dirs inside a source folder -----------------------------------------------------


def test_run_dirs_inside_a_source_folder_are_never_ingested(tmp_path: Path) -> None:
    project = tmp_path / "project"
    copy_stdlib_slice(project / "lib", ("json",))
    planted = sorted(path.relative_to(project).as_posix() for path in project.rglob("*.py"))
    other_run = project / "old-runs" / "earlier"
    (other_run / "docs").mkdir(parents=True)
    (other_run / "docs" / "plan.json").write_text("{}")
    (other_run / "docs" / "notes.py").write_text("print('an output of another run')\n")
    copied_run = project / "copied-run"
    copied_run.mkdir()
    for name in ("run.yaml", ".lock", "stray.py"):
        (copied_run / name).write_text("name: x\n")
    manifest = write_manifest(project, [source(path=".", glob="**/*")], filters={"min_chars": 1})
    run_dir = project / "runs" / "tiny"
    (run_dir / "tokenizer").mkdir(parents=True)
    (run_dir / "run.yaml").write_text("name: tiny\n")  # written before ingest, as the CLI does
    (run_dir / ".lock").write_text("pid 1 on host x\n")
    (run_dir / "tokenizer" / "tokenizer.json").write_text("{}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = ingest(manifest, run_dir)
        assert plan_ingest([manifest], paths, 1 << 20) == [], "a re-run finds nothing new to ingest"
    uris = sorted(row["uri"] for row in [*rows(paths.docs), *rows(paths.rejects)])
    assert uris == sorted([*planted, "manifest.yaml"])
    skipped = sorted(str(w.message) for w in caught if "tokenmill run dir" in str(w.message))
    assert any("copied-run/ is a tokenmill run dir" in message for message in skipped)
    assert any("old-runs/earlier/ is a tokenmill run dir" in message for message in skipped)
    assert any("runs/tiny/ is a tokenmill run dir" in message for message in skipped)


def test_a_source_inside_the_run_dir_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    plant_text_files(run_dir / "docs", valid_texts(1))
    manifest = write_manifest(tmp_path, [source(path="run/docs")])
    with pytest.raises(ManifestError) as raised:
        plan_ingest([manifest], RunPaths(run_dir), 1 << 20)
    assert "\n" not in str(raised.value) and "is inside the run dir" in str(raised.value)


# ---- end to end: tokenmill prepare over a folder mixing every hostile input ----------------------


@pytest.mark.slow
def test_prepare_with_on_error_skip_over_every_hostile_input_exits_0_and_keeps_every_valid_record(
        tmp_path: Path, cli_env: dict[str, str]) -> None:
    corpus = tmp_path / "corpus"
    copy_stdlib_slice(corpus / "text", ("json",))
    planted = [path.relative_to(corpus / "text").as_posix() for path in (corpus / "text").rglob("*.py")]
    (tmp_path / "secret.py").write_text(f"SECRET = {SECRET!r}\n")
    (corpus / "text" / "leak.py").symlink_to(tmp_path / "secret.py")
    (corpus / "text" / "etc").symlink_to("/etc")
    os.mkfifo(corpus / "text" / "pipe.py")
    with open(bytes_path(corpus / "text", b"bad\xff.py"), "wb") as handle:
        handle.write(b"def bad_name():\n    return 'a module whose file name is not UTF-8'\n")
    texts = valid_texts(30)
    records = corpus / "records"
    records.mkdir()
    (records / "good.jsonl").write_bytes(jsonl(texts[:20]) + b'{"\\ud800": 1}\n' + jsonl(texts[20:25]))
    (records / "bomb.jsonl.zst").write_bytes(zstandard.compress(b'{"text": "' + b"B" * (200 << 20) + b'"}\n'
                                                                + jsonl(texts[25:])))
    table = pa.table({"text": invalid_utf8_strings([b"caf\xe9", *[t.encode() for t in valid_texts(5, 100)]])})
    (corpus / "tables").mkdir()
    pq.write_table(table, corpus / "tables" / "t.parquet")
    write_manifest(tmp_path, [
        {"name": "code", "path": "corpus/text", "format": "text", "glob": "**/*.py", "on_error": "skip"},
        {"name": "notes", "path": "corpus/records", "format": "jsonl", "on_error": "skip"},
        {"name": "tables", "path": "corpus/tables", "format": "parquet", "on_error": "skip"},
    ], filters={"min_chars": 20, "max_chars": 1_000_000})
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"name": "hostile", "data": {"manifests": ["manifest.yaml"]},
                                      "dedupe": {"near": {"enabled": False}}, "tokenizer": {"vocab_size": 300},
                                      "pack": {"seq_len": 32, "rows_per_shard": 256}}))
    result = tokenmill("prepare", recipe, "--run-dir", tmp_path / "run", env=cli_env, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    paths = RunPaths(tmp_path / "run")
    documents, rejects = rows(paths.docs), rows(paths.rejects)
    assert not any(SECRET in row["text"] for row in documents)
    assert sorted(row["text"] for row in documents if row["source"] == "notes") == sorted(texts)
    assert sorted(row["text"] for row in documents if row["source"] == "tables") == sorted(valid_texts(5, 100))
    hostile = {("code", "leak.py"): "outside_source", ("code", "etc"): "outside_source",
               ("code", "pipe.py"): "not_a_regular_file", ("notes", "good.jsonl:21"): "missing_text",
               ("notes", "bomb.jsonl.zst:1"): "too_long", ("tables", "t.parquet#row=0"): "invalid_utf8"}
    reasons = {(row["source"], row["uri"]): row["reason"] for row in rejects}
    assert {key: reasons.get(key) for key in hostile} == hostile
    assert set(reasons) - set(hostile) <= {("code", uri) for uri in planted}, "others: quality filters only"
    code_uris = sorted(row["uri"] for row in [*documents, *rejects] if row["source"] == "code")
    assert code_uris == sorted([*planted, "bad\\xff.py", "leak.py", "etc", "pipe.py"]), "every file, once"
    assert "bad\\xff.py" in {row["uri"] for row in documents}
    assert paths.shard_index.is_file()
    shutil.rmtree(paths.root)
