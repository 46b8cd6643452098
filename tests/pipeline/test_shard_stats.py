"""pipeline/shard_stats.py: exact figures on shards packed from known documents; agreement with SQL on a real run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from core.errors import ConfigError, ShardFormatError
from core.rundir import RunPaths
from core.shards.store import read_shard_index, shard_relpath, write_shard, write_shard_index
from flows.run_sql import run_query
from pipeline.shard_stats import doc_length_histogram, format_histogram, histogram_bucket_labels, shard_stats
from tests.test_readme_sql import build_small_run
from tokenization.pack import Packer

SEQ_LEN = 32
VOCAB_SIZE = 300


def random_docs(lengths: list[int], seed: int) -> list[np.ndarray]:
    """Documents of the given token lengths with ids in [2, VOCAB_SIZE): never EOS (0) or PAD (1)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB_SIZE, size=length) for length in lengths]


def pack_and_write(run_dir: Path, split: str, source: str, calls: list[list[np.ndarray]], rows_per_shard: int,
                   eos_id: int = 0, pad_id: int = 1) -> None:
    """Pack like the pack stage: each call streams its documents and ends with a padded row; shards numbered on."""
    infos, part, first_doc_id = [], 0, 1000 * len(source)
    for docs in calls:
        packer = Packer(SEQ_LEN, eos_id, pad_id, np.uint16)
        for number, tokens in enumerate(docs):
            packer.add(first_doc_id + number, tokens)
        first_doc_id += len(docs)
        chunks = []
        while packer.num_full_rows >= rows_per_shard:
            chunks.append(packer.take_rows(rows_per_shard))
        chunks.append(packer.finish())
        for rows in chunks:
            infos.append(write_shard(run_dir, shard_relpath(split, source, part), rows, split=split, source=source,
                                     tokenizer_sha256="t" * 64, vocab_size=VOCAB_SIZE))
            part += 1
    index = run_dir / "shards" / "index.parquet"
    previous = read_shard_index(run_dir) if index.is_file() else []
    write_shard_index(run_dir, previous + infos)


def bucket_of(length: int) -> str:
    return histogram_bucket_labels()[min(length.bit_length(), len(histogram_bucket_labels()) - 1)]


def test_histogram_buckets_are_fixed_log2_ranges() -> None:
    assert histogram_bucket_labels()[:5] == ["0", "1", "2-3", "4-7", "8-15"]
    counts = doc_length_histogram(np.array([0, 1, 2, 3, 4, 7, 8, 1000, 1024, 2**40]))
    assert list(counts) == histogram_bucket_labels()
    assert {label: count for label, count in counts.items() if count} == {
        "0": 1, "1": 1, "2-3": 2, "4-7": 2, "8-15": 1, "512-1023": 1, "1024-2047": 1, "2147483648+": 1}
    assert format_histogram(counts).startswith("0:1 1:1 2-3:2 4-7:2 8-15:1 512-1023:1")


