"""Tests of tokenization/train_tokenizer.py and tokenization/encode.py on real text (the stdlib's own sources)."""

from __future__ import annotations

import hashlib
import json
import sysconfig
import unicodedata
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.errors import ConfigError
from core.files.atomic import sha256_file
from core.rundir import RunPaths
from core.schemas import DOCUMENTS_SCHEMA
from tests.conftest import finish_docs_part
from tokenization.config import TokenizerConfig
from tokenization.encode import encode_texts, split_text
from tokenization.train_tokenizer import (
    load_tokenizer,
    prepare_tokenizer,
    special_token_ids,
    train_tokenizer,
)

VOCAB_SIZE = 600


def stdlib_texts(max_bytes: int) -> list[str]:
    """Top-level standard-library .py files in name order, until about ``max_bytes``."""
    texts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def write_docs_part(run_dir: Path, part: int, texts: list[str], split: str = "train") -> None:
    """A finished documents part (parquet + ``.json`` marker) holding ``texts`` with doc_ids part*10^6 + i."""
    rows = [
        {"doc_id": part * 1_000_000 + i, "source": "stdlib", "source_id": None, "uri": f"file{i}.py",
         "text": text, "num_chars": len(text), "content_hash": hashlib.sha256(text.encode()).hexdigest(),
         "split": split}
        for i, text in enumerate(texts)
    ]
    docs = run_dir / "docs"
    docs.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=DOCUMENTS_SCHEMA), docs / f"part-{part:05d}.parquet")
    finish_docs_part(run_dir, part)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return stdlib_texts(400_000)


@pytest.fixture(scope="module")
def tokenizer(texts: list[str]):
    return train_tokenizer(texts, VOCAB_SIZE)


def test_training_is_deterministic(texts: list[str], tokenizer) -> None:
    again = train_tokenizer(texts, VOCAB_SIZE)
    assert again.to_str(pretty=True) == tokenizer.to_str(pretty=True)
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    assert special_token_ids(tokenizer) == (0, 1)


def test_encode_decode_round_trip(texts: list[str], tokenizer) -> None:
    sample = texts[:40]
    ids = encode_texts(tokenizer, sample)
    assert [array.dtype for array in ids] == [np.dtype(np.uint32)] * len(sample)
    for text, array in zip(sample, ids, strict=True):
        assert array.size < len(text.encode("utf-8")), "BPE should compress stdlib source"
        assert tokenizer.decode(array.tolist()) == unicodedata.normalize("NFC", text)


def test_literal_special_token_text_is_not_encoded_as_eos(tokenizer) -> None:
    text = "x = '<|endoftext|>'  # and <|pad|>"
    (ids,) = encode_texts(tokenizer, [text])
    assert 0 not in ids.tolist() and 1 not in ids.tolist()
    assert tokenizer.decode(ids.tolist()) == text


def test_cutting_long_texts_gives_the_ids_of_the_whole_text(texts: list[str], tokenizer) -> None:
    rng = np.random.default_rng(0)
    alphabet = list("ab Z9 \n\t.'s\u00a0\u0301é日本 \n\n  ,;()")
    adversarial = "".join(rng.choice(alphabet, size=20_000).tolist())
    for text in ("".join(texts[:30]), adversarial, "one_huge_line_without_spaces" * 500):
        pieces = split_text(text, 97)
        assert "".join(pieces) == text
        whole = tokenizer.encode(text, add_special_tokens=False).ids
        by_piece = [i for piece in pieces for i in tokenizer.encode(piece, add_special_tokens=False).ids]
        assert by_piece == whole
    assert len(split_text("".join(texts[:30]), 97)) > 100


