"""Only ``core/rundir.py`` names a run's files: every other module asks :class:`core.rundir.RunPaths`.

Read with ``ast``, so docstrings and error messages that mention ``checkpoints/`` are fine, while a path built
by hand (``run_dir / "shards"``, ``Path("metrics") / …``, ``RunPaths(Path(run_dir))`` rebuilt from a string) fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "pipeline", "tokenization", "trainer", "flows")
LAYOUT_OWNER = REPO / "core" / "rundir.py"
RUN_DIR_NAMES = {"run.yaml", ".lock", "docs", "rejects", "dedupe", "tokenizer", "shards", "checkpoints", "metrics",
                 "model", "report", "stages"}
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
