"""Tests of tokenization/stage.py: real stdlib documents -> shards that verify, read back, and append incrementally."""

from __future__ import annotations

import hashlib
import shutil
import sysconfig
import unicodedata
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from core.errors import StageMismatchError
from core.files.atomic import read_json
from core.rundir import RunPaths
from core.schemas import DOCUMENTS_SCHEMA
from core.shards.store import ShardTokens, read_shard_index, shard_metadata, verify_shards
from tests.conftest import finish_docs_part
from tokenization.config import PackConfig, TokenizerConfig
from tokenization.stage import pack_split_source, write_index
from tokenization.train_tokenizer import load_tokenizer, prepare_tokenizer

PACK = PackConfig(seq_len=64, rows_per_shard=300, encode_batch_docs=16)
SOURCES = ("lib", "tests")
HALF = 30


def stdlib_texts(max_chars: int) -> list[str]:
    """Top-level standard-library .py files under 40 k characters in name order, until about ``max_chars``."""
    texts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8")
        if len(text) > 40_000:
            continue
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return texts


def write_docs_part(run_dir: Path, part: int, texts: list[str]) -> dict[int, str]:
    """A finished documents part over two sources and both splits; returns {doc_id: text}."""
    rows = []
    for i, text in enumerate(texts):
        digest = hashlib.sha256(text.encode()).hexdigest()
        rows.append({"doc_id": part * 1_000_000 + i, "source": SOURCES[i % 2], "source_id": None,
                     "uri": f"part{part}/file{i}.py", "text": text, "num_chars": len(text),
                     "content_hash": digest, "split": "val" if int(digest, 16) % 5 == 0 else "train"})
    docs = run_dir / "docs"
    docs.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=DOCUMENTS_SCHEMA), docs / f"part-{part:05d}.parquet")
    finish_docs_part(run_dir, part)
    return {row["doc_id"]: row["text"] for row in rows}


def pack_all(paths: RunPaths, config: PackConfig = PACK) -> list:
    for split in ("train", "val"):
        for source in SOURCES:
            pack_split_source(paths, split, source, config)
    return write_index(paths)


def read_rows(path: Path) -> tuple[np.ndarray, list[list[int]], list[list[int]], list[int]]:
    shard = ShardTokens(path)
    tokens = np.array(shard.tokens)
    shard.close()
    with pa.memory_map(str(path)) as source:
        table = ipc.open_file(source).read_all()
    return (tokens, table.column("doc_ids").to_pylist(), table.column("doc_starts").to_pylist(),
            table.column("first_doc_offset").to_pylist())


def documents_from_shards(run_dir: Path, infos: list, eos_id: int) -> dict[int, list[int]]:
    """Follow each doc_starts entry where a document begins up to its EOS (across rows and shards of a source)."""
    found: dict[int, list[int]] = {}
    for split, source in {(info.split, info.source) for info in infos}:
        shard_paths = sorted(run_dir / info.path for info in infos if (info.split, info.source) == (split, source))
        parts = [read_rows(path) for path in shard_paths]
        flat = np.concatenate([tokens.reshape(-1) for tokens, *_ in parts])
        seq_len = parts[0][0].shape[1]
        row = 0
        for _, doc_ids, doc_starts, offsets in parts:
            for ids, starts, offset in zip(doc_ids, doc_starts, offsets, strict=True):
                for k, (doc_id, start) in enumerate(zip(ids, starts, strict=True)):
                    if k == 0 and offset > 0:
                        continue
                    begin = row * seq_len + start
                    end = begin + int(np.flatnonzero(flat[begin:] == eos_id)[0])
                    assert doc_id not in found, f"document {doc_id} starts twice"
                    found[doc_id] = flat[begin:end].tolist()
                row += 1
    return found


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return stdlib_texts(700_000)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory, texts: list[str]) -> Path:
    """One trained tokenizer, copied into each run so every test packs with the same one."""
    run_dir = tmp_path_factory.mktemp("tokenizer_run")
    write_docs_part(run_dir, 0, texts)
    prepare_tokenizer(RunPaths(run_dir), TokenizerConfig(vocab_size=700, sample_bytes=300_000), None)
    return RunPaths(run_dir).tokenizer


def new_run(run_dir: Path, tokenizer_file: Path) -> RunPaths:
    paths = RunPaths(run_dir)
    paths.tokenizer.parent.mkdir(parents=True)
    shutil.copyfile(tokenizer_file, paths.tokenizer)
    return paths


def test_shards_verify_and_carry_the_tokenizer_sha(tmp_path: Path, texts: list[str], tokenizer_file: Path) -> None:
    paths = new_run(tmp_path, tokenizer_file)
    write_docs_part(tmp_path, 0, texts)
    infos = pack_all(paths)
    assert verify_shards(tmp_path) == []
    sha = hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
    assert {(info.split, info.source) for info in infos} == {(s, src) for s in ("train", "val") for src in SOURCES}
    assert all(info.tokenizer_sha256 == sha and info.seq_len == 64 for info in infos)
    assert read_shard_index(tmp_path) == infos
    for info in infos:
        metadata = shard_metadata(tmp_path / info.path)
        assert (metadata["tokenizer_sha256"], metadata["split"], metadata["source"]) == (sha, info.split, info.source)
        assert metadata["dtype"] == "uint16"
    assert max(info.num_rows for info in infos) == PACK.rows_per_shard


