"""Out of space: a shard or checkpoint write that fails for lack of room leaves the previous state intact, says
which path and how much room it needs, and a re-run after room is made ends where an uninterrupted run ends.

The lack of room is a file-size limit (RLIMIT_FSIZE) in a child process: with SIGXFSZ ignored, a write past the
limit fails with EFBIG, as a write to a full disk fails with ENOSPC.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from core.shards.store import verify_shards
from tests.chaos.conftest import (
    DATA_ARTIFACTS,
    build_chaos_corpus,
    file_bytes,
    pack_and_index,
    run_data_stages,
    temp_leftovers,
    write_chaos_recipe,
)
from tests.conftest import copy_stdlib_slice
from trainer.checkpoint.checkpointer import list_checkpoints, verify_checkpoint
from trainer.metrics.sink import read_metric_rows

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
PACK_UNDER_LIMIT = """
import sys
from pathlib import Path

from core.errors import TokenmillError
from tests.chaos.conftest import pack_and_index

try:
    pack_and_index(Path(sys.argv[1]), Path(sys.argv[2]))
except TokenmillError as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
"""


def limit_file_size(limit_bytes: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return apply


def run_python(argv: list[str], limit_bytes: int | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
                          preexec_fn=None if limit_bytes is None else limit_file_size(limit_bytes))


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single ``error:`` line of a failed child; no traceback."""
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0]


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {path.relative_to(run_dir).as_posix(): path.read_bytes()
            for path in sorted(run_dir.rglob("*")) if path.is_file() and path.name != ".lock"}


def test_shard_write_out_of_space_keeps_the_old_shards_then_a_rerun_matches(tmp_path: Path) -> None:
    recipe = write_chaos_recipe(tmp_path, build_chaos_corpus(tmp_path), pack={"rows_per_shard": 400})
    straight, limited = tmp_path / "straight", tmp_path / "limited"
    run_data_stages(recipe, straight)
    run_data_stages(recipe, limited)
    copy_stdlib_slice(tmp_path / "corpus" / "text" / "refresh", ("logging",))  # new data arrives
    run_data_stages(recipe, straight)

    # The limited run ingests and dedupes the new files, then packs them with too little room for a shard.
    run_data_stages_without_pack(recipe, limited)
    before = snapshot(limited)
    result = run_python(["-c", PACK_UNDER_LIMIT, str(recipe), str(limited)], limit_bytes=4096)
    line = error_line(result)
    new_shards = sorted(set(file_bytes(straight, ("shards/**/*.arrow",))) - set(before))
    assert any(name in line for name in new_shards), line
    assert "bytes" in line and "free" in line, line

    # The runner removed the failed unit's marker before the work (core.stage.run_stage): nothing else changed.
    after = snapshot(limited)
    assert set(before) - set(after) == {"stages/pack/split=train/source=code.json"}
    assert after == {name: data for name, data in before.items() if name in after}, \
        "old shards, their state and the index are untouched; no new shard shows"
    assert temp_leftovers(limited) == []
    assert verify_shards(limited) == []

    pack_and_index(recipe, limited)  # room again
    expected, actual = file_bytes(straight, DATA_ARTIFACTS), file_bytes(limited, DATA_ARTIFACTS)
    assert sorted(actual) == sorted(expected)
    assert [name for name in expected if actual[name] != expected[name]] == []
    assert verify_shards(limited) == []


def run_data_stages_without_pack(recipe: Path, run_dir: Path) -> None:
    """run.yaml, ingest, dedupe and tokenizer of the data stages (the pack runs under the limit)."""
    from core.rundir import RunPaths
    from flows.recipe import load_recipe, manifest_paths, record_recipe, tokenizer_file
    from pipeline.dedupe.summary import dedupe_stage
    from pipeline.ingest.stage import ingest_part, plan_ingest
    from tokenization.train_tokenizer import prepare_tokenizer

    loaded, base = load_recipe(recipe)
    paths = RunPaths(run_dir)
    record_recipe(loaded, base, run_dir)
    for part in plan_ingest(manifest_paths(loaded, base), paths, loaded.data.part_size_bytes):
        ingest_part(part, loaded.data.val_fraction, paths)
    dedupe_stage(paths, loaded.dedupe)
    prepare_tokenizer(paths, loaded.tokenizer, tokenizer_file(loaded, base))


def train_to(run_dir: Path, step: int, limit_bytes: int | None = None) -> subprocess.CompletedProcess[str]:
    return run_python(["-m", "trainer.train", "--run-dir", str(run_dir), "--until-step", str(step)], limit_bytes)


