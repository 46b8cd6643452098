"""The ``preference_pairs`` view (pipeline/sql/preference_pairs.py) and docs/querying.md's DPO cookbook, on a scored
DPO run: the margin checked against one computed here from each pair's log-probs alone, the cookbook's wrongly
preferred pairs exactly the pairs whose margin is not positive at the last checkpoint, decoded."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from core.errors import QueryError
from flows.run_sql import run_query, view_names
from tests.trainer.eval.conftest import BETA, STEPS, ScoredRun

QUERYING = Path(__file__).resolve().parents[3] / "docs" / "querying.md"
TOKENMILL = str(Path(sys.executable).with_name("tokenmill"))


def dpo_cookbook() -> list[str]:
    text = QUERYING.read_text(encoding="utf-8")
    section = text.split("\n## DPO cookbook\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sql\n(.*?)```", section, re.S)


def expected_margin(scored_run: ScoredRun, step: int, doc_id: int) -> float:
    (pc, pr), (rc, rr) = scored_run.expected[step][doc_id], scored_run.expected[0][doc_id]
    return BETA * ((pc - rc) - (pr - rr))


def test_one_row_per_pair_and_checkpoint_with_its_margin(scored_run: ScoredRun) -> None:
    rows = run_query(scored_run.run_dir, "SELECT * FROM preference_pairs").to_pylist()
    assert len(rows) == len(STEPS) * len(scored_run.pairs)
    assert {(row["step"], row["doc_id"]) for row in rows} == {(s, d) for s in STEPS for d in scored_run.pairs}
    for row in rows:
        split, source, _ = scored_run.pairs[row["doc_id"]]
        assert (row["split"], row["source"]) == (split, source)
        assert (row["reference_chosen_logp"], row["reference_rejected_logp"]) == pytest.approx(
            scored_run.expected[0][row["doc_id"]], abs=1e-4)
        assert (row["policy_chosen_logp"], row["policy_rejected_logp"]) == pytest.approx(
            scored_run.expected[row["step"]][row["doc_id"]], abs=1e-4)
        margin = expected_margin(scored_run, row["step"], row["doc_id"])
        assert row["margin"] == pytest.approx(margin, abs=1e-4)
        assert row["prefers_chosen"] is (margin > 0)


def test_the_cookbook_lists_exactly_the_pairs_still_preferred_wrongly_decoded(scored_run: ScoredRun) -> None:
    last = max(STEPS)
    wrong = {doc_id for doc_id in scored_run.pairs if expected_margin(scored_run, last, doc_id) <= 0}
    assert 0 < len(wrong) < len(scored_run.pairs), "the data shows both cases"
    rows = run_query(scored_run.run_dir, dpo_cookbook()[0]).to_pylist()
    assert sorted(row["doc_id"] for row in rows) == sorted(wrong)
    for row in rows:
        assert (row["prompt"], row["chosen"], row["rejected"]) == (
            f"question {row['doc_id']}", f"good answer {row['doc_id']}", f"bad answer {row['doc_id']}")
    assert [row["margin"] for row in rows] == sorted(row["margin"] for row in rows)


def test_every_dpo_cookbook_query_returns_rows(scored_run: ScoredRun) -> None:
    queries = dpo_cookbook()
    assert len(queries) >= 3
    for sql in queries:
        assert run_query(scored_run.run_dir, sql).num_rows > 0, sql
    accuracy = run_query(scored_run.run_dir, queries[1]).to_pylist()
    assert {(row["step"], row["split"], row["source"]) for row in accuracy} == {
        (step, split, source) for step in STEPS for split, source, _ in scored_run.pairs.values()}


def test_beta_is_the_runs_own_and_a_bad_one_is_one_line(scored_run: ScoredRun, tmp_path: Path) -> None:
    run_dir = tmp_path / "copy"
    shutil.copytree(scored_run.run_dir, run_dir)
    recipe = yaml.safe_load((run_dir / "run.yaml").read_text())
    recipe["train"]["dpo"]["beta"] = 2 * BETA
    (run_dir / "run.yaml").write_text(yaml.safe_dump(recipe))
    doubled = run_query(run_dir, "SELECT step, doc_id, margin FROM preference_pairs").to_pylist()
    for row in doubled:
        assert row["margin"] == pytest.approx(2 * expected_margin(scored_run, row["step"], row["doc_id"]), abs=2e-4)
    recipe["train"]["dpo"]["beta"] = "0.1); DROP TABLE documents; --"
    (run_dir / "run.yaml").write_text(yaml.safe_dump(recipe))
    with pytest.raises(QueryError, match=r"train\.dpo\.beta is .*not a finite number") as raised:
        run_query(run_dir, "SELECT count(*) FROM preference_pairs")
    assert "\n" not in str(raised.value)
    assert run_query(run_dir, "SELECT count(*) AS n FROM documents").to_pylist() == [{"n": len(scored_run.pairs)}]


def test_tokenmill_query_lists_and_reads_the_view(scored_run: ScoredRun) -> None:
    assert "preference_pairs" in view_names()
    result = subprocess.run([TOKENMILL, "query", str(scored_run.run_dir),
                             "SELECT count(*) AS n FROM preference_pairs WHERE prefers_chosen", "--format", "csv"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    right = sum(expected_margin(scored_run, step, doc_id) > 0 for step in STEPS for doc_id in scored_run.pairs)
    assert result.stdout.split() == ["n", str(right)]


def test_without_stored_reference_values_the_margin_is_null(scored_run: ScoredRun, tmp_path: Path) -> None:
    run_dir = tmp_path / "no-reference"
    shutil.copytree(scored_run.run_dir, run_dir)
    shutil.rmtree(run_dir / "reference")  # precompute: false, or SimPO
    rows = run_query(run_dir, "SELECT * FROM preference_pairs").to_pylist()
    assert len(rows) == len(STEPS) * len(scored_run.pairs)
    assert all(row[name] is None for row in rows for name in ("reference_chosen_logp", "reference_rejected_logp",
                                                              "margin", "prefers_chosen"))
    assert all(row["policy_chosen_logp"] is not None for row in rows)
