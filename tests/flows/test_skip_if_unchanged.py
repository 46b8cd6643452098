"""Skip-if-unchanged for the steps without stage markers of their own: the report, the training launch, the
evaluation. Each records a fingerprint of the files it reads (core.rundir.file_stats) when it finishes; these
tests hold what the fingerprint must see (new content, a new checkpoint, a deleted export) and what it must not
(the same bytes written again, which a re-run does to run.yaml and the shard index)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from core.rundir import SMALL_FILE_BYTES, RunPaths, file_stats
from core.stage import run_stage, stage_status
from flows.report.stage import REPORT_STAGE, report_inputs_fingerprint, report_is_current, write_report
from tests.conftest import build_query_run
from trainer.train_stage import TrainStage


def test_file_stats_see_new_bytes_not_the_same_bytes_written_again(tmp_path: Path) -> None:
    recipe = tmp_path / "run.yaml"
    recipe.write_text("name: a\n")
    before = file_stats(tmp_path, tmp_path)
    recipe.unlink()
    recipe.write_text("name: a\n")  # rewritten with the same bytes: a new inode and mtime, the same file
    assert file_stats(tmp_path, tmp_path) == before
    recipe.write_text("name: b\n")
    assert file_stats(tmp_path, tmp_path) != before


def test_file_stats_tell_a_rewritten_large_file_by_its_inode(tmp_path: Path) -> None:
    shard = tmp_path / "part-00000.arrow"
    shard.write_bytes(b"x" * (SMALL_FILE_BYTES + 1))
    before = file_stats(tmp_path, shard)
    replacement = tmp_path / "tmp"
    replacement.write_bytes(b"x" * (SMALL_FILE_BYTES + 1))
    os.replace(replacement, shard)  # what an atomic write does: not hashed (too large), but a new inode
    assert file_stats(tmp_path, shard) != before


def test_file_stats_leave_out_skipped_paths_and_do_not_follow_links(tmp_path: Path) -> None:
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "index.html").write_text("old")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "loop").symlink_to(tmp_path)  # a hostile run dir: following it would never end
    os.mkfifo(tmp_path / "pipe")  # nor would reading this one
    names = [entry[0] for entry in file_stats(tmp_path, tmp_path, frozenset({tmp_path / "report"}))]
    assert names == ["loop", "metrics.jsonl", "pipe"]
    assert file_stats(tmp_path, tmp_path / "missing") == []


def test_training_stage_reruns_on_what_a_launched_trainer_would_read(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    checkpoint = tmp_path / "checkpoints" / "step-0000030"
    checkpoint.mkdir(parents=True)
    (checkpoint / "manifest.json").write_text(json.dumps({"step": 30}))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "training_state.json").write_text(json.dumps({"step": 30}))
    (tmp_path / "metrics").mkdir()
    sections = {"train": {"max_steps": 30}}
    trained = TrainStage(paths, sections, 30)
    trained.launcher = lambda argv, stage, on_progress: None  # the checkpoint above is what it would leave
    run_stage(trained)
    assert stage_status(trained).state == "done"
    (tmp_path / "metrics" / "train.jsonl").write_text("{}\n")  # not read by a trainer that has nothing to do
    assert stage_status(TrainStage(paths, sections, 30)).state == "done"
    assert stage_status(TrainStage(paths, sections, 40)).state != "done"  # a refresh asks for more steps
    (tmp_path / "model" / "training_state.json").unlink()  # the export is gone: the trainer writes it again
    assert stage_status(TrainStage(paths, sections, 30)).state != "done"
    (tmp_path / "model" / "training_state.json").write_text(json.dumps({"step": 30}))
    assert stage_status(TrainStage(paths, sections, 30)).state == "done"
    edited = {"train": {"max_steps": 30, "lr": 0.1}}  # an edited recipe is checked again
    assert stage_status(TrainStage(paths, edited, 30)).reasons == ("setting changed: train",)


def test_report_is_written_again_only_when_a_file_it_reads_changed(tmp_path: Path) -> None:
    paths = RunPaths(build_query_run(tmp_path / "run"))
    index = write_report(paths)
    written = index.stat().st_mtime_ns, index.stat().st_ino
    assert paths.done_summary(REPORT_STAGE, report_inputs_fingerprint(paths)) is not None
    assert report_is_current(paths)  # `tokenmill report` then says "up to date" instead of "wrote"
    write_report(paths)
    assert (index.stat().st_mtime_ns, index.stat().st_ino) == written  # nothing changed: not rendered again
    with (paths.metrics / "train.jsonl").open("a") as metrics:
        metrics.write(json.dumps({"step": 99, "loss": 1.0}) + "\n")
    assert not report_is_current(paths)
    write_report(paths)
    assert (index.stat().st_mtime_ns, index.stat().st_ino) != written
    index.unlink()  # a deleted report is written again, whatever its marker says
    assert write_report(paths).is_file()