def test_exact_figures_for_known_documents_spanning_rows_shards_and_pack_calls(tmp_path: Path) -> None:
    lengths_a = [5, 0, 70, 31, 1, 200, 3, 64]  # an empty document, ones longer than a row and than a shard
    lengths_b = [12, 40]  # a second pack call (incremental run): its own padded last row
    pack_and_write(tmp_path, "train", "lib", [random_docs(lengths_a, 1), random_docs(lengths_b, 2)], rows_per_shard=3)
    pack_and_write(tmp_path, "val", "lib", [random_docs([9], 3)], rows_per_shard=3)
    train, val = shard_stats(tmp_path)
    lengths = lengths_a + lengths_b
    real_tokens = sum(lengths) + len(lengths)
    rows_a, rows_b = -(-(sum(lengths_a) + 8) // SEQ_LEN), -(-(sum(lengths_b) + 2) // SEQ_LEN)
    expected_hist = {label: 0 for label in histogram_bucket_labels()}
    for length in lengths:
        expected_hist[bucket_of(length)] += 1
    assert train == {
        "split": "train", "source": "lib", "num_shards": -(-rows_a // 3) + -(-rows_b // 3),
        "size_bytes": sum(p.stat().st_size for p in (tmp_path / "shards/split=train").rglob("*.arrow")),
        "num_rows": rows_a + rows_b, "num_tokens": real_tokens, "num_documents": len(lengths),
        "eos_share": round(len(lengths) / real_tokens, 6),
        "pad_share": round(1 - real_tokens / ((rows_a + rows_b) * SEQ_LEN), 6),
        "doc_tokens_median": float(np.median(lengths)), "doc_tokens_max": 200,
        "doc_tokens_hist": format_histogram(expected_hist),
    }
    assert (val["num_rows"], val["num_tokens"], val["num_documents"], val["doc_tokens_max"]) == (1, 10, 1, 9)
    assert val["pad_share"] == round(22 / 32, 6)
    as_dict = shard_stats(tmp_path, histogram="dict")[0]["doc_tokens_hist"]
    assert sum(as_dict.values()) == len(lengths) and as_dict["0"] == 1 and as_dict["128-255"] == 1


def test_special_ids_come_from_the_run_tokenizer(tmp_path: Path) -> None:
    # A given tokenizer may put <|endoftext|> elsewhere than id 0: EOS is counted by its real id.
    tokenizer = tmp_path / "tokenizer" / "tokenizer.json"
    tokenizer.parent.mkdir(parents=True)
    tokenizer.write_text(json.dumps({"added_tokens": [{"id": 7, "content": "<|endoftext|>"},
                                                      {"id": 8, "content": "<|pad|>"}]}))
    docs = [doc[doc >= 9] for doc in random_docs([20, 30, 40], 4)]  # no 0..8 in the text
    pack_and_write(tmp_path, "train", "lib", [docs], rows_per_shard=10, eos_id=7, pad_id=8)
    (row,) = shard_stats(tmp_path)
    real_tokens = sum(len(doc) for doc in docs) + 3
    assert row["eos_share"] == round(3 / real_tokens, 6)
    assert row["doc_tokens_max"] == max(len(doc) for doc in docs)


def test_a_model_tokenizers_recorded_ids_win_over_the_named_tokens(tmp_path: Path) -> None:
    # A Hugging Face model's tokenizer (eos 5, padding with EOS) has no <|endoftext|>: special_tokens.json names it.
    paths = RunPaths(tmp_path)
    paths.special_tokens.parent.mkdir(parents=True)
    paths.special_tokens.write_text(json.dumps({"eos_id": 5, "pad_id": 5, "bos_id": None}))
    paths.tokenizer.write_text(json.dumps({"added_tokens": [{"id": 5, "content": "</s>"}]}))
    docs = [doc[doc >= 9] for doc in random_docs([20, 30, 40], 4)]
    pack_and_write(tmp_path, "train", "lib", [docs], rows_per_shard=10, eos_id=5, pad_id=5)
    (row,) = shard_stats(tmp_path)
    assert row["eos_share"] == round(3 / (sum(len(doc) for doc in docs) + 3), 6)  # padding EOS not counted


def test_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ShardFormatError, match="run `tokenmill prepare` first"):
        shard_stats(tmp_path)
    with pytest.raises(ConfigError, match="histogram='json'"):
        shard_stats(tmp_path, histogram="json")


def test_stats_agree_with_sql_over_a_real_run(tmp_path: Path) -> None:
    run_dir = build_small_run(tmp_path)
    stats = {(row["split"], row["source"]): row for row in shard_stats(run_dir)}
    documents = run_query(run_dir, "SELECT split, source, count(*) AS n FROM documents GROUP BY ALL").to_pylist()
    assert {(row["split"], row["source"]): row["n"] for row in documents} == {
        pair: row["num_documents"] for pair, row in stats.items()}
    shards = run_query(run_dir, "SELECT split, source, count(*) AS shards, sum(num_rows)::BIGINT AS num_rows, "
                                "sum(num_tokens)::BIGINT AS num_tokens FROM shards GROUP BY ALL").to_pylist()
    for row in shards:
        got = stats[(row["split"], row["source"])]
        assert (got["num_shards"], got["num_rows"], got["num_tokens"]) == (row["shards"], row["num_rows"],
                                                                           row["num_tokens"])
        # Every document ends with exactly one EOS, and nothing else in a text encodes to EOS.
        assert got["eos_share"] == round(got["num_documents"] / got["num_tokens"], 6)
        assert sum(int(part.split(":")[1]) for part in got["doc_tokens_hist"].split()) == got["num_documents"]
