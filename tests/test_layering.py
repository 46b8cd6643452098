"""The dependency rule, held by the code's own imports: ``core`` stands alone, the stages stand on it, only
``flows`` sees everything (and Prefect). Every import statement of every module is read with ``ast``,
including imports inside functions, so a lazy import cannot slip past."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OWN_PACKAGES = ("core", "pipeline", "tokenization", "trainer", "flows")
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "pipeline": {"core"},
    "tokenization": {"core"},
    "trainer": {"core", "tokenization"},
    "flows": {"core", "pipeline", "tokenization", "trainer"},
}
"""Package -> the other own packages its modules may import."""
PREFECT_FREE = ("core", "pipeline", "tokenization", "trainer")


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports (``from x.y import z`` gives ``x.y``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def modules_of(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", OWN_PACKAGES)
def test_a_package_imports_only_the_packages_below_it(package: str) -> None:
    wrong = {
        f"{path.relative_to(REPO)} imports {name}"
        for path in modules_of(package)
        for name in imported_modules(path)
        if (top := name.split(".")[0]) in OWN_PACKAGES and top != package and top not in ALLOWED[package]
    }
    assert wrong == set()


@pytest.mark.parametrize("package", PREFECT_FREE)
def test_only_flows_imports_prefect(package: str) -> None:
    wrong = {f"{path.relative_to(REPO)} imports {name}" for path in modules_of(package)
             for name in imported_modules(path) if name.split(".")[0] in ("prefect", "prefect_dask")}
    assert wrong == set()


def test_the_rule_sees_an_upward_import(tmp_path: Path) -> None:
    """The walk finds imports inside functions too (tokenization importing pipeline lazily would break the rule)."""
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from pipeline.ingest.stage import plan_ingest\n    import flows.cli.commands\n")
    assert imported_modules(module) == {"pipeline.ingest.stage", "flows.cli.commands"}


def test_no_flows_module_shares_a_name_with_a_stage_module() -> None:
    """Prefect loads ``flows/pipeline.py`` by path for a deployment, and ``pipeline.X`` then found ``flows/X.py``
    first: a ``flows/query.py`` crashed every served and deployed run (ImportError from ``pipeline.sql.query``)."""
    stage_modules = {path.stem for package in ("pipeline", "tokenization", "trainer", "core")
                     for path in (REPO / package).glob("*.py")} - {"__init__"}
    assert not stage_modules & {path.stem for path in (REPO / "flows").glob("*.py")}
