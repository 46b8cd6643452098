"""The recipe reference matches the code: docs/recipe.md lists every key of ``RunRecipe`` with its default, and
its annotated recipe block names every key. Both are read against the config classes, so a key added to a
config without its documentation (``train.eval_batches``, ``log_every``, ``deadline_minutes`` were) fails here."""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from flows.recipe import RunRecipe

REPO = Path(__file__).resolve().parents[2]
TABLE_ROW = re.compile(r"^\| `([a-z_]+)` \| `([^`]*)` \| (.+) \|$")


def recipe_keys(model: type[BaseModel] = RunRecipe, prefix: str = "") -> dict[str, FieldInfo]:
    """``{dotted key: field}`` for every key a recipe may set, sections included (``train``, ``train.lr``)."""
    keys: dict[str, FieldInfo] = {}
    for name, field in model.model_fields.items():
        keys[prefix + name] = field
        for section in typing.get_args(field.annotation) or (field.annotation,):
            if isinstance(section, type) and issubclass(section, BaseModel):
                keys.update(recipe_keys(section, f"{prefix}{name}."))
    return keys


def documented_defaults(text: str) -> dict[str, str]:
    """``{dotted key: default cell}`` from docs/recipe.md's tables (``## Top level``, ``## `train` ``, …)."""
    found: dict[str, str] = {}
    prefix = None
    for line in text.splitlines():
        if line.startswith("## "):
            heading = line[3:].strip()
            prefix = "" if heading == "Top level" else heading.strip("`") + "."
        elif (row := TABLE_ROW.match(line)) and prefix is not None:
            key = prefix + row.group(1)
            assert key not in found, f"docs/recipe.md lists {key} twice"
            found[key] = row.group(2)
    return found


def default_cell(field: FieldInfo) -> str | object:
    """What the default column must say: ``required``, ``(section)``, or the default as JSON (parsed)."""
    if field.is_required():
        return "required"
    if isinstance(field.default, BaseModel):
        return "(section)"
    return json.loads(json.dumps(field.default))


def test_docs_recipe_lists_every_key_with_its_default_and_no_other() -> None:
    documented = documented_defaults((REPO / "docs" / "recipe.md").read_text(encoding="utf-8"))
    keys = recipe_keys()
    assert {"train.eval_batches", "train.log_every", "train.deadline_minutes"} <= set(keys)
    assert sorted(set(keys) - set(documented)) == [], "keys missing from docs/recipe.md"
    assert sorted(set(documented) - set(keys)) == [], "docs/recipe.md lists keys the recipe does not have"
    for key, field in keys.items():
        expected, cell = default_cell(field), documented[key]
        written = cell if cell in ("required", "(section)") else json.loads(cell)
        assert written == expected, f"docs/recipe.md: {key} default {cell}, the code says {expected!r}"


def readme_recipe_block() -> str:
    """The annotated recipe in docs/recipe.md (it was the README's recipe reference)."""
    page = (REPO / "docs" / "recipe.md").read_text(encoding="utf-8")
    return page.split("## The whole recipe, annotated", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]


def test_the_readme_recipe_block_names_every_key_in_its_section() -> None:
    block = readme_recipe_block()
    sections = re.split(r"^(?=#? ?[a-z_]+:)", block, flags=re.MULTILINE)  # one chunk per top-level key
    by_section = {re.match(r"#? ?([a-z_]+):", chunk).group(1): chunk for chunk in sections if chunk.strip()}
    missing = [key for key in recipe_keys()
               if key.split(".")[0] not in by_section
               or not re.search(rf"\b{key.split('.')[-1]}\b", by_section[key.split(".")[0]])]
    assert missing == [], "keys the README's recipe block does not name"


def test_the_readme_recipe_block_is_a_valid_recipe() -> None:
    """Its uncommented keys load as a RunRecipe: none is misspelt or stale."""
    RunRecipe.model_validate(yaml.safe_load(readme_recipe_block()))
