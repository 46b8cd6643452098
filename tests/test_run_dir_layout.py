"""Only ``core/rundir.py`` names a run's files, and only ``core/`` writes them by hand: every other module asks
:class:`core.rundir.RunPaths` for a path and writes through it (``paths.write_json``, ``paths.atomic_write``,
``paths.mark_done``, ``paths.lock()``, …).

Read with ``ast``, so docstrings and error messages that mention ``checkpoints/`` are fine, while a path built
by hand (``run_dir / "shards"``, ``Path("metrics") / …``, ``RunPaths(Path(run_dir))`` rebuilt from a string) fails,
and so does a call of the atomic-write helpers or of ``RunLock`` outside ``core/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "pipeline", "tokenization", "trainer", "flows")
LAYOUT_OWNER = REPO / "core" / "rundir.py"
RUN_DIR_NAMES = {"run.yaml", ".lock", "docs", "rejects", "dedupe", "tokenizer", "shards", "checkpoints", "metrics",
                 "model", "report", "stages", "eval", "attributes"}
"""The top-level entries of a run dir (README, "runs/<name>/")."""


def _names_a_run_dir_entry(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split("/", 1)[0] in RUN_DIR_NAMES
    if isinstance(node, ast.JoinedStr) and node.values:
        return _names_a_run_dir_entry(node.values[0])
    return False


def _call_name(node: ast.Call) -> str:
    return node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")


def hand_built_paths(source: str) -> list[tuple[int, str]]:
    """(line, code) of every run-dir path built outside RunPaths in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        joined = isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and _names_a_run_dir_entry(node.right)
        made = isinstance(node, ast.Call) and _call_name(node) in {"Path", "joinpath"} and bool(node.args) \
            and _names_a_run_dir_entry(node.args[0])
        if joined or made:
            found.append(node)
        elif isinstance(node, ast.Call) and _call_name(node) == "RunPaths" and node.args \
                and isinstance(node.args[0], ast.Call) and _call_name(node.args[0]) == "Path":
            found.append(node)  # RunPaths takes a str or a Path as it is; resolve it once, pass it down
    return sorted((node.lineno, ast.unparse(node)) for node in found)


def test_the_check_finds_each_kind_of_hand_built_path() -> None:
    code = ('a = run_dir / "shards" / "index.parquet"\nb = Path("metrics") / "tensorboard"\n'
            'c = RunPaths(Path(run_dir))\nd = root / f"checkpoints/step-{n}"\ne = root.joinpath("stages")\n'
            'f = folder / "manifest.json"\n"""run_dir / "shards" in a docstring"""\n')
    assert [line for line, _ in hand_built_paths(code)] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_builds_a_run_dir_path_by_hand(package: str) -> None:
    offenders = [f"{path.relative_to(REPO)}:{line}: {code}"
                 for path in sorted((REPO / package).rglob("*.py")) if path != LAYOUT_OWNER
                 for line, code in hand_built_paths(path.read_text(encoding="utf-8"))]
    assert not offenders, "ask core.rundir.RunPaths for these (add a property there):\n" + "\n".join(offenders)


WRITE_HELPERS = {"atomic_path", "write_bytes_atomic", "write_text_atomic", "write_json_atomic", "remove_stale_temps",
                 "RunLock"}
"""core.atomic's writers and core.runlock's lock: RunPaths's methods call them; nothing outside core/ does."""
HELPER_MODULES = {"atomic", "core.atomic", "runlock", "core.runlock"}


def _calls_a_write_helper(node: ast.AST) -> bool:
    """``write_json_atomic(…)`` or ``atomic.write_json_atomic(…)``; ``paths.remove_stale_temps(…)`` is RunPaths's."""
    if not isinstance(node, ast.Call) or _call_name(node) not in WRITE_HELPERS:
        return False
    return isinstance(node.func, ast.Name) or ast.unparse(node.func.value) in HELPER_MODULES


def direct_writes(source: str) -> list[tuple[int, str]]:
    """(line, code) of every call of an atomic-write helper or of RunLock in ``source``."""
    return sorted((node.lineno, ast.unparse(node)) for node in ast.walk(ast.parse(source))
                  if _calls_a_write_helper(node))


def test_the_write_check_finds_each_helper_call() -> None:
    code = ('write_json_atomic(paths.stages / "x.json", {})\nwith atomic_path(target) as tmp:\n    pass\n'
            'atomic.write_text_atomic(p, "t")\nRunLock(root)\npaths.write_json(p, {})\npaths.lock()\n'
            'paths.remove_stale_temps(folder)\nremove_stale_temps(folder)\n')
    assert [line for line, _ in direct_writes(code)] == [1, 2, 4, 5, 9]


WRITES_OUTSIDE_A_RUN_DIR = {("pipeline/quality_classifier.py", "atomic_path(out)")}
"""(module, call) of the atomic writes of files that are no run dir's: ``tokenmill classifier train --out``'s model."""


@pytest.mark.parametrize("package", [package for package in PACKAGES if package != "core"])
def test_no_module_outside_core_writes_run_dir_files_by_hand(package: str) -> None:
    offenders = [f"{module}:{line}: {code}"
                 for path in sorted((REPO / package).rglob("*.py"))
                 for module in [path.relative_to(REPO).as_posix()]
                 for line, code in direct_writes(path.read_text(encoding="utf-8"))
                 if (module, code) not in WRITES_OUTSIDE_A_RUN_DIR]
    assert not offenders, "write through core.rundir.RunPaths (paths.write_json, paths.atomic_write, " \
                          "paths.mark_done, paths.lock(), …):\n" + "\n".join(offenders)
