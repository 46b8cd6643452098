"""pipeline/ingest/readers.py on real and deliberately broken files: every record becomes a Record or a Reject."""

from __future__ import annotations

import gzip
import json
import sysconfig
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from core.errors import SourceReadError
from pipeline.filters.screen import REJECT_REASONS
from pipeline.ingest.readers import Record, Reject, read_file
from pipeline.manifest import SourceConfig

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def source(fmt: str, **overrides: object) -> SourceConfig:
    return SourceConfig(name="s", path=".", format=fmt, **overrides)


def read_all(path: Path, src: SourceConfig) -> tuple[list[Record], list[Reject]]:
    items = list(read_file(path, path.name, src))
    records = [item for item in items if isinstance(item, Record)]
    rejects = [item for item in items if isinstance(item, Reject)]
    assert len(records) + len(rejects) == len(items)
    return records, rejects


def good_lines(count: int) -> bytes:
    return b"".join(json.dumps({"id": i, "text": f"document {i} " * 20}).encode() + b"\n" for i in range(count))


def test_text_reader_reads_real_source_and_rejects_bad_utf8(tmp_path: Path) -> None:
    records, rejects = read_all(STDLIB / "json" / "decoder.py", source("text"))
    assert len(records) == 1 and not rejects
    assert records[0].uri == "decoder.py" and "JSONDecodeError" in records[0].text
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    records, rejects = read_all(latin1, source("text"))
    assert not records
    assert rejects[0].reason == "invalid_utf8" and rejects[0].raw == latin1.read_bytes()


