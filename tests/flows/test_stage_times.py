"""flows.stage_times: each finished stage call leaves its span; overlapping calls count once per stage."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from core.rundir import RunPaths
from flows.report.stage import report_is_current, write_report
from flows.stage_times import merged_seconds, read_versions, stage_wall_times, times_stage
from tests.conftest import build_query_run


def test_overlapping_spans_count_once_and_gaps_not_at_all() -> None:
    assert merged_seconds([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (1.5, 2.5)]) == 4.0
    assert merged_seconds([]) == 0.0


def test_wall_times_per_stage_skip_torn_and_foreign_lines(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    rows = [{"stage": "ingest", "start_unix_s": 100.0, "end_unix_s": 104.0},
            {"stage": "ingest", "start_unix_s": 101.0, "end_unix_s": 106.0},  # a second part, in parallel
            {"stage": "dedupe", "start_unix_s": 106.0, "end_unix_s": 107.5},
            {"stage": "ingest", "start_unix_s": 500.0, "end_unix_s": 501.0},  # a later run's new part
            {"stage": "dedupe", "start_unix_s": True, "end_unix_s": 2.0}, ["dedupe", 1, 2]]
    paths.metrics.mkdir()
    paths.stage_times.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"stage": "pack", "sta')
    assert stage_wall_times(paths) == [{"stage": "ingest", "wall_s": 7.0, "calls": 3},
                                       {"stage": "dedupe", "wall_s": 1.5, "calls": 1}]


def test_a_timed_call_records_its_span_and_a_failed_one_nothing(tmp_path: Path) -> None:
    @times_stage("dedupe")
    def stage(paths: RunPaths, fail: bool = False) -> str:
        inside.append(time.time())
        if fail:
            raise ValueError("bad input")
        return "done"

    paths, inside = RunPaths(tmp_path), []
    assert stage(paths) == "done"
    with pytest.raises(ValueError, match="bad input"):
        stage(paths=paths, fail=True)
    (row,) = [json.loads(line) for line in paths.stage_times.read_text().splitlines()]
    assert row["stage"] == "dedupe" and row["start_unix_s"] <= round(inside[0], 3) <= row["end_unix_s"]
    versions = read_versions(paths)
    assert versions["tokenmill"] and versions["duckdb"] and versions["python"].count(".") == 2


def test_versions_are_rewritten_only_when_one_changed(tmp_path: Path) -> None:
    @times_stage("tokenizer")
    def stage(paths: RunPaths) -> None:
        return None

    paths = RunPaths(tmp_path)
    stage(paths)
    written = paths.versions.stat().st_mtime_ns, paths.versions.stat().st_ino
    stage(paths)
    assert (paths.versions.stat().st_mtime_ns, paths.versions.stat().st_ino) == written
    paths.versions.write_text(json.dumps({**read_versions(paths), "duckdb": "0.0.1"}))
    stage(paths)
    assert read_versions(paths)["duckdb"] != "0.0.1"


def test_a_new_span_alone_does_not_redraw_the_report_but_new_versions_do(tmp_path: Path) -> None:
    # Every stage call appends a span, skipped ones included: a re-run that did nothing must not redraw.
    paths = RunPaths(build_query_run(tmp_path / "run"))

    @times_stage("pack")
    def stage(paths: RunPaths) -> None:
        return None

    stage(paths)
    html = write_report(paths).read_text()
    assert "<td>pack</td>" in html and "<td>duckdb</td>" not in html and "duckdb " in html
    stage(paths)
    assert report_is_current(paths)
    paths.versions.write_text(json.dumps({**read_versions(paths), "duckdb": "0.0.1"}))
    assert not report_is_current(paths)
