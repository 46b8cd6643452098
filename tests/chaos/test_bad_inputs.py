"""Garbage in: a catalogue of broken inputs, each met with one clear line (CLI exit 2, ``error:`` naming the file
or key, no traceback) or with rejects of the right reason, and never a valid record lost.

User-facing errors go through the console script; record-level rejects through the pure stage functions
(plan_ingest / ingest_part / dedupe_stage), which is what the flow's tasks call.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import yaml
import zstandard

from core.errors import ConfigError, ManifestError, SourceReadError
from core.rundir import RunPaths
from core.shards.store import read_shard_index
from flows.recipe import load_recipe, record_recipe
from flows.run_sql import run_query
from pipeline.config import DedupeConfig
from pipeline.dedupe.summary import dedupe_stage
from pipeline.ingest.stage import ingest_part, plan_ingest
from tests.chaos.conftest import (
    build_chaos_corpus,
    record_text,
    tokenmill,
    write_chaos_recipe,
)
from tokenization.config import PackConfig, TokenizerConfig
from tokenization.stage import pack_split_source, write_index
from tokenization.train_tokenizer import prepare_tokenizer, train_tokenizer
from trainer.checkpoint.checkpointer import list_checkpoints

REPO_ROOT = Path(__file__).resolve().parents[2]
RNG_SEED = 11


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit status 2, exactly one ``error:`` line holding every needle, no traceback anywhere."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


# ---- record level: the pure stage functions ------------------------------------------------------


def valid_texts(count: int, start: int = 0) -> list[str]:
    rng = random.Random(RNG_SEED + start)
    return [record_text(rng, number) for number in range(start, start + count)]


def jsonl(texts: list[str]) -> bytes:
    return b"".join(json.dumps({"text": text}).encode() + b"\n" for text in texts)


def parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


@dataclass
class Case:
    """Files to plant, how the source reads them, which rejects must come out and which texts must be kept."""

    files: dict[str, bytes | Callable[[Path], None]]
    valid: list[str]
    rejects: list[tuple[str, str]]
    """(reason, uri) of every expected reject."""
    format: str = "jsonl"
    source: dict[str, Any] = field(default_factory=dict)
    filters: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, bytes] = field(default_factory=dict)
    """uri -> the exact bytes the reject must keep."""
    detail: dict[str, str] = field(default_factory=dict)
    """uri -> a phrase the reject's detail must hold."""


def ingest(root: Path, case: Case) -> Path:
    """Plant the files, then plan, ingest every part and (exact) dedupe: what the prepare flow does first."""
    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    for name, content in case.files.items():
        (corpus / name).parent.mkdir(parents=True, exist_ok=True)
        if callable(content):
            content(corpus / name)
        else:
            (corpus / name).write_bytes(content)
    manifest = root / "manifest.yaml"
    manifest.write_text(yaml.safe_dump({"name": "m", "filters": case.filters, "sources": [
        {"name": "s", "path": "corpus", "format": case.format, **case.source}]}))
    paths = RunPaths(root / "run")
    for part in plan_ingest([manifest], paths, 1 << 20):
        ingest_part(part, 0.0, paths)
    dedupe_stage(paths, DedupeConfig.model_validate({"near": {"enabled": False}}))
    return paths.root


def assert_nothing_valid_lost(run_dir: Path, valid: list[str]) -> None:
    """Every planted valid text is a document (or a duplicate of one): none vanished, none was rejected."""
    kept = run_query(run_dir, "SELECT text FROM documents").column("text").to_pylist()
    assert sorted(kept) == sorted(set(valid))
    num_duplicates = run_query(run_dir, "SELECT count(*) AS n FROM duplicates").column("n").to_pylist()[0]
    assert num_duplicates == len(valid) - len(set(valid))