def test_every_document_decodes_back_from_the_shards(tmp_path: Path, texts: list[str], tokenizer_file: Path) -> None:
    paths = new_run(tmp_path, tokenizer_file)
    by_id = write_docs_part(tmp_path, 0, texts)
    infos = pack_all(paths)
    tokenizer = load_tokenizer(paths.tokenizer)
    found = documents_from_shards(tmp_path, infos, eos_id=0)
    assert sorted(found) == sorted(by_id)
    for doc_id, text in by_id.items():
        assert tokenizer.decode(found[doc_id]) == unicodedata.normalize("NFC", text)
    total_tokens = sum(len(ids) + 1 for ids in found.values())
    assert sum(info.num_tokens for info in infos) == total_tokens


def test_packing_is_byte_identical_in_a_fresh_run_dir(tmp_path: Path, texts: list[str], tokenizer_file: Path) -> None:
    results = []
    for name in ("first", "second"):
        paths = new_run(tmp_path / name, tokenizer_file)
        write_docs_part(paths.root, 0, texts)
        results.append(pack_all(paths))
    assert results[0] == results[1]
    for info in results[0]:
        assert (tmp_path / "first" / info.path).read_bytes() == (tmp_path / "second" / info.path).read_bytes()
    first_index, second_index = (tmp_path / name / "shards/index.parquet" for name in ("first", "second"))
    assert first_index.read_bytes() == second_index.read_bytes()


def test_new_parts_are_appended_as_new_shards_only(tmp_path: Path, texts: list[str], tokenizer_file: Path) -> None:
    paths = new_run(tmp_path, tokenizer_file)
    by_id = write_docs_part(tmp_path, 0, texts[:HALF])
    first = pack_all(paths)
    before = {info.path: (tmp_path / info.path).read_bytes() for info in first}
    by_id |= write_docs_part(tmp_path, 1, texts[HALF:])
    second = pack_all(paths)
    assert {info.path for info in first} < {info.path for info in second}
    assert all((tmp_path / path).read_bytes() == data for path, data in before.items())
    train_lib = sorted(info.path for info in second if (info.split, info.source) == ("train", "lib"))
    num_old = sum(1 for path in before if "split=train/source=lib/" in path)
    assert len(train_lib) > num_old, "the new part's documents should land in new shards"
    assert train_lib == [f"shards/split=train/source=lib/part-{n:05d}.arrow" for n in range(len(train_lib))]
    assert verify_shards(tmp_path) == []
    found = documents_from_shards(tmp_path, second, eos_id=0)
    assert sorted(found) == sorted(by_id)

    state = tmp_path / "shards/split=train/source=lib/state.json"
    modified = state.stat().st_mtime_ns
    assert pack_split_source(paths, "train", "lib", PACK) == [i for i in second if i.path in train_lib]
    assert state.stat().st_mtime_ns == modified


def test_progress_callback_adds_up_to_the_packed_tokens(tmp_path: Path, texts: list[str], tokenizer_file: Path) -> None:
    paths = new_run(tmp_path, tokenizer_file)
    write_docs_part(tmp_path, 0, texts)
    packed: list[int] = []
    config = PackConfig(seq_len=64, rows_per_shard=32, encode_batch_docs=1)
    infos = pack_split_source(paths, "train", "lib", config, on_progress=packed.append)
    assert len(packed) > 1 and sum(packed) == sum(info.num_tokens for info in infos) > 0


def test_shards_left_by_a_killed_call_are_replaced(tmp_path: Path, texts: list[str], tokenizer_file: Path) -> None:
    paths = new_run(tmp_path, tokenizer_file)
    write_docs_part(tmp_path, 0, texts[:HALF])
    infos = pack_split_source(paths, "train", "lib", PACK)
    folder = tmp_path / "shards/split=train/source=lib"
    reused, stray = folder / f"part-{len(infos):05d}.arrow", folder / "part-00090.arrow"
    for leftover in (reused, stray):
        leftover.write_bytes(b"half a shard from a killed run")
    write_docs_part(tmp_path, 1, texts[HALF:])
    pack_all(paths)
    assert not stray.exists()
    assert reused.read_bytes()[:6] == b"ARROW1"
    assert verify_shards(tmp_path) == []


def test_a_changed_tokenizer_or_seq_len_is_refused(tmp_path: Path, texts: list[str], tokenizer_file: Path) -> None:
    paths = new_run(tmp_path, tokenizer_file)
    write_docs_part(tmp_path, 0, texts[:20])
    pack_split_source(paths, "train", "lib", PACK)
    write_docs_part(tmp_path, 1, texts[20:30])
    with pytest.raises(StageMismatchError, match=r"seq_len=64.*fresh run dir"):
        pack_split_source(paths, "train", "lib", PackConfig(seq_len=128))
    prepare_tokenizer(paths, TokenizerConfig(vocab_size=400), None)
    with pytest.raises(StageMismatchError, match="tokenizer_sha256"):
        pack_split_source(paths, "train", "lib", PACK)


