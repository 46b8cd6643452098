"""pipeline/filters/quality_classifier.py, pipeline/filters/fasttext_file.py and the ``quality_classifier`` filter on
real text.

Two kinds of local text a classifier can tell apart: English manual pages (``/usr/share/man/man*``, the kind to
keep) and Python standard-library source files (the kind to drop). A model is trained once through the
``tokenmill classifier train`` console script and used in real ingest runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from benchmarks.corpus import man_page_texts
from core.errors import ConfigError, ManifestError
from core.rundir import RunPaths
from flows.recipe import refuse_changed_recipe, resolve_run
from flows.run_sql import run_query
from flows.up_to_date import sealed_summary, write_seal
from pipeline.filters.fasttext_file import NotAFastTextModel, read_model_info
from pipeline.filters.language import model_path
from pipeline.filters.quality_classifier import (
    ClassifierTrainingConfig,
    QualityClassifier,
    classifier_text,
    read_examples,
    train_classifier,
)
from pipeline.ingest.stage import ingest_part, parts_to_ingest, plan_ingest
from pipeline.manifest import load_manifest, portable_manifest
from tests.flows.conftest import write_small_recipe
from tests.flows.test_up_to_date import prepare_in_process

TOKENMILL = str(Path(sys.executable).parent / "tokenmill")
STDLIB = Path(sysconfig.get_paths()["stdlib"])
NUM_TRAIN = 60
"""Examples of each kind to train on."""
NUM_CORPUS = 20
"""Documents of each kind in the corpus the trained model filters (none of them among the examples)."""


@dataclass(frozen=True)
class Trained:
    root: Path
    positive: Path
    negative: Path
    model: Path
    corpus: Path
    output: str
    """What ``tokenmill classifier train`` printed."""


def code_files() -> list[Path]:
    """Standard-library modules with some body (a tiny ``__init__``-like file says little about its kind)."""
    return [path for path in sorted(STDLIB.glob("*.py")) if path.stat().st_size > 2000][:NUM_TRAIN + NUM_CORPUS]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    root = tmp_path_factory.mktemp("classifier")
    pages = man_page_texts("en", NUM_TRAIN + NUM_CORPUS, min_words=150)
    code = code_files()
    assert len(pages) == len(code) == NUM_TRAIN + NUM_CORPUS, "too few manual pages or stdlib modules"
    positive = root / "man"  # a folder, one document per file
    positive.mkdir()
    for name, text in pages[:NUM_TRAIN]:
        (positive / f"{name}.txt").write_text(text, encoding="utf-8")
    negative = root / "code.jsonl"  # JSONL, one document per line
    negative.write_text("".join(json.dumps({"text": path.read_text(encoding="utf-8")}) + "\n"
                                for path in code[:NUM_TRAIN]), encoding="utf-8")
    corpus = root / "corpus"
    (corpus / "man").mkdir(parents=True)
    (corpus / "code").mkdir()
    for name, text in pages[NUM_TRAIN:]:
        (corpus / "man" / f"{name}.txt").write_text(text, encoding="utf-8")
    for path in code[NUM_TRAIN:]:
        shutil.copy(path, corpus / "code" / path.name)
    model = root / "models" / "quality.bin"
    result = subprocess.run([TOKENMILL, "classifier", "train", str(positive), str(negative), "--out", str(model)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return Trained(root, positive, negative, model, corpus, result.stdout)


def write_manifest(folder: Path, corpus: Path, quality_classifier: dict) -> Path:
    manifest = folder / "m.yaml"
    manifest.write_text(yaml.safe_dump({"name": "m", "sources": [{"name": "mixed", "path": str(corpus),
                                                                  "format": "text"}],
                                        "filters": {"quality_classifier": quality_classifier}}), encoding="utf-8")
    return manifest


def ingest(manifest: Path, run_dir: Path) -> RunPaths:
    paths = RunPaths(run_dir)
    for part in plan_ingest([manifest], paths, 32 << 20):
        ingest_part(part, 0.0, paths)
    return paths


def test_train_command_prints_one_line_and_writes_a_classifier(trained: Trained) -> None:
    match = re.fullmatch(rf"wrote {re.escape(str(trained.model))}: {NUM_TRAIN} positive and {NUM_TRAIN} negative "
                         r"examples, held-out accuracy (\S+) on (\d+), trained in \S+ s\n", trained.output)
    assert match is not None, trained.output
    assert float(match[1]) >= 0.8 and int(match[2]) >= 10  # measured 0.929 on 14 (one man page of code)
    info = read_model_info(trained.model)
    assert info.is_classifier and set(info.labels) == {"__label__positive", "__label__negative"}


def test_ingest_rejects_the_negative_kind_as_quality_classifier(trained: Trained, tmp_path: Path) -> None:
    model = os.path.relpath(trained.model, tmp_path)  # relative to the manifest's folder
    manifest = write_manifest(tmp_path, trained.corpus, {"path": model, "min_score": 0.5})
    paths = ingest(manifest, tmp_path / "run")
    kept = run_query(paths.root, "SELECT uri FROM documents").column("uri").to_pylist()
    rejects = run_query(paths.root, "SELECT uri, reason, CAST(regexp_extract(detail, 'score=(\\S+);', 1) AS DOUBLE) "
                                    "AS score, detail FROM rejects").to_pylist()
    assert {row["reason"] for row in rejects} == {"quality_classifier"}
    assert all(row["score"] < 0.5 and "filters.quality_classifier label=positive" in row["detail"] for row in rejects)
    assert sum(uri.startswith("man/") for uri in kept) >= 0.85 * NUM_CORPUS
    assert sum(row["uri"].startswith("code/") for row in rejects) >= 0.85 * NUM_CORPUS
    assert len(kept) + len(rejects) == 2 * NUM_CORPUS  # every document once


def test_min_score_decides_and_a_label_may_carry_the_prefix(trained: Trained, tmp_path: Path) -> None:
    """min_score 0 keeps everything; scoring the negative label keeps the code and drops the pages."""
    keep_all = ingest(write_manifest(tmp_path, trained.corpus, {"path": str(trained.model), "min_score": 0.0}),
                      tmp_path / "all")
    assert run_query(keep_all.root, "SELECT count(*) AS n FROM documents").column("n")[0].as_py() == 2 * NUM_CORPUS
    (tmp_path / "m.yaml").unlink()
    inverted = ingest(write_manifest(tmp_path, trained.corpus, {"path": str(trained.model),
                                                                "label": "__label__negative"}), tmp_path / "inv")
    kept = run_query(inverted.root, "SELECT uri FROM documents").column("uri").to_pylist()
    assert sum(uri.startswith("code/") for uri in kept) >= 0.85 * NUM_CORPUS
    assert sum(uri.startswith("man/") for uri in kept) <= 0.15 * NUM_CORPUS


def test_training_is_deterministic_and_the_model_predicts_the_same_in_fasttext_predict(trained: Trained,
                                                                                       tmp_path: Path) -> None:
    import fasttext_new

    again = train_classifier(trained.positive, trained.negative, tmp_path / "again.bin")
    assert again.num_positive == again.num_negative == NUM_TRAIN
    assert (tmp_path / "again.bin").read_bytes() == trained.model.read_bytes()
    trainer, predictor = fasttext_new.load_model(str(trained.model)), QualityClassifier(trained.model)._model
    for path in sorted(trained.corpus.glob("*/*"))[::4]:
        text = classifier_text(path.read_text(encoding="utf-8"))
        by_trainer, by_predictor = trainer.predict(text, k=-1), predictor.predict(text, k=-1)
        assert list(by_trainer[0]) == list(by_predictor[0])
        assert [float(p) for p in by_trainer[1]] == [float(p) for p in by_predictor[1]]


def test_a_retrained_model_reruns_ingest_breaks_the_seal_and_a_prepared_run_dir_refuses_it(
        trained: Trained, tmp_path: Path) -> None:
    recipe = write_small_recipe(tmp_path, packages=("json",))
    model = tmp_path / "quality.bin"
    shutil.copy(trained.model, model)
    manifest = yaml.safe_load((tmp_path / "manifest.yaml").read_text())
    manifest["filters"] = {"quality_classifier": {"path": "quality.bin", "min_score": 0.0}}
    (tmp_path / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    run = resolve_run(recipe)
    parts = plan_ingest([tmp_path / "manifest.yaml"], run.paths, 32 << 20)
    prepare_in_process(run)  # every prepare stage: the seal holds only while they are all done
    val_fraction = run.recipe.data.val_fraction
    assert write_seal(run, "prepare", {"parts_ingested": len(parts)})
    assert parts_to_ingest(parts, val_fraction, run.paths) == [] and sealed_summary(run, "prepare") is not None

    train_classifier(trained.positive, trained.negative, model, ClassifierTrainingConfig(seed=1, epoch=5))
    assert model.read_bytes() != trained.model.read_bytes()
    assert parts_to_ingest(parts, val_fraction, run.paths) == parts, "every part is filtered again with the new model"
    assert sealed_summary(resolve_run(recipe), "prepare") is None, "as the next command resolves the run"
    with pytest.raises(ConfigError, match=r"manifest corpus 'stdlib-slice': filters\.quality_classifier"):
        refuse_changed_recipe(run.recipe, run.base, run.paths.root)

    shutil.copy(trained.model, model)  # the same content again: nothing to do
    assert parts_to_ingest(parts, val_fraction, run.paths) == []
    assert sealed_summary(resolve_run(recipe), "prepare") is not None


def cut_short(trained: Trained, target: Path) -> None:
    """The first 4,000 bytes of a real model: fastText's own loader reads such a file forever."""
    target.write_bytes(trained.model.read_bytes()[:4000])