def test_jsonl_reader_turns_every_broken_line_into_a_reject(tmp_path: Path) -> None:
    lines = [
        b'{"id": 7, "text": "a good document"}',
        b'{"text": "truncated',
        b"[1, 2, 3]",
        b'{"id": 9, "body": "no text field"}',
        b'{"text": 42}',
        b'{"text": "caf\xe9"}',
        b"",
        b'{"text": "lone surrogate \\ud800 here"}',
        b'{"id": null, "text": "another good one"}',
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines))
    records, rejects = read_all(path, source("jsonl", id_field="id"))
    assert [(r.uri, r.source_id, r.text) for r in records] == [
        ("mixed.jsonl:1", "7", "a good document"),
        ("mixed.jsonl:9", None, "another good one"),
    ]
    assert [(r.uri, r.reason) for r in rejects] == [
        ("mixed.jsonl:2", "invalid_json"),
        ("mixed.jsonl:3", "not_an_object"),
        ("mixed.jsonl:4", "missing_text"),
        ("mixed.jsonl:5", "non_string_text"),
        ("mixed.jsonl:6", "invalid_utf8"),
        ("mixed.jsonl:8", "invalid_utf8"),
    ]
    assert all(r.reason in REJECT_REASONS and r.detail for r in rejects)
    assert [r.raw for r in rejects] == [lines[i] for i in (1, 2, 3, 4, 5, 7)]
    assert rejects[2].source_id == "9"


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_compressed_jsonl_round_trips(tmp_path: Path, suffix: str) -> None:
    data = good_lines(5000)
    path = tmp_path / f"data{suffix}"
    compressed = gzip.compress(data) if suffix.endswith("gz") else zstandard.ZstdCompressor().compress(data)
    path.write_bytes(compressed)
    records, rejects = read_all(path, source("jsonl"))
    assert not rejects
    assert len(records) == 5000 and records[-1].uri == f"data{suffix}:5000"


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_truncated_stream_keeps_good_lines_and_rejects_the_rest(tmp_path: Path, suffix: str) -> None:
    data = good_lines(20000)
    compressed = gzip.compress(data) if suffix.endswith("gz") else zstandard.ZstdCompressor().compress(data)
    path = tmp_path / f"cut{suffix}"
    path.write_bytes(compressed[: len(compressed) * 2 // 3])
    records, rejects = read_all(path, source("jsonl", on_error="skip"))
    assert 1000 < len(records) < 20000
    assert [r.uri for r in records] == [f"cut{suffix}:{i}" for i in range(1, len(records) + 1)]
    assert len(rejects) == 1 and rejects[0].reason == "unreadable_file"
    assert rejects[0].uri == f"cut{suffix}:{len(records) + 1}"
    assert data.startswith(b"\n".join(json.dumps(json.loads(r.raw)).encode() for r in records))
    with pytest.raises(SourceReadError, match=f"cut{suffix}.*after line {len(records)}.*on_error: skip"):
        list(read_file(path, path.name, source("jsonl")))


def test_unreadable_files_fail_with_one_line_or_become_one_reject(tmp_path: Path) -> None:
    garbage_zst = tmp_path / "garbage.jsonl.zst"
    garbage_zst.write_bytes(b"this is not zstd at all" * 10)
    not_gzip = tmp_path / "plain.jsonl.gz"
    not_gzip.write_bytes(good_lines(3))
    not_parquet = tmp_path / "table.parquet"
    not_parquet.write_bytes(b"PAR1 but not really")
    for path, fmt in [(garbage_zst, "jsonl"), (not_gzip, "jsonl"), (not_parquet, "parquet")]:
        with pytest.raises(SourceReadError) as caught:
            list(read_file(path, path.name, source(fmt)))
        message = str(caught.value)
        assert "\n" not in message and str(path) in message and "on_error: skip" in message
        records, rejects = read_all(path, source(fmt, on_error="skip"))
        assert not records
        assert [(r.uri, r.reason, r.raw) for r in rejects] == [(path.name, "unreadable_file", path.read_bytes())]
        assert str(tmp_path) not in rejects[0].detail


def test_parquet_reader_rows_nulls_and_wrong_types(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    table = pa.table({"content": ["first", None, "third"] * 700, "key": list(range(2100))})
    pq.write_table(table, path, row_group_size=500)
    records, rejects = read_all(path, source("parquet", text_field="content", id_field="key"))
    assert len(records) == 1400 and len(rejects) == 700
    assert records[1].uri == "rows.parquet#row=2" and records[1].source_id == "2"
    assert {r.reason for r in rejects} == {"missing_text"}
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), numbers)
    records, rejects = read_all(numbers, source("parquet"))
    assert not records and [r.reason for r in rejects] == ["non_string_text"] * 2 and rejects[1].raw == b"2"


def test_parquet_without_text_column_names_the_column(tmp_path: Path) -> None:
    path = tmp_path / "other.parquet"
    pq.write_table(pa.table({"body": ["x"]}), path)
    with pytest.raises(SourceReadError, match=r"no column 'text'.*body.*text_field"):
        list(read_file(path, path.name, source("parquet")))


def test_hf_disk_dataset_and_dataset_dict(tmp_path: Path) -> None:
    single = tmp_path / "single"
    datasets.Dataset.from_dict({"text": ["alpha", "beta", None], "id": ["a", "b", "c"]}).save_to_disk(single)
    records, rejects = read_all(single, source("hf_disk", id_field="id"))
    assert [(r.uri, r.source_id, r.text) for r in records] == [("single#row=0", "a", "alpha"),
                                                               ("single#row=1", "b", "beta")]
    assert [(r.uri, r.reason) for r in rejects] == [("single#row=2", "missing_text")]
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["t0", "t1"]}),
                          "test": datasets.Dataset.from_dict({"text": ["v0"]})}).save_to_disk(splits)
    records, _ = read_all(splits, source("hf_disk"))
    assert [r.uri for r in records] == ["splits/test#row=0", "splits/train#row=0", "splits/train#row=1"]
    empty_folder = tmp_path / "nothing"
    empty_folder.mkdir()
    _, rejects = read_all(empty_folder, source("hf_disk", on_error="skip"))
    assert [r.reason for r in rejects] == ["unreadable_file"] and str(tmp_path) not in rejects[0].detail


def test_hf_local_reads_json_jsonl_parquet_csv_through_datasets(tmp_path: Path) -> None:
    (tmp_path / "lines.jsonl.gz").write_bytes(gzip.compress(good_lines(3000)))
    (tmp_path / "array.json").write_text(json.dumps([{"text": "first", "id": 1}, {"text": None, "id": 2},
                                                     {"text": 5, "id": 3}, {"text": "last", "id": 4}]))
    pq.write_table(pa.table({"text": ["p0", "p1"], "id": ["a", "b"]}), tmp_path / "table.parquet")
    (tmp_path / "rows.csv").write_text("id,text\n1,hello there\n2,general kenobi\n", encoding="utf-8")
    records, rejects = read_all(tmp_path / "lines.jsonl.gz", source("hf_local", id_field="id"))
    assert len(records) == 3000 and not rejects
    assert (records[0].uri, records[0].source_id, records[-1].uri) == ("lines.jsonl.gz#row=0", "0",
                                                                      "lines.jsonl.gz#row=2999")
    records, rejects = read_all(tmp_path / "array.json", source("hf_local", id_field="id"))
    assert [(r.uri, r.text, r.source_id) for r in records] == [("array.json#row=0", "first", "1"),
                                                               ("array.json#row=3", "last", "4")]
    assert [(r.uri, r.reason, r.raw) for r in rejects] == [("array.json#row=1", "missing_text", None),
                                                          ("array.json#row=2", "non_string_text", b"5")]
    records, _ = read_all(tmp_path / "table.parquet", source("hf_local", id_field="id"))
    assert [(r.text, r.source_id) for r in records] == [("p0", "a"), ("p1", "b")]
    records, _ = read_all(tmp_path / "rows.csv", source("hf_local"))
    assert [r.text for r in records] == ["hello there", "general kenobi"]