def test_prepare_trains_once_then_skips(tmp_path: Path, texts: list[str]) -> None:
    write_docs_part(tmp_path, 0, texts[:20])
    write_docs_part(tmp_path, 1, texts[20:30], split="val")
    paths = RunPaths(tmp_path)
    config = TokenizerConfig(vocab_size=VOCAB_SIZE, sample_bytes=100_000)
    summary = prepare_tokenizer(paths, config, None)
    assert summary["trained"] is True
    assert summary["tokenizer_sha256"] == sha256_file(paths.tokenizer)
    assert summary["vocab_size"] == VOCAB_SIZE
    assert summary["sample_bytes"] <= 100_000
    assert summary["sample_bytes"] > 90_000
    modified = paths.tokenizer.stat().st_mtime_ns
    assert prepare_tokenizer(paths, config, None) == {**summary, "skipped": True}
    assert paths.tokenizer.stat().st_mtime_ns == modified
    bigger = prepare_tokenizer(paths, TokenizerConfig(vocab_size=VOCAB_SIZE + 50, sample_bytes=100_000), None)
    assert bigger["tokenizer_sha256"] != summary["tokenizer_sha256"]
    assert bigger["vocab_size"] == VOCAB_SIZE + 50


def test_progress_callback_reaches_the_sample_size_in_order(tmp_path: Path, texts: list[str]) -> None:
    write_docs_part(tmp_path, 0, texts[:20])
    fed: list[tuple[int, int]] = []
    summary = prepare_tokenizer(RunPaths(tmp_path), TokenizerConfig(vocab_size=VOCAB_SIZE, sample_bytes=100_000),
                                None, on_progress=lambda done, total: fed.append((done, total)))
    assert len(fed) > 1 and fed[-1] == (summary["sample_bytes"], summary["sample_bytes"])
    assert [done for done, _ in fed] == sorted(done for done, _ in fed)


def test_training_from_documents_is_deterministic(tmp_path: Path, texts: list[str]) -> None:
    shas = []
    for name in ("a", "b"):
        write_docs_part(tmp_path / name, 0, texts[:20])
        summary = prepare_tokenizer(RunPaths(tmp_path / name), TokenizerConfig(vocab_size=VOCAB_SIZE), None)
        shas.append(summary["tokenizer_sha256"])
    assert shas[0] == shas[1]
    first, second = (tmp_path / name / "tokenizer/tokenizer.json" for name in ("a", "b"))
    assert first.read_bytes() == second.read_bytes()


def test_prepare_copies_a_given_tokenizer(tmp_path: Path, tokenizer) -> None:
    given = tmp_path / "given.json"
    tokenizer.save(str(given))
    paths = RunPaths(tmp_path / "run")
    summary = prepare_tokenizer(paths, TokenizerConfig(path="given.json"), given)
    assert summary == {"tokenizer_sha256": sha256_file(given), "vocab_size": VOCAB_SIZE, "trained": False,
                       "sample_bytes": 0, "skipped": False}
    assert paths.tokenizer.read_bytes() == given.read_bytes()


def test_given_tokenizer_without_special_tokens_is_refused(tmp_path: Path, tokenizer) -> None:
    data = json.loads(tokenizer.to_str())
    data["added_tokens"] = []
    del data["model"]["vocab"]["<|pad|>"]
    given = tmp_path / "nopad.json"
    given.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"nopad\.json.*<\|pad\|>"):
        prepare_tokenizer(RunPaths(tmp_path / "run"), TokenizerConfig(path="nopad.json"), given)


def test_corrupt_tokenizer_file_gives_a_clear_error(tmp_path: Path) -> None:
    broken = tmp_path / "tokenizer.json"
    broken.write_text('{"model": ')
    with pytest.raises(ConfigError, match=r"tokenizer\.json: not a valid tokenizer\.json"):
        load_tokenizer(broken)
    with pytest.raises(ConfigError, match="not a valid"):
        prepare_tokenizer(RunPaths(tmp_path / "run"), TokenizerConfig(path="tokenizer.json"), broken)


def test_training_without_train_documents_is_refused(tmp_path: Path, texts: list[str]) -> None:
    write_docs_part(tmp_path, 0, texts[:3], split="val")
    with pytest.raises(ConfigError, match="no train-split text"):
        prepare_tokenizer(RunPaths(tmp_path), TokenizerConfig(vocab_size=VOCAB_SIZE), None)
