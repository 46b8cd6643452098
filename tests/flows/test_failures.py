"""What the user sees when an OS limit, a bad bucket URL or a folder that holds no run meets a command: one
``error:`` line naming the path (or key and value) and the fix, exit 2, no traceback (issue #34, classes 2, 3, 8).

The ``tokenmill`` calls here are refused before a Prefect server would start: seconds each.
"""

from __future__ import annotations

import errno
import http.server
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from core.errors import OutOfSpaceError, UnwritableError
from flows.cli.failures import user_error
from tests.chaos.test_bad_inputs import MANIFEST, RECIPE, assert_one_line_error
from tests.conftest import build_query_run

TOKENMILL = str(Path(sys.executable).parent / "tokenmill")


def closed_port_endpoint() -> str:
    """An endpoint nothing listens on: a request sent there would be a "cannot reach" error, not ours."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def tokenmill(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AWS_ENDPOINT_URL": closed_port_endpoint(), "AWS_ACCESS_KEY_ID": "k",
           "AWS_SECRET_ACCESS_KEY": "s", "AWS_MAX_ATTEMPTS": "1"}
    return subprocess.run([TOKENMILL, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=180)


def write_recipe(root: Path, **recipe_lines: str) -> Path:
    (root / "corpus").mkdir()
    (root / "corpus" / "a.txt").write_text("A small document, long enough to pass the quality filters.\n")
    (root / "m.yaml").write_text(MANIFEST)
    (root / "recipe.yaml").write_text(RECIPE + "".join(f"{key}: {value}\n" for key, value in recipe_lines.items()))
    return root / "recipe.yaml"


# ---- class 2: limits of the operating system --------------------------------------------------------


def test_a_300_character_run_dir_or_recipe_name_is_one_line_before_any_work(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path)
    long_dir = tmp_path / ("r" * 300)
    line = assert_one_line_error(tokenmill("prepare", recipe, "--run-dir", long_dir), "cannot be a run dir",
                                 "is 300 bytes", "use a shorter run dir")
    assert line.startswith(f"error: {long_dir}: ")
    assert_one_line_error(tokenmill("query", long_dir, "SELECT 1"), "cannot be a run dir", "is 300 bytes")
    (tmp_path / "long.yaml").write_text(RECIPE.replace("name: x", "name: " + "n" * 300))
    assert_one_line_error(tokenmill("prepare", tmp_path / "long.yaml"), "long.yaml: name: ", "is 300 characters")
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["corpus", "long.yaml", "m.yaml", "recipe.yaml"]


def test_a_folder_where_run_yaml_must_be_is_one_line_for_prepare_and_eval(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path)
    run_dir = tmp_path / "run"
    (run_dir / "run.yaml" / "a-file").mkdir(parents=True)
    for result in (tokenmill("prepare", recipe, "--run-dir", run_dir), tokenmill("eval", run_dir)):
        line = assert_one_line_error(result, f"{run_dir / 'run.yaml'}: a folder where the run's recipe file must be",
                                     "move it out of the way")
        assert result.stderr.strip() == line


def test_an_os_error_no_writer_mapped_is_one_line_naming_its_path() -> None:
    """The CLI's last resort (flows.cli.failures.user_error): an OSError on a path anywhere in the chain of causes."""
    folder = Path("/tmp")
    try:
        folder.read_text()
    except IsADirectoryError as err:
        wrapped = RuntimeError("a task failed")
        wrapped.__cause__ = err
    mapped = user_error(wrapped, temporary_server=False)
    assert isinstance(mapped, UnwritableError) and str(mapped).startswith("/tmp: a folder is in the way")
    full = user_error(OSError(errno.EFBIG, "File too large", "/tmp/x"), temporary_server=False)
    assert isinstance(full, OutOfSpaceError) and "/tmp/x: no room to write it (File too large)" in str(full)
    assert user_error(RuntimeError("a bug"), temporary_server=True) is None, "no OS cause: stays a traceback"


