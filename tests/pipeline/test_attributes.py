"""Issue 18, item 5: attributes, not only verdicts (``attributes/``, the ``attributes`` view, re-deciding).

Real text: Debian's English and translated manual pages (as ``tests/pipeline/test_language.py``), whose language
scores spread from 0.3 to 0.99, with the language filter on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from benchmarks.corpus import debian_doc_texts, man_page_texts
from core.rundir import RunPaths
from core.schemas import ATTRIBUTE_VALUE_FIELDS, ATTRIBUTES_SCHEMA
from flows.run_sql import run_query
from pipeline.filters.normalisation import normalise_text
from pipeline.filters.screen import UNMEASURED, check_filters, measure_text, redecide
from pipeline.filters.thresholds import measurement_settings
from pipeline.filters.web_filters import storable_statistics
from pipeline.ingest.stage import ingest_part, plan_ingest
from pipeline.manifest import FilterConfig
from tests.test_readme_sql import QUERIES

PAGES = 8
FILTERS = {"min_chars": 200, "language": {"allowed": ["en", "de", "fr"], "min_score": 0.5}}


def write_pages(root: Path) -> tuple[Path, int]:
    """Two jsonl sources (``en``; ``translated``: de + fr), a short record each and one broken line; the manifest and
    the number of parsed records."""
    # One Spanish page (not allowed): a language reject whatever scores the installed English pages get (which
    # pages come first changes with the packages a machine has installed).
    sources = {"en": man_page_texts("en", PAGES, min_words=150),
               "translated": man_page_texts("de", PAGES, min_words=150) + man_page_texts("fr", PAGES, min_words=150)
               + man_page_texts("es", 1, min_words=150)}
    num_parsed = 0
    for name, pages in sources.items():
        lines = [json.dumps({"text": text}) for _, text in pages] + [json.dumps({"text": "too short"}), "{broken"]
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        num_parsed += len(pages) + 1
    manifest = root / "pages.yaml"
    manifest.write_text(yaml.safe_dump({"name": "pages", "filters": FILTERS, "sources": [
        {"name": name, "path": f"{name}.jsonl", "format": "jsonl"} for name in sources]}))
    return manifest, num_parsed


def readme_query(fragment: str) -> str:
    (sql,) = [sql for sql in QUERIES if fragment in sql]
    return sql


def test_every_parsed_record_has_its_values_and_the_cookbook_predicts_a_stricter_min_score(tmp_path: Path) -> None:
    manifest, num_parsed = write_pages(tmp_path)
    paths = RunPaths(tmp_path / "run")
    parts = plan_ingest([manifest], paths, 32 << 20)
    for part in parts:
        ingest_part(part, 0.0, paths)
    assert all(pq.read_schema(path).equals(ATTRIBUTES_SCHEMA) for path in paths.attributes.glob("part-*.parquet"))
    rows = run_query(paths.root, "SELECT * FROM attributes").to_pylist()
    assert len(rows) == num_parsed  # kept and rejected alike; the broken lines are in rejects only
    kept = {row["uri"]: row for row in run_query(paths.root, "SELECT uri, text FROM documents").to_pylist()}
    rejected = {row["uri"]: row for row in run_query(paths.root, "SELECT * FROM rejects").to_pylist()}
    for row in rows:
        if row["reason"] is None:  # measured by every filter that is on, and the stored text is what was measured
            assert row["num_chars"] == len(kept[row["uri"]]["text"]) and row["language"] in ("en", "de", "fr")
            assert row["language_score"] >= 0.5 and row["num_words"] > 0
        else:
            reject = rejected[row["uri"]]
            assert reject["reason"] == row["reason"]
            assert reject["text"] == normalise_text(json.loads(reject["raw"])["text"])  # what the filter rejected
    short = [row for row in rows if row["reason"] == "too_short"]
    assert len(short) == 2 and all(row["language"] is None and row["num_words"] is None for row in short)
    languages = [row for row in rows if row["reason"] == "language"]
    assert languages and all(row["language_score"] < 0.5 or row["language"] not in ("en", "de", "fr")
                             for row in languages)
    assert {row["reason"] for row in rejected.values()} == {"too_short", "language", "invalid_json"}

    predicted = {row["source"]: row["would_remove"]
                 for row in run_query(paths.root, readme_query("language_score < 0.8")).to_pylist()}
    assert set(predicted) == {"en", "translated"} and sum(predicted.values()) > 0
    before = language_rejects(paths.root)
    manifest.write_text(manifest.read_text().replace("min_score: 0.5", "min_score: 0.8"))
    redecided = [ingest_part(part, 0.0, paths) for part in plan_ingest([manifest], paths, 32 << 20)]
    assert len(redecided) == len(parts) and all(summary["redecided"] for summary in redecided)
    after = language_rejects(paths.root)
    assert {source: after[source] - before.get(source, 0) for source in after} == predicted


def language_rejects(run_dir: Path) -> dict[str, int]:
    sql = "SELECT source, count(*) AS n FROM rejects WHERE reason = 'language' GROUP BY source"
    return {row["source"]: row["n"] for row in run_query(run_dir, sql).to_pylist()}


TEXTS = ("", "x" * 50, "+-" * 30, "\x00" * 5 + "abc", "word " * 40, "line\n" * 60,
         "An ordinary sentence with words of ordinary length, and a second one to go with it.")


@pytest.mark.parametrize("text", TEXTS)
def test_a_verdict_from_stored_values_is_the_verdict_of_the_filters(text: str) -> None:
    """Measured under one set of thresholds, re-decided under others: the same verdict as filtering the text anew
    (or UNMEASURED, where a row the text now reaches was never measured)."""
    loose = FilterConfig(min_chars=1, max_symbol_ratio=10.0, max_duplicate_line_fraction=1.0, max_mean_word_length=60)
    strict = FilterConfig(min_chars=100, max_control_char_fraction=0.0, min_mean_word_length=4.5,
                          max_duplicate_line_fraction=0.5, max_symbol_ratio=0.5)
    for measured_with, decided_with in ((loose, strict), (strict, loose), (FilterConfig(), strict)):
        _, _, values = measure_text(normalise_text(text), measured_with)
        verdict = redecide(values, decided_with)
        if verdict != UNMEASURED:
            assert verdict == check_filters(normalise_text(text), decided_with)


def test_web_filter_verdicts_from_stored_statistics_are_the_filters_own() -> None:
    """Gopher, C4 and FineWeb measured with the published settings and stored (a Parquet round trip of the
    attributes' columns, n-gram maps included), then decided under other thresholds: the verdicts and details of
    filtering anew, wherever the stored statistics suffice."""
    texts = [normalise_text(text[:6000]) for _, text in debian_doc_texts(40)]
    texts += [normalise_text(text) for _, text in man_page_texts("en", 10, min_words=50)]
    measured_with = FilterConfig(gopher_repetition={}, gopher_quality={}, c4={}, fineweb={})
    decided_with = FilterConfig(
        gopher_repetition={"dup_line_frac": 0.1, "top_n_grams": {2: 0.1, 3: 0.3, 4: 0.3}},
        gopher_quality={"min_doc_words": 600, "min_stop_words": 4, "min_alpha_words_ratio": 0.6},
        c4={"min_num_sentences": 2, "filter_curly_bracket": False},
        fineweb={"line_punct_thr": 0.5, "line_punct_exclude_zero": True})
    assert measurement_settings(measured_with) == measurement_settings(decided_with)
    measured = [measure_text(text, measured_with) for text in texts]
    stored = pa.Table.from_pylist([storable_statistics(values) for _, _, values in measured],
                                  schema=pa.schema(ATTRIBUTE_VALUE_FIELDS)).to_pylist()
    verdicts = [redecide(values, decided_with) for values in stored]
    compared = [(verdict, check_filters(text, decided_with)) for verdict, text in zip(verdicts, texts, strict=True)
                if verdict != UNMEASURED]
    assert all(verdict == anew for verdict, anew in compared) and len(compared) >= 10
    # A document the filters kept has every statistic; one rejected has those up to its failing rule (ingest keeps
    # its speed), so some re-decisions need the stored text measured again.
    assert all(verdict != UNMEASURED for verdict, (_, failed, _) in zip(verdicts, measured, strict=True)
               if failed is None)
    assert len(compared) < len(texts)
    changed = sum((verdict is None) != (failed is None) for verdict, (_, failed, _) in zip(verdicts, measured,
                                                                                            strict=True))
    assert changed > 0  # the new thresholds decide some documents otherwise
