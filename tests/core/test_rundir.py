"""core.rundir and core.runlock: the run-dir lock (second process refused, stale lock taken over), stage markers,
writes only inside the run dir."""

from __future__ import annotations

import fcntl
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from core.errors import RunDirError, RunLockedError
from core.files.atomic import read_json, write_json_atomic
from core.rundir import RunPaths, fingerprint

HOLD_LOCK = "import sys, time; from core.rundir import RunPaths; RunPaths(sys.argv[1]).lock().acquire(); " \
            "print('locked', flush=True); time.sleep(600)"


def hold_lock_in_child(run_dir: Path) -> subprocess.Popen[str]:
    child = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "locked"
    return child


def test_second_process_is_refused_with_the_holders_pid_and_host(tmp_path: Path) -> None:
    child = hold_lock_in_child(tmp_path)
    try:
        with pytest.raises(RunLockedError) as refused, RunPaths(tmp_path).lock():
            pass
        assert f"pid {child.pid}" in str(refused.value)
        assert socket.gethostname() in str(refused.value)
    finally:
        child.kill()
        child.wait()


def test_a_process_refused_while_the_holder_writes_its_line_still_names_the_holder(tmp_path: Path) -> None:
    # The instant between a holder's flock and its "pid … on host …" line: the lock file is still empty.
    # (CI once refused a second `tokenmill prepare` right then, naming an "unknown process".)
    lock_path = tmp_path / ".lock"
    holder_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(holder_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    writer = threading.Timer(0.3, os.pwrite, (holder_fd, b"pid 4242 on host elsewhere\n", 0))
    writer.start()
    try:
        with pytest.raises(RunLockedError, match="in use by pid 4242 on host elsewhere"), RunPaths(tmp_path).lock():
            pass
    finally:
        writer.join()
        os.close(holder_fd)


def test_lock_of_a_killed_process_is_taken_over(tmp_path: Path) -> None:
    child = hold_lock_in_child(tmp_path)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert (tmp_path / ".lock").read_text().startswith(f"pid {child.pid}")  # the stale file is still there
    with RunPaths(tmp_path).lock():
        assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()}")


def test_lock_nests_within_one_process_and_is_released_after(tmp_path: Path) -> None:
    with RunPaths(tmp_path).lock(), RunPaths(tmp_path).lock():  # a flow holding the lock runs a sub-flow taking it
        pass
    child = hold_lock_in_child(tmp_path)  # released: another process can take it now
    child.kill()
    child.wait()


def test_stage_markers_record_fingerprint_and_summary(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    first, second = fingerprint("dedupe", {"threshold": 0.8}), fingerprint("dedupe", {"threshold": 0.7})
    assert first != second and first == fingerprint("dedupe", {"threshold": 0.8})
    assert paths.done_summary("dedupe", first) is None and paths.finished_marker("dedupe") is None
    paths.mark_done("dedupe", first, {"kept": 3})
    assert paths.done_summary("dedupe", first) is not None and paths.done_summary("dedupe", second) is None
    assert read_json(paths.marker("dedupe"))["summary"] == {"kept": 3}


def test_unit_markers_live_under_stages_and_are_written_whole(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    assert paths.marker("dedupe") == tmp_path / "stages" / "dedupe.json"
    assert paths.marker("ingest", "part-00003") == tmp_path / "stages" / "ingest" / "part-00003.json"
    done = fingerprint("ingest_part", ["a.py"])
    assert paths.done_summary("ingest", done, "part-00003") is None
    paths.mark_done("ingest", done, {"num_documents": 2}, "part-00003", part={"part_id": 3})
    assert paths.done_summary("ingest", done, "part-00003") == {"num_documents": 2}
    assert paths.done_summary("ingest", fingerprint("other"), "part-00003") is None
    assert paths.done_summary("ingest", done, "part-00004") is None  # units are apart
    assert paths.finished_marker("ingest", "part-00003") == paths.marker("ingest", "part-00003")
    paths.clear_done("ingest", "part-00003")
    assert paths.finished_marker("ingest", "part-00003") is None


def test_a_run_dir_of_before_stage_markers_is_refused_in_one_line_not_migrated(tmp_path: Path) -> None:
    """A marker without inputs (written before the stage type) is refused in one line saying how to re-run; the
    markers of before ``stages/`` (``docs/part-NNNNN.json``, ``dedupe/state.json``) are no longer read or moved."""
    from core.documents import document_part_files
    from core.stage import run_stage
    from pipeline.config import DedupeConfig
    from pipeline.dedupe.stage import DedupeStage

    paths = RunPaths(tmp_path)
    write_json_atomic(paths.docs / "part-00000.json", {"fingerprint": "f" * 64, "part": {"part_id": 0}, "summary": {}})
    (paths.docs / "part-00000.parquet").write_bytes(b"")
    assert document_part_files(paths) == [] and not paths.marker("ingest", "part-00000").exists()
    legacy_state = {"fingerprint": "f" * 64, "summary": {"num_kept": 5}, "parts": {"0": "abc"}}
    write_json_atomic(paths.dedupe / "state.json", legacy_state)
    write_json_atomic(paths.marker("dedupe"), {"fingerprint": "f" * 64, "summary": {"num_kept": 5}})
    with pytest.raises(RunDirError, match=r"stages/dedupe\.json: written by an older tokenmill .*--run-dir NEW") \
            as refused:
        run_stage(DedupeStage(paths, DedupeConfig()))
    assert "\n" not in str(refused.value)
    assert read_json(paths.dedupe / "state.json") == legacy_state  # nothing moved


def test_writes_go_only_inside_the_run_dir_and_are_atomic(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    paths.write_json(paths.stages / "x.json", {"b": 1, "a": 2})
    paths.write_text(paths.report / "report.md", "# r\n")
    paths.write_bytes(paths.report / "plot.png", b"png")
    with paths.atomic_write(paths.docs / "part-00000.parquet") as tmp:
        tmp.write_bytes(b"docs")
    assert (paths.stages / "x.json").read_text() == '{\n  "a": 2,\n  "b": 1\n}\n'
    assert (paths.report / "plot.png").read_bytes() == b"png" and (paths.docs / "part-00000.parquet").is_file()
    assert sorted(p.name for p in paths.root.rglob(".tmp-*")) == []
    with pytest.raises(ValueError, match="not inside the run dir"):
        paths.write_text(tmp_path / "elsewhere.txt", "no")
    assert not (tmp_path / "elsewhere.txt").exists()


def test_the_run_dir_object_is_picklable_hashable_and_its_lock_is_the_run_lock(tmp_path: Path) -> None:
    paths = RunPaths(str(tmp_path))
    assert pickle.loads(pickle.dumps(paths)) == paths and hash(paths) == hash(RunPaths(tmp_path))
    with paths.lock() as lock:
        assert lock.path == paths.lock_file.resolve()
        assert paths.lock_file.read_text().startswith(f"pid {os.getpid()}")


@pytest.mark.parametrize("task", ["../../outside", "a/b", ".hidden", "", "x" * 200])
def test_an_evaluation_task_name_never_leaves_its_folder(tmp_path: Path, task: str) -> None:
    paths = RunPaths(tmp_path)
    with pytest.raises(ValueError, match="evaluation task name"):
        paths.eval_result(1, task)
    with pytest.raises(ValueError, match="evaluation task name"):
        paths.eval_text(task)
    assert paths.eval_result(1, "arc_easy.v2-local").parent == paths.eval_results / "step-0000001"