def truncated_gzip() -> Case:
    """A gzip file cut short: the lines wholly before the cut are kept, the rest is one reject."""
    data = gzip.compress(jsonl(valid_texts(400, 1000)), mtime=0)[:-4000]
    recovered = zlib.decompressobj(wbits=31).decompress(data)
    complete = recovered.count(b"\n")
    kept = valid_texts(400, 1000)[:complete]
    return Case({"cut.jsonl.gz": data, "fine.jsonl": jsonl(valid_texts(5))}, kept + valid_texts(5),
                [("unreadable_file", f"cut.jsonl.gz:{complete + 1}")], source={"on_error": "skip"},
                detail={f"cut.jsonl.gz:{complete + 1}": f"after line {complete}"})


def garbage_zstd() -> Case:
    garbage = random.Random(1).randbytes(3000)
    return Case({"noise.jsonl.zst": garbage, "fine.jsonl.zst": zstandard.compress(jsonl(valid_texts(6)))},
                valid_texts(6), [("unreadable_file", "noise.jsonl.zst")], source={"on_error": "skip"},
                raw={"noise.jsonl.zst": garbage}, detail={"noise.jsonl.zst": "zstd"})


def jsonl_with(bad_line: bytes, reason: str) -> Case:
    """Four valid lines, the bad one third: its reject keeps its exact bytes, its neighbours are kept."""
    texts = valid_texts(4)
    lines = jsonl(texts).splitlines(keepends=True)
    data = b"".join([*lines[:2], bad_line + b"\n", *lines[2:]])
    return Case({"mixed.jsonl": data}, texts, [(reason, "mixed.jsonl:3")], raw={"mixed.jsonl:3": bad_line})


def wrong_types() -> Case:
    texts = valid_texts(3)
    bad = [b'{"text": 42}', b'{"text": ["a", "list"]}', b'{"text": {"nested": "object"}}', b'{"text": true}']
    data = jsonl(texts[:1]) + b"\n".join(bad) + b"\n" + jsonl(texts[1:])
    return Case({"typed.jsonl": data}, texts, [("non_string_text", f"typed.jsonl:{n}") for n in (2, 3, 4, 5)],
                raw={f"typed.jsonl:{n}": line for n, line in zip((2, 3, 4, 5), bad, strict=True)})


def control_characters() -> Case:
    texts = valid_texts(3)
    one_bell = texts[0] + " \x07 " + texts[1]  # one control character in a long text: kept
    binary = "\x00\x01\x02 header " + "\x00" * 200 + " payload"  # mostly NUL/control: rejected
    return Case({"ctl.jsonl": jsonl([one_bell, binary, texts[2]])}, [one_bell, texts[2]], [("binary", "ctl.jsonl:2")],
                detail={"ctl.jsonl:2": "NUL/control"})


def text_files(files: dict[str, bytes], valid: list[str], rejects: list[tuple[str, str]], **kwargs: Any) -> Case:
    return Case(files, valid, rejects, format="text", **kwargs)


def invalid_utf8_text_file() -> Case:
    bad = "déjà vu, encoded as latin-1 by mistake, in a text file".encode("latin-1")
    texts = valid_texts(2)
    return text_files({"latin1.txt": bad, "a.txt": texts[0].encode(), "b.txt": texts[1].encode()}, texts,
                      [("invalid_utf8", "latin1.txt")], raw={"latin1.txt": bad})


def empty_files() -> Case:
    texts = valid_texts(2)
    return text_files({"empty.txt": b"", "blank.txt": b"  \n\t\n", "a.txt": texts[0].encode(),
                       "b.txt": texts[1].encode()}, texts, [("empty", "blank.txt"), ("empty", "empty.txt")])


def empty_jsonl() -> Case:
    return Case({"empty.jsonl": b"", "blank-lines.jsonl": b"\n\n   \n", "fine.jsonl": jsonl(valid_texts(3))},
                valid_texts(3), [])


def huge_document(max_chars: int | None) -> Case:
    """A 50 MB single-line document next to small ones: kept under a limit above it, else too_long (raw kept)."""
    rng = random.Random(5)
    words = [rng.choice(("alpha", "river", "stone", "cloud", "ember", "quartz")) for _ in range(8_400_000)]
    big = " ".join(words)
    assert len(big) > 50_000_000
    small = valid_texts(3)
    line = json.dumps({"text": big}).encode()
    files = {"big.jsonl": line + b"\n" + jsonl(small)}
    if max_chars is None:
        return Case(files, small, [("too_long", "big.jsonl:1")], raw={"big.jsonl:1": line},
                    detail={"big.jsonl:1": "filters.max_chars=2000000"})
    return Case(files, [big, *small], [], filters={"max_chars": max_chars})


