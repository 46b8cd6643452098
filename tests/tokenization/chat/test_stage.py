"""The SFT data stage through the one stage runner: conversation files -> chat shards whose loss masks are masks.py's,
every bad record in rejects with its reason, skipped when nothing changed, redone when a chat file or the template
changes, and redone after a kill between its outputs and its marker."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from core.rundir import RunPaths
from core.stage import read_marker, run_stage, stage_status
from tests.tokenization.chat.chat_tokenizers import CHATML_MARKED
from tests.tokenization.chat.sft_data import RECORDS, assistant, masked_records, user
from tokenization.chat.stage import SftDataConfig, SftDataStage
from tokenization.chat.template import load_chat_template

SEQ_LEN = 160
BAD_LINES: list[tuple[str, str]] = [
    (json.dumps({"messages": [user("Hi"), {"role": "wizard", "content": "Abracadabra"}]}), "unknown_role"),
    (json.dumps({"messages": [user("Is anyone there?")]}), "no_assistant_turn"),
    (json.dumps({"messages": [user("Tell me more."), assistant("word " * 400)]}), "too_long"),
    (json.dumps({"messages": [user("   "), assistant("An empty question.")]}), "empty_content"),
    ('{"messages": [', "invalid_json"),
]
"""One record per class, each a line the stage must reject with this reason and live past."""


def chat_lines() -> tuple[list[str], dict[int, str]]:
    """The valid RECORDS with a bad line after every second one (and a prompt/completion record at the end);
    returns the lines and {record number: reason} of the bad ones."""
    lines, bad = [], {}
    bad_lines = iter(BAD_LINES)
    for index, record in enumerate(RECORDS):
        lines.append(json.dumps(record))
        if index % 2 == 1 and (item := next(bad_lines, None)) is not None:
            bad[len(lines)] = item[1]
            lines.append(item[0])
    for line, reason in bad_lines:
        bad[len(lines)] = reason
        lines.append(line)
    lines.append(json.dumps({"prompt": "What does len() return?", "completion": "The number of items."}))
    return lines, bad


@pytest.fixture()
def model_dir(model_dirs: dict[str, Path], tmp_path: Path) -> Path:
    """A copy of the ChatML model dir (stock template: prefix-diff masks), so a test may edit its template."""
    return Path(shutil.copytree(model_dirs["chatml"], tmp_path / "model"))


@pytest.fixture()
def stage(tmp_path: Path, model_dir: Path) -> SftDataStage:
    chat_file = tmp_path / "chat.jsonl"
    chat_file.write_text("\n".join(chat_lines()[0]) + "\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = SftDataConfig(model_dir=model_dir, train_files=(chat_file,), seq_len=SEQ_LEN, rows_per_shard=2)
    return SftDataStage(RunPaths(run_dir), config)


def read_rows(stage: SftDataStage) -> list[dict[str, Any]]:
    """Every row of the train split's chat shards, in shard order."""
    rows = []
    for shard in sorted(stage.paths.sft_folder("train").glob("part-*.arrow")):
        with ipc.open_file(shard) as reader:
            rows.extend(reader.read_all().to_pylist())
    return rows


def test_shards_hold_every_valid_record_with_masks_py_masks(stage: SftDataStage) -> None:
    result = run_stage(stage, "train")
    lines, bad = chat_lines()
    records = {number: json.loads(line) for number, line in enumerate(lines) if number not in bad}
    expected = dict(zip(records, masked_records(load_chat_template(stage.config.model_dir), list(records.values()),
                                                max_tokens=SEQ_LEN), strict=True))
    seen = {}
    for row in read_rows(stage):
        ends = [*row["doc_starts"][1:], row["num_tokens"]]
        for doc_id, start, end in zip(row["doc_ids"], row["doc_starts"], ends, strict=True):
            seen[doc_id] = (row["input_ids"][start:end], row["loss_mask"][start:end])
        assert row["num_loss_tokens"] == sum(row["loss_mask"])
    assert sorted(seen) == sorted(expected)  # every valid record, once
    for doc_id, masked in expected.items():
        assert seen[doc_id] == (masked.input_ids, [0, *masked.loss_mask[1:]]), doc_id
    assert result.summary["num_conversations"] == len(expected)
    assert result.summary["num_loss_tokens"] == sum(sum(mask) for _, mask in seen.values())
    assert result.summary["num_shards"] > 1  # rows_per_shard=2 cuts them


def test_bad_records_are_rejected_with_their_reason(stage: SftDataStage) -> None:
    result = run_stage(stage, "train")
    _, bad = chat_lines()
    rejects = pq.read_table(stage.paths.sft_rejects("train")).to_pylist()
    assert {int(row["source_id"]): row["reason"] for row in rejects} == bad
    assert {row["uri"] for row in rejects} == {f"{stage.config.train_files[0]}:{number + 1}" for number in bad}
    assert all(row["source"] == "chat.jsonl" and row["detail"] and row["raw"] for row in rejects)
    assert result.summary["rejects_by_reason"] == {reason: 1 for reason in sorted(bad.values())}