def test_hf_local_jsonl_with_broken_lines_keeps_every_valid_record(tmp_path: Path) -> None:
    # datasets parses ~10 MB of lines at a time and one bad line fails the whole block: past the first
    # block it delivers, the line reader takes over, so each bad line is its own reject and no good one is lost.
    num_good = 45_000  # ~11 MB: more than datasets' first block
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(gzip.compress(good_lines(num_good) + b'{"text": oops\n\n' + b"[1]\n" + good_lines(2)))
    records, rejects = read_all(broken, source("hf_local", id_field="id"))
    assert [(r.uri, r.reason) for r in rejects] == [(f"broken.jsonl.gz:{num_good + 1}", "invalid_json"),
                                                   (f"broken.jsonl.gz:{num_good + 3}", "not_an_object")]
    assert [r.source_id for r in records] == [str(i) for i in range(num_good)] + ["0", "1"]
    by_datasets = [r for r in records if "#row=" in r.uri]
    assert by_datasets and by_datasets == records[: len(by_datasets)]  # the rows datasets delivered come first
    assert records[len(by_datasets)].uri == f"broken.jsonl.gz:{len(by_datasets) + 1}"  # then line by line
    assert records[-1].uri == f"broken.jsonl.gz:{num_good + 5}" and records[-1].text == "document 1 " * 20


def test_hf_local_broken_empty_and_unknown_files(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert read_all(tmp_path / "empty.jsonl", source("hf_local")) == ([], [])
    broken = tmp_path / "broken.json"  # a JSON array: datasets reads it whole, so a bad value ends the file
    broken.write_bytes(b'[{"text": "fine"}, {"text": oops}]')
    with pytest.raises(SourceReadError, match=r"broken\.json.*datasets cannot read it as json.*on_error: skip"):
        list(read_file(broken, broken.name, source("hf_local")))
    records, rejects = read_all(broken, source("hf_local", on_error="skip"))
    assert not records
    assert [(r.uri, r.reason, r.raw) for r in rejects] == [("broken.json#row=0", "unreadable_file",
                                                            broken.read_bytes())]
    assert str(tmp_path) not in rejects[0].detail
    script = tmp_path / "notes.py"
    script.write_text("x = 1\n")
    _, rejects = read_all(script, source("hf_local", on_error="skip"))
    assert rejects[0].reason == "unreadable_file" and ".parquet" in rejects[0].detail


def test_a_null_text_says_it_is_null_and_an_absent_one_that_it_is_absent(tmp_path: Path) -> None:
    """``"text": null`` is not a missing field: the detail must not send the user to look for a key that is there."""
    path = tmp_path / "nulls.jsonl"
    path.write_bytes(b'{"id": 1, "text": null}\n{"id": 2, "body": "x"}\n{"id": 3, "text": [1]}\n'
                     b'{"id": 4, "text": {"a": 1}}\n{"id": 5, "text": true}\n')
    records, rejects = read_all(path, source("jsonl", id_field="id"))
    assert not records
    assert [(r.uri, r.reason, r.detail) for r in rejects] == [
        ("nulls.jsonl:1", "missing_text", "'text' is null"),
        ("nulls.jsonl:2", "missing_text", "no 'text' field (keys: body, id); set text_field in the manifest"),
        ("nulls.jsonl:3", "non_string_text", "'text' holds an array, not a string"),
        ("nulls.jsonl:4", "non_string_text", "'text' holds an object, not a string"),
        ("nulls.jsonl:5", "non_string_text", "'text' holds a boolean, not a string")]