def parquet_case(table: pa.Table, rejects: list[tuple[str, str]], also_valid: tuple[str, ...] = (),
                 **kwargs: Any) -> Case:
    good = valid_texts(4)
    return Case({"bad.parquet": parquet_bytes(table), "good.parquet": parquet_bytes(pa.table({"text": good}))},
                [*good, *also_valid], rejects, format="parquet", **kwargs)


def unreadable_file(path: Path) -> None:
    """A file that cannot be read by other users than root (chmod 000)."""
    path.write_text("secret")
    path.chmod(0)


def unreadable_case() -> Case:
    """A file that cannot be read, even by root: chmod 000 for other users; for root, ``/proc/self/mem`` named as
    the source path (a regular file whose read at offset 0 fails with EIO whoever reads it). A link to it inside
    the folder would be an ``outside_source`` reject, never opened."""
    if os.geteuid() != 0:
        return text_files({"locked.txt": unreadable_file, "a.txt": valid_texts(1)[0].encode()}, valid_texts(1),
                          [("unreadable_file", "locked.txt")], source={"on_error": "skip"},
                          detail={"locked.txt": "cannot read"})
    return text_files({}, [], [("unreadable_file", "mem")], source={"on_error": "skip", "path": "/proc/self/mem"},
                      detail={"mem": "cannot read"})


def symlink_loop(path: Path) -> None:
    path.symlink_to(path.with_name("loop-b.txt"))
    path.with_name("loop-b.txt").symlink_to(path)