def test_truncation_keeps_a_long_reply_and_rejects_a_prompt_that_leaves_no_loss(tmp_path: Path,
                                                                                model_dir: Path) -> None:
    chat_file = tmp_path / "long.jsonl"
    chat_file.write_text(json.dumps({"messages": [user("Tell me more."), assistant("word " * 400)]}) + "\n"
                         + json.dumps({"messages": [user("word " * 400), assistant("Too late.")]}) + "\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = SftDataConfig(model_dir=model_dir, train_files=(chat_file,), seq_len=SEQ_LEN, truncation="truncate")
    stage = SftDataStage(RunPaths(run_dir), config)
    summary = run_stage(stage, "train").summary
    assert (summary["num_conversations"], summary["rejects_by_reason"]) == (1, {"no_loss_tokens": 1})
    (row,) = read_rows(stage)
    assert (row["doc_ids"], row["num_tokens"]) == ([0], SEQ_LEN)


def test_rerun_skips_and_a_changed_chat_file_reruns(stage: SftDataStage) -> None:
    first = run_stage(stage, "train")
    assert run_stage(stage, "train").skipped
    chat_file = stage.config.train_files[0]
    chat_file.write_text(chat_file.read_text() + json.dumps({"messages": [user("Why?"), assistant("Because.")]}))
    assert stage_status(stage, "train").reasons == (f"file changed: chat:{chat_file}",)
    again = run_stage(stage, "train")
    assert not again.skipped
    assert again.summary["num_conversations"] == first.summary["num_conversations"] + 1


def test_a_changed_template_reruns(stage: SftDataStage) -> None:
    run_stage(stage, "train")
    template_file = Path(stage.config.model_dir) / "chat_template.jinja"
    template_file.write_text(CHATML_MARKED)  # same text rendered, the mask now from generation markers
    assert stage_status(stage, "train").reasons == (f"file changed: template:{template_file}",)
    assert not run_stage(stage, "train").skipped


def test_a_changed_shard_reruns(stage: SftDataStage) -> None:
    run_stage(stage, "train")
    shard = stage.paths.sft_shard("train", 0)
    shard.write_bytes(shard.read_bytes()[:-8])
    assert not run_stage(stage, "train").skipped
    assert run_stage(stage, "train").skipped


KILLED_RUN = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from core.rundir import RunPaths
from core.stage import run_stage
from tokenization.chat.stage import SftDataConfig, SftDataStage

class KilledAtMarker(RunPaths):
    def write_json(self, path, obj):
        if path == self.marker("sft_data", "train"):
            os.kill(os.getpid(), signal.SIGKILL)
        super().write_json(path, obj)

config = SftDataConfig(model_dir=Path({model!r}), train_files=(Path({chat!r}),), seq_len={seq_len}, rows_per_shard=2)
run_stage(SftDataStage(KilledAtMarker(Path({run!r})), config), "train")
"""


def test_kill_between_outputs_and_marker_is_redone(stage: SftDataStage) -> None:
    script = KILLED_RUN.format(tests=str(Path(__file__).parents[3]), model=str(stage.config.model_dir),
                               chat=str(stage.config.train_files[0]), seq_len=SEQ_LEN, run=str(stage.paths.root))
    killed = subprocess.run([sys.executable, "-c", script], check=False)
    assert killed.returncode == -signal.SIGKILL
    assert stage.paths.sft_state("train").is_file() and read_marker(stage.paths, stage.name, "train") is None
    assert stage_status(stage, "train").state == "to do"
    shards_before = {path.name: path.read_bytes() for path in stage.paths.sft_folder("train").glob("part-*.arrow")}
    assert not run_stage(stage, "train").skipped
    assert {path.name: path.read_bytes() for path in stage.paths.sft_folder("train").glob("part-*.arrow")} \
        == shards_before  # deterministic: the same bytes again
    assert run_stage(stage, "train").skipped


def test_builds_and_reports_status_before_anything_exists(tmp_path: Path) -> None:
    """``tokenmill status`` builds every stage on a run dir where nothing exists yet: no raise, inputs say missing."""
    config = SftDataConfig(model_dir=tmp_path / "no-model", train_files=(tmp_path / "none.jsonl",))
    stage = SftDataStage(RunPaths(tmp_path), config)
    assert stage.units() == ["train"]
    assert set(stage.inputs("train").files.values()) == {"missing"}
    assert stage_status(stage, "train").state == "to do"
