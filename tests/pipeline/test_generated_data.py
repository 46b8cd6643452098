"""Generated data is data (issue 35, item 7): spaCy's English special cases and datatrove's punctuation sets live in
``pipeline/data/`` as JSON, read once by ``pipeline/filters/english_exceptions.py`` and
``pipeline/filters/punctuation.py``. What is read must be what the filters were generated from, and the files must ship
in a wheel."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
import tomllib
from pathlib import Path

import spacy
from datatrove.utils import text as datatrove_text
from spacy.symbols import ORTH

from pipeline.filters.english_exceptions import SPECIAL_CASES
from pipeline.filters.punctuation import PUNCTUATION, TERMINAL_PUNCTUATION

REPO = Path(__file__).resolve().parents[2]


def test_the_special_cases_are_spacys() -> None:
    rules = spacy.blank("en").tokenizer.rules
    expected = {key: tuple(token[ORTH] for token in value) for key, value in rules.items() if not key.isspace()}
    assert expected == SPECIAL_CASES


def test_the_punctuation_sets_are_datatroves() -> None:
    assert frozenset(datatrove_text.TERMINAL_PUNCTUATION) == TERMINAL_PUNCTUATION
    assert frozenset(datatrove_text.PUNCTUATION_SET) == PUNCTUATION


SHADOWED = """
import importlib.util, sys
spec = importlib.util.spec_from_loader("pipeline", None, is_package=True)
spec.submodule_search_locations = [sys.argv[1], sys.argv[2]]
sys.modules["pipeline"] = importlib.util.module_from_spec(spec)
from pipeline.filters.english_exceptions import SPECIAL_CASES
from pipeline.filters.punctuation import PUNCTUATION
print(len(SPECIAL_CASES), len(PUNCTUATION))
"""


def test_the_data_is_found_when_the_name_pipeline_is_another_module(tmp_path: Path) -> None:
    """Prefect loads a deployment's ``flows/pipeline.py`` as the module ``pipeline`` (searching ``flows/`` first):
    data found by the package's name was looked for in ``flows/data/`` and every served run crashed."""
    found = subprocess.run([sys.executable, "-c", SHADOWED, str(tmp_path), str(REPO / "pipeline")], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert found.returncode == 0, found.stderr[-2000:]
    assert found.stdout.split() == [str(len(SPECIAL_CASES)), str(len(PUNCTUATION))]


def package_data_patterns() -> dict[str, list[str]]:
    """``[tool.setuptools.package-data]`` of pyproject.toml: package (``*``: every one) -> file patterns."""
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-data"]


def test_every_data_file_of_a_package_is_package_data() -> None:
    """A non-editable install (a wheel) carries only the files these patterns name: a data file left out would
    import fine from a checkout and fail at import once installed."""
    patterns = package_data_patterns()
    left_out = []
    for package in ("core", "pipeline", "tokenization", "trainer", "flows"):
        for path in sorted((REPO / package / "data").rglob("*")) if (REPO / package / "data").is_dir() else []:
            rel = path.relative_to(REPO / package).as_posix()
            if path.is_file() and not any(fnmatch.fnmatch(rel, pattern)
                                          for pattern in [*patterns.get("*", []), *patterns.get(package, [])]):
                left_out.append(f"{package}/{rel}")
    assert left_out == []
    assert (REPO / "pipeline" / "data" / "english_special_cases.json").is_file()