def test_checkpoint_write_out_of_space_keeps_the_previous_checkpoint_then_a_rerun_matches(tmp_path: Path) -> None:
    recipe = write_chaos_recipe(tmp_path, build_chaos_corpus(tmp_path), train={"max_steps": 10})
    prepared = tmp_path / "prepared"
    run_data_stages(recipe, prepared)
    straight, limited = tmp_path / "straight", tmp_path / "limited"
    shutil.copytree(prepared, straight)
    shutil.copytree(prepared, limited)
    assert train_to(straight, 10).returncode == 0
    first = train_to(limited, 5)
    assert first.returncode == 0, first.stderr[-3000:]

    # Room for the weights (and the export) but not for the optimizer state of the step-10 checkpoint.
    step5 = limited / "checkpoints" / "step-0000005"
    weights, optimizer = (step5 / "model.safetensors").stat().st_size, (step5 / "optimizer.bin").stat().st_size
    assert weights < optimizer
    before = snapshot(limited)
    result = train_to(limited, 10, limit_bytes=(weights + optimizer) // 2)
    line = error_line(result)
    assert "step-0000010" in line and "bytes" in line, line

    after = snapshot(limited)
    kept = [name for name in before if name.startswith(("checkpoints/", "model/"))]
    assert kept and all(after.get(name) == before[name] for name in kept), "the step-5 checkpoint and export stay"
    assert [step for step, _ in list_checkpoints(limited / "checkpoints")] == [5]
    assert verify_checkpoint(step5) is None
    assert temp_leftovers(limited) == []

    rerun = train_to(limited, 10)  # room again
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "Resuming from checkpoint at step 5" in rerun.stdout
    assert (limited / "model" / "model.safetensors").read_bytes() == \
        (straight / "model" / "model.safetensors").read_bytes()
    steps = [row["step"] for row in read_metric_rows(limited / "metrics" / "train.jsonl")]
    assert steps == list(range(1, 11))
    assert temp_leftovers(limited) == []


EXPORT_AND_LOG_UNDER_LIMIT = """
import sys

from core.errors import TokenmillError
from core.rundir import RunPaths
from tests.trainer.conftest import TEST_DIMS
from trainer.model.export import export_model, hf_llama_config
from trainer.metrics.sink import MetricsSink
from trainer.model.llama import LlamaForCausalLM, ModelDims, ModelShape

paths = RunPaths(sys.argv[2])
try:
    if sys.argv[1] == "export":
        shape = ModelShape(ModelDims(**TEST_DIMS), vocab_size=64, max_seq_len=16)
        export_model(LlamaForCausalLM(shape).state_dict(), hf_llama_config(shape), paths)
    else:
        MetricsSink(paths).log_train({"step": 2, "loss": 1.0, "note": "x" * 8192})
except TokenmillError as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
"""


@pytest.mark.parametrize("what", ["export", "metrics"])
def test_export_and_metrics_out_of_space_name_the_path_and_keep_what_was_there(tmp_path: Path, what: str) -> None:
    """The exported model and the metrics files are written outside the atomic helpers (safetensors' own
    writer, a JSONL append): out of room they still give one line naming the path, and keep what was there."""
    run_dir = tmp_path / "run"
    assert run_python(["-c", EXPORT_AND_LOG_UNDER_LIMIT, what, str(run_dir)]).returncode == 0  # room: fine
    before = snapshot(run_dir)
    line = error_line(run_python(["-c", EXPORT_AND_LOG_UNDER_LIMIT, what, str(run_dir)], limit_bytes=4096))
    expected = "model" if what == "export" else "metrics/train.jsonl"
    assert f"{run_dir}/{expected}" in line and "bytes" in line and "free" in line, line
    after = snapshot(run_dir)
    if what == "export":
        assert after == before, "the previous export is untouched and no staging folder is left"
        assert temp_leftovers(run_dir) == []
    else:  # an append may leave a torn last line, which readers skip: the rows before it are intact
        assert read_metric_rows(run_dir / "metrics" / "train.jsonl") == read_metric_rows_from(before)


def read_metric_rows_from(files: dict[str, bytes]) -> list[dict]:
    import json

    return [json.loads(line) for line in files["metrics/train.jsonl"].decode().splitlines() if line]


def test_a_file_size_limit_that_stops_the_temporary_prefect_server_is_the_no_room_line(tmp_path: Path) -> None:
    """``ulimit -f 64`` during ``prepare`` with no server configured: the temporary server's SQLite database
    cannot grow (EFBIG), the server fails; the command says so in one line naming the database and the limit,
    and none of the server's tracebacks reach the terminal."""
    from tests.chaos.test_bad_inputs import MANIFEST, RECIPE

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("A small document, long enough to pass the quality filters.\n")
    (tmp_path / "m.yaml").write_text(MANIFEST)
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    unset = ("PREFECT_API_URL", "PREFECT_HOME", "TOKENMILL_PREFECT_HOME")
    env = {key: value for key, value in os.environ.items() if key not in unset} | {"XDG_CACHE_HOME": str(tmp_path)}
    tokenmill = Path(sys.executable).parent / "tokenmill"
    result = subprocess.run([str(tokenmill), "prepare", "recipe.yaml", "--run-dir", "run"], capture_output=True,
                            text=True, cwd=tmp_path, env=env, timeout=300, preexec_fn=limit_file_size(64 * 1024))
    line = error_line(result)
    database = tmp_path / "tokenmill" / "prefect" / "prefect.db"
    assert line.startswith("error: the temporary Prefect server "), line
    assert f"could not write its database {database} past the file-size limit of 65,536 bytes (`ulimit -f`)" in line
    assert result.stderr.strip() == line, "the server's own tracebacks stay off the terminal"
