"""Web-grade quality filters: tokenmill's (``pipeline.filters.web_filters``) against datatrove 0.10's classes, and
ingest's speed with all four on.

The documents are Debian's package documentation (read-me, news, change logs, licences), English manual pages and
the standard library's docstrings, each cut to ``--max-chars`` and normalised. Costs are CPU seconds per filter,
words included (datatrove splits words with spaCy; its per-text cache is cleared between filters, so each pays for
its own words, as tokenmill's would alone); "all four" runs them per document as a pipeline does, where both share
one word split. Ingest MB/s is the text files' bytes over the wall time of planning and ingesting them in this
process, default filters against all four on, after an untimed warm-up ingest (imports, compiled kernels).

Run from the repo root: ``.venv/bin/python -m benchmarks.web_filters``. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from benchmarks.corpus import debian_doc_texts, man_page_texts, stdlib_docstring_texts
from benchmarks.result import print_result
from core.rundir import RunPaths
from pipeline.filters.normalisation import normalise_text
from pipeline.filters.web_filter_config import C4Config, FineWebConfig, GopherQualityConfig, GopherRepetitionConfig
from pipeline.filters.web_filters import c4_failure, fineweb_failure, gopher_quality_failure, gopher_repetition_failure
from pipeline.filters.words import split_words
from pipeline.ingest.stage import ingest_part, plan_ingest

FILTERS = ("gopher_repetition", "gopher_quality", "c4", "fineweb")


def load_documents(num_docs: int, max_chars: int) -> list[str]:
    """Normalised texts: three Debian documents to each manual page or docstring text, up to ``num_docs``."""
    prose = [text for _, text in man_page_texts("en", num_docs // 8)]
    prose += stdlib_docstring_texts(num_docs * 4000, min_words=20)[:num_docs // 8]
    texts = [text for _, text in debian_doc_texts(num_docs - len(prose))] + prose
    return [text for text in (normalise_text(text[:max_chars]) for text in texts) if text]


def our_filters() -> dict[str, Callable[[str, list[str]], object]]:
    configs = (GopherRepetitionConfig(), GopherQualityConfig(), C4Config(), FineWebConfig())
    return {"gopher_repetition": lambda text, words: gopher_repetition_failure(text, words, configs[0]),
            "gopher_quality": lambda text, words: gopher_quality_failure(text, words, configs[1]),
            "c4": lambda text, words: c4_failure(text, configs[2]),
            "fineweb": lambda text, words: fineweb_failure(text, words, configs[3])}


def datatrove_filters() -> dict[str, Callable[[str], object]]:
    try:
        from datatrove.data import Document
        from datatrove.pipeline.filters import (
            C4QualityFilter,
            FineWebQualityFilter,
            GopherQualityFilter,
            GopherRepetitionFilter,
        )
    except ImportError:
        raise SystemExit("benchmarks.web_filters compares with datatrove: pip install -e '.[peers]'") from None
    instances = {"gopher_repetition": GopherRepetitionFilter(), "gopher_quality": GopherQualityFilter(),
                 "c4": C4QualityFilter(), "fineweb": FineWebQualityFilter()}
    return {name: (lambda text, instance=instance: instance.filter(Document(text=text, id="0")))
            for name, instance in instances.items()}


def time_ours(texts: list[str], names: tuple[str, ...]) -> float:
    """CPU seconds to split each text into words once and run the ``names`` filters on it."""
    filters = our_filters()
    started = time.process_time()
    for text in texts:
        words = split_words(text)
        for name in names:
            filters[name](text, words)
    return time.process_time() - started


def time_datatrove(texts: list[str], names: tuple[str, ...]) -> float:
    """CPU seconds for datatrove's ``names`` filters per text (its word cache cleared first, kept within a text)."""
    from datatrove.utils.text import split_into_parts

    filters = datatrove_filters()
    filters[names[0]]("Warm up spaCy's English tokenizer. It loads on first use.")
    split_into_parts.cache_clear()
    started = time.process_time()
    for text in texts:
        for name in names:
            filters[name](text)
    return time.process_time() - started


def ingest_mb_per_s(texts: list[str], filters: dict, folder: Path) -> float:
    """MB/s of planning and ingesting ``texts`` (one text file each) with ``filters``, in this process."""
    corpus = folder / "corpus"
    if not corpus.is_dir():
        corpus.mkdir(parents=True)
        for index, text in enumerate(texts):
            (corpus / f"{index:06d}.txt").write_text(text, encoding="utf-8")
    manifest = folder / f"web-{len(filters)}.yaml"
    manifest.write_text(yaml.safe_dump({"name": "web", "sources": [{"name": "web", "path": "corpus",
                                                                      "format": "text"}], "filters": filters}))
    num_bytes = sum(path.stat().st_size for path in corpus.iterdir())
    paths = RunPaths(folder / f"run-{len(filters)}")
    started = time.perf_counter()
    for part in plan_ingest([manifest], paths, 64 << 20):
        ingest_part(part, 0.0, paths)
    return num_bytes / 1e6 / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="80 documents of at most 2,000 characters (seconds)")
    parser.add_argument("--docs", type=int, default=None, help="documents, at most (default 1,200)")
    parser.add_argument("--max-chars", type=int, default=None, help="characters kept of each (default 20,000)")
    args = parser.parse_args(argv)
    texts = load_documents(args.docs or (80 if args.quick else 1200), args.max_chars or (2000 if args.quick else 20000))
    num_mb = sum(len(text.encode("utf-8")) for text in texts) / 1e6
    print(json.dumps({"documents": len(texts), "mb": round(num_mb, 2)}))
    for names in [(name,) for name in FILTERS] + [FILTERS]:
        ours, theirs = time_ours(texts, names), time_datatrove(texts, names)
        print(json.dumps({"filters": "+".join(names), "ours_docs_per_cpu_s": round(len(texts) / ours, 1),
                          "datatrove_docs_per_cpu_s": round(len(texts) / theirs, 1),
                          "ours_mb_per_cpu_s": round(num_mb / ours, 2), "speedup": round(theirs / ours, 2)}))
    with tempfile.TemporaryDirectory() as folder:
        ingest_mb_per_s(texts[:20], {name: {} for name in FILTERS}, Path(folder, "warm-up"))  # imports, numba
        default = ingest_mb_per_s(texts, {}, Path(folder))
        all_on = ingest_mb_per_s(texts, {name: {} for name in FILTERS}, Path(folder))
    print(json.dumps({"ingest_mb_per_s_default": round(default, 2), "ingest_mb_per_s_all_four": round(all_on, 2)}))
    print_result("web_filters", len(texts) / ours, len(texts) / theirs, "docs/CPU-s")


if __name__ == "__main__":
    main()