def word_vectors(trained: Trained, target: Path) -> None:
    """A real fastText model that is no classifier: skipgram vectors of a slice of the training examples."""
    import fasttext_new

    text = target.with_suffix(".txt")
    text.write_text(trained.negative.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    fasttext_new.train_unsupervised(input=str(text), model="skipgram", dim=8, epoch=1, minCount=1, bucket=1000, minn=0,
                                    maxn=0, thread=1, verbose=0).save_model(str(target))


@pytest.mark.parametrize(("make", "needle"), [
    (lambda trained, target: shutil.copy(STDLIB / "argparse.py", target), "does not start with fastText's magic"),
    (lambda trained, target: target.write_bytes(b""), "the file is empty"),
    (cut_short, "at byte"),  # cut short at byte N, or a word at byte N runs to the end
    (lambda trained, target: target.write_bytes(trained.model.read_bytes() + b"\0"), "1 bytes after the end"),
    (lambda trained, target: None, "cannot be read"),
    (word_vectors, "is a fastText model of word vectors, not a classifier"),
], ids=["python-source", "empty", "cut-short", "trailing-byte", "missing", "word-vectors"])
def test_a_file_that_is_not_a_fasttext_model_is_one_line_naming_the_path(trained: Trained, tmp_path: Path,
                                                                         make, needle: str) -> None:
    make(trained, tmp_path / "model.bin")
    manifest = write_manifest(tmp_path, trained.corpus, {"path": "model.bin"})
    with pytest.raises(ManifestError) as raised:
        load_manifest(manifest)
    message = str(raised.value)
    assert "\n" not in message and "m.yaml: filters.quality_classifier.path 'model.bin'" in message, message
    assert needle in message and "tokenmill classifier train" in message, message


@pytest.mark.parametrize(("settings", "key", "needle"), [
    ({"label": "hq"}, "filters.quality_classifier.label", "it has: negative, positive"),
    ({"min_score": 1.5}, "filters.quality_classifier.min_score", "less than or equal to 1"),
    ({"min_score": -0.1}, "filters.quality_classifier.min_score", "greater than or equal to 0"),
    ({"sha256": "0" * 64}, "filters.quality_classifier.sha256", "the model changed"),
    ({"min_scor": 0.5}, "filters.quality_classifier.min_scor", "unknown key"),
])
def test_bad_classifier_settings_are_one_line_naming_the_key(trained: Trained, tmp_path: Path, settings: dict,
                                                             key: str, needle: str) -> None:
    manifest = write_manifest(tmp_path, trained.corpus, {"path": str(trained.model), **settings})
    with pytest.raises(ManifestError) as raised:
        load_manifest(manifest)
    message = str(raised.value)
    assert "\n" not in message and f"m.yaml: {key}" in message and needle in message, message


def test_a_pinned_sha256_that_matches_loads(trained: Trained, tmp_path: Path) -> None:
    checked = load_manifest(write_manifest(tmp_path, trained.corpus, {"path": str(trained.model)}))
    sha256 = checked.filters.quality_classifier.sha256
    (tmp_path / "m.yaml").unlink()
    pinned = load_manifest(write_manifest(tmp_path, trained.corpus, {"path": str(trained.model), "sha256": sha256}))
    assert pinned.filters.quality_classifier.model_file() == trained.model
    recorded = portable_manifest(pinned).filters.quality_classifier  # as run.yaml holds it: no absolute path
    assert recorded.path.startswith("sha256:") and recorded.sha256 == sha256


def test_the_quantized_language_model_reads_as_a_classifier_and_word_lengths_are_checked(tmp_path: Path) -> None:
    info = read_model_info(model_path())  # lid.176.ftz: quantized matrices, a pruned dictionary
    assert info.is_classifier and len(info.labels) == 176 and "__label__en" in info.labels
    data = bytearray(model_path().read_bytes())
    data[8:12] = (-16).to_bytes(4, "little", signed=True)  # the dimension
    (tmp_path / "bad.ftz").write_bytes(bytes(data))
    with pytest.raises(NotAFastTextModel, match="dimension -16"):
        read_model_info(tmp_path / "bad.ftz")


def bad_examples(root: Path, kind: str) -> Path:
    """A positive example set that cannot be trained on, of each kind."""
    if kind == "missing":
        return root / "nowhere"
    if kind == "empty-folder":
        (root / "empty").mkdir()
        return root / "empty"
    if kind == "jsonl-without-text":
        (root / "x.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
        return root / "x.jsonl"
    if kind == "jsonl-not-json":
        (root / "y.jsonl").write_text("not json\n")
        return root / "y.jsonl"
    (root / "z").mkdir()
    (root / "z" / "a.txt").write_bytes(b"caf\xe9")  # Latin-1
    return root / "z"


@pytest.mark.parametrize(("kind", "needle"), [
    ("missing", "nowhere: no such file or folder of examples"),
    ("empty-folder", "empty: no positive examples"),
    ("jsonl-without-text", "x.jsonl:2: no string field 'text'"),
    ("jsonl-not-json", "y.jsonl:1: not a JSON object"),
    ("not-utf8", "a.txt: not UTF-8"),
])
def test_bad_examples_are_one_line_naming_the_file(trained: Trained, tmp_path: Path, kind: str, needle: str) -> None:
    with pytest.raises(ConfigError) as raised:
        train_classifier(bad_examples(tmp_path, kind), trained.negative, tmp_path / "m.bin")
    assert needle in str(raised.value) and "\n" not in str(raised.value), raised.value
    assert not (tmp_path / "m.bin").exists()


def test_examples_are_read_per_file_in_a_folder_and_per_line_in_a_file(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("first line\n\nsecond   line\n")
    (tmp_path / "docs" / "b.jsonl").write_text('{"text": "one"}\n\n{"text": "two\\nlines"}\n')
    (tmp_path / "lines.txt").write_text("one example\n\nanother example\n")
    assert read_examples(tmp_path / "docs") == ["first line second line", "one", "two lines"]
    assert read_examples(tmp_path / "lines.txt") == ["one example", "another example"]
