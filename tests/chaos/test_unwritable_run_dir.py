"""A run dir tokenmill cannot write is one line naming it and what to do, never an OSError traceback.

The tests run as root, for whom permission bits mean nothing, so each case is one that fails for root too:
a file where the run dir or one of its parents must be, a path under /proc (nothing can be created there) or
under /sys (not permitted), and a file where a folder of the run must be.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from core.errors import UnwritableError
from core.files.atomic import write_text_atomic
from core.rundir import RunPaths
from tests.chaos.conftest import tokenmill
from tests.chaos.test_bad_inputs import MANIFEST, RECIPE, assert_one_line_error
from tests.conftest import build_query_run

RUN_DIRS: dict[str, tuple[Callable[[Path], Path], str]] = {
    # name: (the --run-dir, given the test's folder; what the error line says)
    "parent-is-a-file": (lambda root: root / "a-file" / "run", "a part of the path is a file, not a folder"),
    "run-dir-is-a-file": (lambda root: root / "a-file", "a file is in the way where a folder must be"),
    "new-folder-under-proc": (lambda root: Path("/proc/tokenmill-run"), "nothing can be created there"),
    "existing-folder-under-proc": (lambda root: Path("/proc/self"), "nothing can be created there"),
    "new-folder-under-sys": (lambda root: Path("/sys/tokenmill-run"), "cannot write there"),
}


def write_recipe(root: Path) -> Path:
    (root / "corpus").mkdir()
    (root / "corpus" / "a.txt").write_text("A small document, long enough to pass the quality filters.\n")
    (root / "m.yaml").write_text(MANIFEST)
    (root / "recipe.yaml").write_text(RECIPE)
    (root / "a-file").write_text("not a folder\n")
    return root / "recipe.yaml"


@pytest.mark.parametrize("name", list(RUN_DIRS))
def test_prepare_on_a_run_dir_it_cannot_write_is_one_line_naming_it(tmp_path: Path, name: str) -> None:
    run_dir, says = RUN_DIRS[name]
    result = tokenmill("prepare", write_recipe(tmp_path), "--run-dir", run_dir(tmp_path), timeout=120)
    line = assert_one_line_error(result, "cannot write there", says, "--run-dir")
    assert result.stderr.strip() == line, "nothing but the error line (no Prefect server was started)"
    assert (tmp_path / "a-file").read_text() == "not a folder\n"


def test_report_with_a_file_where_its_folder_must_be_is_one_line(tmp_path: Path) -> None:
    run = build_query_run(tmp_path / "run")
    shutil.rmtree(run / "report", ignore_errors=True)
    (run / "report").write_text("in the way\n")
    result = tokenmill("report", run, timeout=120)
    assert_one_line_error(result, f"{run / 'report'}: cannot write there", "a file is in the way")


def test_an_unwritable_folder_is_an_unwritable_error_that_is_still_an_os_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UnwritableError) as raised:
        write_text_atomic(tmp_path / "a-file" / "run.yaml", "name: x\n")
    assert isinstance(raised.value, OSError) and "a file is in the way" in str(raised.value)
    with pytest.raises(UnwritableError, match="nothing can be created there"), RunPaths(Path("/proc/no-run")).lock():
        pass
    with pytest.raises(UnwritableError, match="a part of the path is a file"):
        RunPaths(tmp_path / "a-file").append_text(tmp_path / "a-file" / "metrics" / "train.jsonl", "{}\n")