CASES: dict[str, Callable[[], Case]] = {
    "truncated-gzip": truncated_gzip,
    "garbage-zstd": garbage_zstd,
    "invalid-json-line": lambda: jsonl_with(b'{"text": "no closing quote}', "invalid_json"),
    "json-array-line": lambda: jsonl_with(b'["text", "in", "an", "array"]', "not_an_object"),
    "missing-text-field": lambda: jsonl_with(b'{"body": "the text is under another key"}', "missing_text"),
    "null-text": lambda: jsonl_with(b'{"text": null}', "missing_text"),
    "wrong-typed-text": wrong_types,
    "invalid-utf8-in-jsonl": lambda: jsonl_with(b'{"text": "caf\xe9 au lait, latin-1 bytes"}', "invalid_utf8"),
    "lone-surrogate-escape": lambda: jsonl_with(b'{"text": "broken \\ud800 pair in a long enough text"}',
                                                "invalid_utf8"),
    "whitespace-only-text": lambda: jsonl_with(b'{"text": " \\n\\t \\r\\n "}', "empty"),
    "nul-and-control-characters": control_characters,
    "invalid-utf8-text-file": invalid_utf8_text_file,
    "empty-text-files": empty_files,
    "empty-jsonl-files": empty_jsonl,
    "50mb-document-kept": lambda: huge_document(60_000_000),
    "50mb-document-too-long": lambda: huge_document(None),
    "parquet-wrong-column-type": lambda: parquet_case(
        pa.table({"text": pa.array([7, 8], pa.int64())}),
        [("non_string_text", "bad.parquet#row=0"), ("non_string_text", "bad.parquet#row=1")]),
    "parquet-null-text": lambda: parquet_case(
        pa.table({"text": pa.array([None, "A valid parquet row with enough words in it."])}),
        [("missing_text", "bad.parquet#row=0")], also_valid=("A valid parquet row with enough words in it.",)),
    "parquet-without-text-column": lambda: parquet_case(
        pa.table({"body": ["the text is in the wrong column"]}), [("unreadable_file", "bad.parquet")],
        source={"on_error": "skip"}, detail={"bad.parquet": "has no column 'text'"}),
    "not-parquet-named-parquet": lambda: Case(
        {"fake.parquet": b"PAR1 this is plain text pretending to be parquet",
         "good.parquet": parquet_bytes(pa.table({"text": valid_texts(3)}))},
        valid_texts(3), [("unreadable_file", "fake.parquet")], format="parquet", source={"on_error": "skip"},
        raw={"fake.parquet": b"PAR1 this is plain text pretending to be parquet"},
        detail={"fake.parquet": "not a Parquet file"}),
    "unreadable-file": unreadable_case,
    "symlink-loop-in-folder": lambda: text_files(
        {"loop-a.txt": symlink_loop, "a.txt": valid_texts(1)[0].encode()}, valid_texts(1), []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_broken_records_are_rejected_with_their_reason_and_nothing_valid_is_lost(tmp_path: Path, name: str) -> None:
    case = CASES[name]()
    run_dir = ingest(tmp_path, case)
    rejects = run_query(run_dir, "SELECT reason, uri, detail, raw FROM rejects ORDER BY uri").to_pylist()
    assert sorted((row["reason"], row["uri"]) for row in rejects) == sorted(case.rejects)
    by_uri = {row["uri"]: row for row in rejects}
    for uri, raw in case.raw.items():
        assert by_uri[uri]["raw"] == raw, f"{uri}: the reject must keep the original bytes"
    for uri, phrase in case.detail.items():
        assert phrase in by_uri[uri]["detail"], by_uri[uri]["detail"]
    assert all(row["detail"] and "\n" not in row["detail"] for row in rejects)
    assert_nothing_valid_lost(run_dir, case.valid)


@pytest.mark.parametrize("name", ["parquet-without-text-column", "unreadable-file", "garbage-zstd"])
def test_unreadable_file_with_on_error_fail_is_one_line_naming_the_file(tmp_path: Path, name: str) -> None:
    case = CASES[name]()
    case.source["on_error"] = "fail"
    with pytest.raises(SourceReadError) as raised:
        ingest(tmp_path, case)
    bad_file = next(uri for _, uri in case.rejects)
    message = str(raised.value)
    assert "\n" not in message and bad_file in message and "on_error: skip" in message


def test_vocab_above_65536_selects_uint32_shards(tmp_path: Path) -> None:
    texts = valid_texts(40)
    run_dir = ingest(tmp_path, Case({"notes.jsonl": jsonl(texts)}, texts, []))
    tokenizer = train_tokenizer(texts, 400)
    tokenizer.add_special_tokens(["<|endoftext|>", "<|pad|>"])
    tokenizer.add_tokens([f"<extra_{number}>" for number in range(70_000)])
    given = tmp_path / "big-vocab-tokenizer.json"
    tokenizer.save(str(given))
    paths = RunPaths(run_dir)
    summary = prepare_tokenizer(paths, TokenizerConfig(path=str(given)), given)
    assert summary["vocab_size"] > 1 << 16
    pack_split_source(paths, "train", "s", PackConfig(seq_len=16, rows_per_shard=32))
    infos = write_index(paths)
    assert infos
    for info in infos:
        with pa.memory_map(str(run_dir / info.path)) as source:
            schema = ipc.open_file(source).schema
        assert schema.field("input_ids").type.value_type == pa.uint32()
        assert schema.metadata[b"dtype"] == b"uint32"
    from core.shards.store import verify_shards

    assert verify_shards(run_dir) == []


def test_same_source_name_in_two_manifests_is_one_line_naming_both(tmp_path: Path) -> None:
    (tmp_path / "corpus").mkdir()
    for name in ("one", "two"):
        (tmp_path / f"{name}.yaml").write_text("name: m\nsources: [{name: s, path: corpus, format: text}]\n")
    with pytest.raises(ManifestError) as raised:
        plan_ingest([tmp_path / "one.yaml", tmp_path / "two.yaml"], RunPaths(tmp_path / "run"), 1 << 20)
    message = str(raised.value)
    assert "\n" not in message and "one.yaml" in message and "two.yaml" in message and "'s'" in message


@pytest.mark.parametrize("section", ["data", "dedupe", "tokenizer", "pack"])
def test_changed_data_section_names_the_keys_and_says_use_another_run_dir(tmp_path: Path, section: str) -> None:
    recipe = write_chaos_recipe(tmp_path, build_chaos_corpus(tmp_path))
    original = recipe.read_text()
    record_recipe(*load_recipe(recipe), tmp_path / "run")
    key, value = {"data": ("val_fraction", 0.2), "dedupe": ("exact", False), "tokenizer": ("vocab_size", 600),
                  "pack": ("seq_len", 128)}[section]
    data = yaml.safe_load(original)
    data[section][key] = value
    recipe.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as raised:
        record_recipe(*load_recipe(recipe), tmp_path / "run")
    message = str(raised.value)
    assert "\n" not in message and f"{section}.{key}" in message and "another --run-dir" in message
    data = yaml.safe_load(original)
    data["train"]["max_steps"] = 99  # the train and model sections may change between runs
    recipe.write_text(yaml.safe_dump(data))
    record_recipe(*load_recipe(recipe), tmp_path / "run")


# ---- user-facing errors through the console script -----------------------------------------------


MANIFEST = "name: m\nsources: [{name: s, path: corpus, format: text}]\n"
RECIPE = "name: x\ndata: {manifests: [m.yaml]}\ntokenizer: {vocab_size: 512}\n"


def recipe_with(**sections: dict[str, Any]) -> str:
    data = yaml.safe_load(RECIPE)
    for section, values in sections.items():
        data[section] = {**(data.get(section) or {}), **values}
    return yaml.safe_dump(data)


def manifest_with_source(**source: Any) -> str:
    return yaml.safe_dump({"name": "m", "sources": [{"name": "s", "path": "corpus", "format": "text", **source}]})


def make_loop(root: Path) -> None:
    (root / "loop").symlink_to(root / "loop")


CLI_CASES: dict[str, tuple[str, str, tuple[str, ...], Callable[[Path], None] | None]] = {
    # name: (recipe text, manifest text, phrases the error line must hold, extra setup)
    "recipe-yaml-syntax": ("name: x\ndata: {manifests: [m.yaml]\n", MANIFEST, ("recipe.yaml", "invalid YAML"), None),
    "manifest-yaml-syntax": (RECIPE, "name: m\nsources: [{name: s, path: corpus\n",
                             ("m.yaml", "invalid YAML"), None),
    "recipe-not-a-mapping": ("- just\n- a list\n", MANIFEST, ("recipe.yaml", "mapping"), None),
    "unknown-recipe-section": (RECIPE + "tokeniser: {vocab_size: 512}\n", MANIFEST,
                               ("recipe.yaml", "tokeniser: unknown key"), None),
    "misspelt-recipe-key": (recipe_with(pack={"seq_length": 64}), MANIFEST,
                            ("recipe.yaml", "pack.seq_length: unknown key"), None),
    "unknown-manifest-key": (RECIPE, manifest_with_source(encoding="latin-1"),
                             ("m.yaml", "sources.0.encoding: unknown key"), None),
    "unknown-manifest-filter": (RECIPE, MANIFEST + "filters: {max_charz: 10}\n",
                                ("m.yaml", "filters.max_charz: unknown key"), None),
    "unknown-language-code": (RECIPE, MANIFEST + "filters: {language: {allowed: [en, xx]}}\n",
                              ("m.yaml", "filters.language.allowed: unknown language code(s) ['xx']"), None),
    "language-min-score-above-1": (RECIPE, MANIFEST + "filters: {language: {allowed: [en], min_score: 1.5}}\n",
                                   ("m.yaml", "filters.language.min_score", "less than or equal to 1"), None),
    "classifier-not-a-model": (RECIPE, MANIFEST + "filters: {quality_classifier: {path: corpus/a.txt}}\n",
                               ("m.yaml", "filters.quality_classifier.path 'corpus/a.txt'", "not a fastText model"),
                               None),
    "classifier-min-score-above-1": (RECIPE, MANIFEST + "filters: {quality_classifier: {path: x.bin, min_score: 2}}\n",
                                     ("m.yaml", "filters.quality_classifier.min_score", "less than or equal to 1"),
                                     None),
    "seq-len-zero": (recipe_with(pack={"seq_len": 0}), MANIFEST, ("recipe.yaml", "pack.seq_len"), None),
    "vocab-size-zero": (recipe_with(tokenizer={"vocab_size": 0}), MANIFEST, ("tokenizer.vocab_size",), None),
    "micro-batch-zero": (recipe_with(train={"micro_batch_size": 0}), MANIFEST, ("train.micro_batch_size",), None),
    "lr-negative": (recipe_with(train={"lr": -0.001}), MANIFEST, ("train.lr",), None),
    "max-steps-negative": (recipe_with(train={"max_steps": -5}), MANIFEST, ("train.max_steps",), None),
    "rows-per-shard-zero": (recipe_with(pack={"rows_per_shard": 0}), MANIFEST, ("pack.rows_per_shard",), None),
    "part-size-zero": (recipe_with(data={"part_size_bytes": 0}), MANIFEST, ("data.part_size_bytes",), None),
    "missing-source-path": (RECIPE, manifest_with_source(path="nowhere"),
                            ("m.yaml", "sources[s].path 'nowhere' does not exist"), None),
    "dotdot-path-outside-missing": (RECIPE, manifest_with_source(path="../../no-such-folder/data"),
                                    ("m.yaml", "'../../no-such-folder/data' does not exist", "resolved to"), None),
    "hub-url-in-manifest": (RECIPE, manifest_with_source(path="hf://datasets/HuggingFaceFW/fineweb", format="hf_disk"),
                            ("m.yaml", "local files only"), None),
    "hub-name-in-manifest": (RECIPE, manifest_with_source(path="HuggingFaceFW/fineweb-edu", format="hf_disk"),
                             ("m.yaml", "never downloads hub datasets"), None),
    "source-name-with-slashes": (RECIPE, manifest_with_source(name="../evil"), ("m.yaml", "sources.0.name"), None),
    "missing-manifest": (recipe_with(data={"manifests": ["nope.yaml"]}), MANIFEST, ("nope.yaml", "does not exist"),
                         None),
    "manifest-is-a-folder": (recipe_with(data={"manifests": ["corpus"]}), MANIFEST,
                             ("recipe.yaml", "corpus is a folder"), None),
    "tokenizer-path-is-a-folder": (yaml.safe_dump({"name": "x", "data": {"manifests": ["m.yaml"]},
                                                   "tokenizer": {"path": "corpus"}}), MANIFEST,
                                   ("tokenizer.path", "corpus is a folder"), None),
    "missing-tokenizer-path": (yaml.safe_dump({"name": "x", "data": {"manifests": ["m.yaml"]},
                                               "tokenizer": {"path": "tok/tokenizer.json"}}), MANIFEST,
                               ("tokenizer.path", "tokenizer.json"), None),
    "symlink-loop-source-path": (RECIPE, manifest_with_source(path="loop"), ("m.yaml", "loop"), make_loop),
    "weight-inf": (RECIPE, MANIFEST.replace("format: text", "format: text, weight: .inf"),
                   ("m.yaml", "sources.0.weight: must be a finite number, got inf"), None),
    "weight-nan": (RECIPE, MANIFEST.replace("format: text", "format: text, weight: .nan"),
                   ("m.yaml", "sources.0.weight: must be a finite number, got nan"), None),
    "weight-negative": (RECIPE, manifest_with_source(weight=-1), ("m.yaml", "sources.0.weight", "greater than 0"),
                        None),
    "lr-inf": (RECIPE + "train: {lr: .inf}\n", MANIFEST, ("recipe.yaml", "train.lr: must be a finite number"), None),
    "glob-bad-range": (RECIPE, manifest_with_source(glob="[z-a]*.txt"),
                       ("m.yaml", "sources.0.glob: '[z-a]*.txt' is not a valid glob (bad character range z-a)"), None),
    "exclude-bad-range": (RECIPE, manifest_with_source(exclude=["**/*.bak", "[9-0]*"]),
                          ("m.yaml", "sources.0.exclude: '[9-0]*' is not a valid glob"), None),
    "seed-negative": (recipe_with(train={"seed": -1}), MANIFEST,
                      ("recipe.yaml", "train.seed", "greater than or equal to 0"), None),
    "seed-above-64-bits": (recipe_with(train={"seed": 2**64}), MANIFEST,
                           ("recipe.yaml", "train.seed", "less than or equal"), None),
    "recipe-nested-too-deeply": ("name: " + "[" * 5000 + "]" * 5000 + "\n", MANIFEST,
                                 ("recipe.yaml", "nested too deeply"), None),
    "recipe-a-number": ("42\n", MANIFEST, ("recipe.yaml", "must be a YAML mapping", "got a number"), None),
    "glob-typo-only-source": (RECIPE, manifest_with_source(glob="*.txet"),
                              ("m.yaml", "sources[s] matches no file: glob '*.txet' under", "corpus;",
                               "did you mean glob '*.txt'?"), None),
    "glob-typo-second-source": (RECIPE, yaml.safe_dump({"name": "m", "sources": [
        {"name": "s", "path": "corpus", "format": "text"},
        {"name": "t", "path": "corpus", "format": "jsonl", "glob": "*.jsnol"}]}),
        ("m.yaml", "sources[t] matches no file: glob '*.jsnol'", "the files there end in .txt (1)"), None),
}


@pytest.mark.parametrize("name", list(CLI_CASES))
def test_bad_recipe_or_manifest_is_one_line_naming_the_file_and_key(tmp_path: Path, name: str) -> None:
    recipe_text, manifest_text, needles, setup = CLI_CASES[name]
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(valid_texts(1)[0])
    (tmp_path / "m.yaml").write_text(manifest_text)
    (tmp_path / "recipe.yaml").write_text(recipe_text)
    if setup is not None:
        setup(tmp_path)
    result = tokenmill("prepare", tmp_path / "recipe.yaml", "--run-dir", tmp_path / "run", timeout=120)
    line = assert_one_line_error(result, *needles)
    assert result.stderr.strip() == line, "nothing but the error line"
    assert not (tmp_path / "run" / "docs").exists(), "nothing was ingested"


# ---- user-facing errors found while the flow runs (needs the Prefect test server) ----------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, cli_env: dict[str, str]) -> tuple[Path, Path]:
    """(recipe, run dir) of the chaos recipe, prepared once through the CLI; tests work on copies."""
    root = tmp_path_factory.mktemp("bad-prepared")
    recipe = write_chaos_recipe(root, build_chaos_corpus(root), train={"max_steps": 10})
    result = tokenmill("prepare", recipe, "--run-dir", root / "run", env=cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    return recipe, root / "run"


@pytest.mark.slow
def test_corrupt_tokenizer_json_is_one_line_naming_it(tmp_path: Path, cli_env: dict[str, str]) -> None:
    recipe = write_chaos_recipe(tmp_path, build_chaos_corpus(tmp_path))
    (tmp_path / "tok.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": [1, 2')
    data = yaml.safe_load(recipe.read_text())
    data["tokenizer"] = {"path": "tok.json"}
    recipe.write_text(yaml.safe_dump(data))
    result = tokenmill("prepare", recipe, "--run-dir", tmp_path / "run", env=cli_env)
    assert_one_line_error(result, "tok.json", "not a valid tokenizer.json")
    assert not (tmp_path / "run" / "shards" / "index.parquet").exists()


@pytest.mark.slow
def test_garbage_zstd_with_on_error_fail_stops_the_flow_with_one_line(tmp_path: Path, cli_env: dict[str, str]) -> None:
    corpus = build_chaos_corpus(tmp_path)
    (corpus / "records" / "noise.jsonl.zst").write_bytes(random.Random(3).randbytes(5000))
    recipe = write_chaos_recipe(tmp_path, corpus)
    result = tokenmill("prepare", recipe, "--run-dir", tmp_path / "run", env=cli_env)
    assert_one_line_error(result, "noise.jsonl.zst", "on_error: skip")
    assert result.stderr.count("Retry") == 0, "bad input is not retried"


@pytest.mark.slow
def test_changed_recipe_on_a_prepared_run_dir_is_one_line_naming_the_keys(
        tmp_path: Path, prepared: tuple[Path, Path], cli_env: dict[str, str]) -> None:
    recipe, run_dir = prepared
    shutil.copytree(run_dir, tmp_path / "run")
    data = yaml.safe_load(recipe.read_text())
    data["dedupe"]["near"]["threshold"] = 0.7
    data["pack"]["seq_len"] = 128
    changed = recipe.with_name(f"changed-{tmp_path.name}.yaml")
    changed.write_text(yaml.safe_dump(data))
    before = {path: path.read_bytes() for path in (tmp_path / "run").rglob("*") if path.is_file()}
    result = tokenmill("prepare", changed, "--run-dir", tmp_path / "run", env=cli_env)
    assert_one_line_error(result, "the recipe changed", "dedupe.near", "pack.seq_len", "another --run-dir")
    after = {path: path.read_bytes() for path in (tmp_path / "run").rglob("*") if path.is_file()}
    assert {path: data for path, data in after.items() if path.name != ".lock"} == \
        {path: data for path, data in before.items() if path.name != ".lock"}, "the run dir is unchanged"


@pytest.mark.slow
def test_shard_with_a_flipped_byte_fails_verify_and_train_refuses_it(
        tmp_path: Path, prepared: tuple[Path, Path], cli_env: dict[str, str]) -> None:
    recipe, source = prepared
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    shard = run_dir / sorted(info.path for info in read_shard_index(run_dir) if info.split == "train")[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    relpath = shard.relative_to(run_dir).as_posix()

    verified = tokenmill("shards", "verify", run_dir)
    assert verified.returncode == 1
    assert f"FAULT {relpath}: sha256 differs" in verified.stdout and "Traceback" not in verified.stderr

    trained = tokenmill("train", recipe, "--run-dir", run_dir, env=cli_env)
    assert_one_line_error(trained, relpath, "sha256")

    # Issue #34: a re-run of prepare skipped the pack stage on its marker and left the shard bad.
    rebuilt = tokenmill("prepare", recipe, "--run-dir", run_dir, env=cli_env)
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    assert tokenmill("shards", "verify", run_dir).returncode == 0

    def shard_files(root: Path) -> dict[str, bytes]:
        return {path.relative_to(root).as_posix(): path.read_bytes() for path in sorted((root / "shards").rglob("*"))
                if path.is_file()}

    assert shard_files(run_dir) == shard_files(source), "as the untouched run: shards, states and index"
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "model").exists()


@pytest.mark.slow
def test_checkpoint_with_a_flipped_byte_resumes_from_the_previous_one_with_a_warning(
        tmp_path: Path, prepared: tuple[Path, Path], cli_env: dict[str, str]) -> None:
    recipe, source = prepared
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    first = subprocess.run([sys.executable, "-m", "trainer.train", "--run-dir", str(run_dir), "--until-step", "10"],
                           capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert [step for step, _ in list_checkpoints(run_dir / "checkpoints")] == [5, 10]
    weights = run_dir / "checkpoints" / "step-0000010" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))

    longer = recipe.with_name(f"longer-{tmp_path.name}.yaml")
    longer.write_text(recipe.read_text().replace("max_steps: 10", "max_steps: 15"))
    result = tokenmill("train", longer, "--run-dir", run_dir, env=cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    warnings = [line for line in output.splitlines() if "skipping checkpoint" in line]
    assert len(warnings) == 1 and "step-0000010" in warnings[0] and "sha256" in warnings[0]
    assert "Resuming from checkpoint at step 5" in output
    assert (run_dir / "checkpoints" / "step-0000010.invalid").is_dir(), "the bad one is set aside for inspection"
    assert [step for step, _ in list_checkpoints(run_dir / "checkpoints")] == [10, 15]
    assert json.loads((run_dir / "model" / "training_state.json").read_text())["step"] == 15
