"""flows.progress: one readable line per finished stage call."""

from __future__ import annotations

import logging

import pytest

from flows.progress import QUIET_ENV, describe_rates, reports_progress
from pipeline.shards import ShardInfo


def test_counts_and_rates_from_a_summary() -> None:
    line = describe_rates("ingest-part", {"num_documents": 1000, "num_bytes": 2_000_000}, 2.0)
    assert line == "ingest-part: 1,000 docs, 2.0 MB in 2.00 s (500 docs/s, 1.0 MB/s)"


def test_shard_infos_skipped_stages_and_plans() -> None:
    infos = [ShardInfo("a", "train", "s", 10, 2560, "x", "t", 256),
             ShardInfo("b", "train", "s", 5, 1000, "x", "t", 256)]
    assert describe_rates("pack", infos, 1.0) == "pack: 3,560 tokens, 15 rows in 1.00 s (3,560 tokens/s, 15 rows/s)"
    assert describe_rates("dedupe", {"num_documents_in": 7, "skipped": True}, 0.1) == \
        "dedupe: 7 docs (already done, skipped)"
    assert describe_rates("plan-ingest", [{"part_id": 0}, {"part_id": 1}], 0.1) == "plan-ingest: 2 part(s) to do"


def test_decorator_logs_once_and_quiet_silences_it(caplog: pytest.LogCaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    @reports_progress("demo")
    def stage(n: int) -> dict[str, int]:
        return {"num_rows": n}

    with caplog.at_level(logging.INFO, logger="tokenmill.progress"):
        assert stage(4) == {"num_rows": 4}
        monkeypatch.setenv(QUIET_ENV, "1")
        stage(5)
    lines = [record.getMessage() for record in caplog.records if record.name == "tokenmill.progress"]
    assert len(lines) == 1 and lines[0].startswith("demo: 4 rows in ")