def test_a_long_document_packs_like_its_short_pieces(tmp_path: Path, texts: list[str], tokenizer_file: Path) -> None:
    paths = new_run(tmp_path, tokenizer_file)
    long_text = "".join(texts) * 3  # ~2 MB: encoded in cut pieces, must decode to the whole text
    docs = tmp_path / "docs"
    docs.mkdir()
    row = {"doc_id": 7, "source": "lib", "source_id": None, "uri": "long.py", "text": long_text,
           "num_chars": len(long_text), "content_hash": "x", "split": "train"}
    pq.write_table(pa.Table.from_pylist([row], schema=DOCUMENTS_SCHEMA), docs / "part-00000.parquet")
    finish_docs_part(tmp_path, 0)
    infos = pack_split_source(paths, "train", "lib", PackConfig(seq_len=256, rows_per_shard=512))
    assert len(infos) > 1
    found = documents_from_shards(tmp_path, infos, eos_id=0)
    assert load_tokenizer(paths.tokenizer).decode(found[7]) == unicodedata.normalize("NFC", long_text)


def test_shards_do_not_depend_on_how_a_part_groups_its_rows(tmp_path: Path, texts: list[str],
                                                            tokenizer_file: Path) -> None:
    """Parts whose row groups mix the splits (older ingest) and parts with a split per row group (ingest now)
    pack into the same bytes: each split's documents keep their order either way."""
    mixed = new_run(tmp_path / "mixed", tokenizer_file)
    write_docs_part(mixed.root, 0, texts)
    table = pq.read_table(mixed.docs / "part-00000.parquet")
    apart = new_run(tmp_path / "apart", tokenizer_file)
    apart.docs.mkdir(parents=True)
    with pq.ParquetWriter(apart.docs / "part-00000.parquet", DOCUMENTS_SCHEMA) as writer:
        for split in ("val", "train"):
            rows = table.filter(pa.compute.equal(table.column("split"), split))
            for start in range(0, rows.num_rows, 7):
                writer.write_table(rows.slice(start, 7))
    finish_docs_part(apart.root, 0)
    assert pq.ParquetFile(apart.docs / "part-00000.parquet").num_row_groups > 2
    digests = [{info.path: info.sha256 for info in pack_all(paths)} for paths in (mixed, apart)]
    assert digests[0] == digests[1] and len(digests[0]) > 4


def run_dir_bytes(run_dir: Path) -> dict[str, bytes]:
    return {path.relative_to(run_dir).as_posix(): path.read_bytes() for path in sorted(run_dir.rglob("*"))
            if path.is_file()}


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_damaged_or_deleted_shard_is_packed_again_into_the_bytes_of_an_untouched_run(
        tmp_path: Path, texts: list[str], tokenizer_file: Path) -> None:
    """Issue #34: a re-run used to skip the pair on its marker and leave the shard bad. Two calls (an incremental
    refresh in between): each damaged shard is re-made by the call that wrote it, and the run ends as it was."""
    paths = new_run(tmp_path / "run", tokenizer_file)
    write_docs_part(paths.root, 0, texts[:HALF])
    first = pack_all(paths)
    write_docs_part(paths.root, 1, texts[HALF:])
    second = pack_all(paths)
    untouched = run_dir_bytes(paths.root)
    first_call = [info.path for info in first if info.path.startswith("shards/split=train/source=lib/")]
    second_call = [info.path for info in second if info.path.startswith("shards/split=train/source=lib/")
                   and info.path not in first_call]
    assert first_call and second_call
    flip_a_byte(paths.root / first_call[0])
    (paths.root / second_call[-1]).unlink()
    assert len(verify_shards(paths.root)) == 2

    assert pack_all(paths) == second
    assert verify_shards(paths.root) == []
    assert run_dir_bytes(paths.root) == untouched


def test_a_damaged_shard_of_a_state_without_its_calls_repacks_the_pair(
        tmp_path: Path, texts: list[str], tokenizer_file: Path) -> None:
    """A state written before ``pack_calls`` cannot say which call wrote a shard: the pair is packed over."""
    paths = new_run(tmp_path / "run", tokenizer_file)
    write_docs_part(paths.root, 0, texts[:HALF])
    infos = pack_all(paths)
    state_file = paths.root / "shards/split=train/source=lib/state.json"
    state = read_json(state_file)
    del state["pack_calls"]
    paths.write_json(state_file, state)
    shard = next(info.path for info in infos if info.path.startswith("shards/split=train/source=lib/"))
    before = (paths.root / shard).read_bytes()
    flip_a_byte(paths.root / shard)
    assert pack_all(paths) == infos
    assert (paths.root / shard).read_bytes() == before and verify_shards(paths.root) == []
