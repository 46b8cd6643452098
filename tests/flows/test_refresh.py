"""The nightly-refresh case: a source folder grows; each re-run ingests only new files, dedupes them
against everything seen before, appends shards, and trains `steps_per_refresh` more steps."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from core.shards.store import read_shard_index, verify_shards
from flows.run_sql import run_query
from tests.conftest import STDLIB, copy_stdlib_slice
from tests.flows.conftest import write_small_recipe

pytestmark = pytest.mark.slow


def final_step(run_dir: Path) -> int:
    return max(json.loads(line)["step"] for line in (run_dir / "metrics" / "eval.jsonl").read_text().splitlines())


def test_two_refreshes_over_a_growing_folder(tmp_path: Path, prefect_server: None) -> None:
    from flows.pipeline import data_to_model

    recipe = write_small_recipe(tmp_path, max_steps=20)
    data = yaml.safe_load(recipe.read_text())
    data["train"]["steps_per_refresh"] = 10
    recipe.write_text(yaml.safe_dump(data))
    corpus, run_dir = tmp_path / "corpus", tmp_path / "run"

    first = data_to_model(str(recipe))
    shards_before = {info.path: info.sha256 for info in read_shard_index(run_dir)}
    assert final_step(run_dir) == 20

    # Refresh 1: a new package, a renamed copy of an old file and a whitespace-edited copy of another.
    copy_stdlib_slice(corpus, ("logging",))
    (corpus / "renamed").mkdir()
    shutil.copyfile(STDLIB / "json" / "decoder.py", corpus / "renamed" / "old_decoder_copy.py")
    spaced = (STDLIB / "json" / "encoder.py").read_text().replace("\n", "  \n\n")
    (corpus / "renamed" / "encoder_spaced.py").write_text(spaced)
    second = data_to_model(str(recipe))

    assert second["prepare"]["parts_ingested"] == 1, "only the new files form a new part"
    copies = run_query(run_dir, "SELECT d.uri, d.kind, s.uri AS survivor FROM duplicates d JOIN _docs s "
                                "ON d.duplicate_of = s.doc_id WHERE d.uri LIKE 'renamed/%' ORDER BY d.uri").to_pylist()
    assert copies == [
        {"uri": "renamed/encoder_spaced.py", "kind": "exact", "survivor": "json/encoder.py"},
        {"uri": "renamed/old_decoder_copy.py", "kind": "exact", "survivor": "json/decoder.py"},
    ]
    shards_after = {info.path: info.sha256 for info in read_shard_index(run_dir)}
    assert set(shards_before.items()) < set(shards_after.items()), "old shards stay byte-identical; new ones append"
    assert final_step(run_dir) == 30

    # Refresh 2: another package.
    copy_stdlib_slice(corpus, ("http",))
    third = data_to_model(str(recipe))
    assert third["prepare"]["parts_ingested"] == 1
    assert len(read_shard_index(run_dir)) > len(shards_after)
    assert final_step(run_dir) == 40
    assert verify_shards(run_dir) == []

    files = len(list(corpus.rglob("*.py")))
    counts = run_query(run_dir, "SELECT (SELECT count(*) FROM documents) + (SELECT count(*) FROM duplicates) "
                                "+ (SELECT count(*) FROM rejects) AS n").column(0).to_pylist()
    assert counts == [files], "every file is in exactly one of documents, duplicates, rejects"
    train_steps = [json.loads(line)["step"] for line in (run_dir / "metrics/train.jsonl").read_text().splitlines()]
    assert train_steps == sorted(set(train_steps))
    assert first["train"]["val_loss_subset"]["first"] is not None