def test_an_http_500_from_the_temporary_server_is_its_failure_in_one_line() -> None:
    """A real HTTP 500 answer (a server that fails every request), as Prefect's client raises it."""
    import httpx

    class Failing(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_error(500, "Internal Server Error")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(httpx.HTTPStatusError) as answered:
            httpx.get(f"http://127.0.0.1:{server.server_address[1]}/api/flow_runs").raise_for_status()
    finally:
        server.shutdown()
    assert user_error(answered.value, temporary_server=False) is None, "a configured server's 500 is not ours"
    line = str(user_error(answered.value, temporary_server=True))
    assert line.startswith("the temporary Prefect server failed (an HTTP 500 answer") and "--debug" in line


# ---- class 3: bucket URLs -----------------------------------------------------------------------------


@pytest.mark.parametrize(("url", "says"), [
    ("s3://Bad_Bucket!/runs/x", "bucket name 'Bad_Bucket!' holds a character other than"),
    ("s3://bucket/../../etc", "key holds a '.' or '..' segment"),
    ("s3://10.0.0.1/runs/x", "bucket name '10.0.0.1' is formatted as an IP address"),
])  # every rule: tests/core/test_bucket_url.py
def test_a_bad_bucket_url_to_query_is_one_line_before_any_request(url: str, says: str) -> None:
    assert_one_line_error(tokenmill("query", url, "SELECT count(*) FROM documents"), f"run dir: {url!r}: {says}")


def test_a_bad_bucket_url_as_the_run_dir_is_one_line_from_every_route(tmp_path: Path) -> None:
    upper, climbing = "s3://Bad_Bucket!/runs/x", "s3://bucket/runs/../../etc"
    assert_one_line_error(tokenmill("shards", "stats", climbing), f"run dir: {climbing!r}: key holds a '.' or '..'")
    recipe = write_recipe(tmp_path, run_dir=f"'{upper}'")
    assert_one_line_error(tokenmill("prepare", recipe), f"run_dir: {upper!r}: bucket name 'Bad_Bucket!'")
    assert_one_line_error(tokenmill("train", recipe, "--run-dir", climbing), f"run_dir: {climbing!r}: key holds")


def test_a_bad_bucket_url_as_a_source_path_names_the_manifest_key(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path)
    (tmp_path / "m.yaml").write_text(MANIFEST.replace("path: corpus", "path: 's3://UPPER/corpus'"))
    assert_one_line_error(tokenmill("prepare", recipe, "--run-dir", tmp_path / "run"),
                          "m.yaml: sources.0.path: ", "bucket name 'UPPER' holds a character")


# ---- class 8: a folder that holds no run --------------------------------------------------------------


@pytest.mark.parametrize("command", [["query", "SELECT count(*) FROM documents"], ["report"], ["shards", "verify"],
                                     ["shards", "stats"], ["shards", "sample"], ["eval"], ["generate", "def f("]],
                         ids=lambda command: command[0] if command[0] != "shards" else " ".join(command))
def test_a_folder_that_holds_no_run_is_refused_by_every_reading_command(tmp_path: Path, command: list[str]) -> None:
    folder = tmp_path / "not-a-run"
    (folder / "notes").mkdir(parents=True)
    argv = [*command[:-1], folder, command[-1]] if command[0] in ("query", "generate") else [*command, folder]
    result = tokenmill(*argv)
    if command[0] == "eval":  # it needs the run's recipe itself, and says so
        assert_one_line_error(result, f"{folder}: no run.yaml; give a run dir that tokenmill wrote")
    else:
        assert_one_line_error(result, f"{folder}: not a tokenmill run dir", "give the run dir a tokenmill run wrote")
    assert sorted(path.name for path in folder.rglob("*")) == ["notes"], "nothing was written into it"


def test_a_run_dir_without_run_yaml_still_answers(tmp_path: Path) -> None:
    """A run's layout is enough (a hand-built or older run dir): the check refuses no run."""
    run = build_query_run(tmp_path / "run")
    result = tokenmill("query", run, "SELECT count(*) AS n FROM documents", "--format", "csv")
    assert result.returncode == 0 and result.stdout == "n\n2\n", result.stderr


def test_a_folder_where_a_run_file_must_be_in_a_bucket_is_one_line(tmp_path: Path, s3_prefix: str) -> None:
    """``run.yaml`` as a key prefix (``run.yaml/x``), and a key that is an object and a prefix at once."""
    import s3fs

    fs = s3fs.S3FileSystem()
    run = build_query_run(tmp_path / "q")
    url = f"{s3_prefix}/runs/q"
    fs.put(f"{run}/", f"{url}/", recursive=True)
    fs.pipe(f"{url}/run.yaml/x", b"not a recipe\n")
    recipe = write_recipe(tmp_path)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}  # the working copies and mirrors: the test's
    argv = [TOKENMILL, "prepare", str(recipe), "--run-dir", url]
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180)
    assert_one_line_error(result, "run.yaml: a folder where the run's recipe file must be", "move it out of the way")
    fs.pipe(f"{url}/shards/index.parquet/x", b"in the way\n")
    for argv in ([TOKENMILL, "shards", "stats", url], [TOKENMILL, "prepare", str(recipe), "--run-dir", url]):
        result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180)
        assert_one_line_error(result, f"{url}: key 'shards/index.parquet' is an object and also a folder of others",
                              "remove one of them from the bucket")
