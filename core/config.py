"""The config base every stage's settings build on, and loading YAML that users write (recipes, manifests)."""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.errors import ConfigError
from core.seeds import MAX_SEED

Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
"""A random seed a user sets: ``0 <= seed <= MAX_SEED`` (-1 or 2**64 would fail deep inside torch or numpy)."""

RUN_YAML_FIX = ("tokenmill wrote this file: delete it and re-run `tokenmill prepare` with the run's recipe to "
                "write it again, or use another --run-dir")
"""What to do about a damaged ``run.yaml`` (:func:`load_yaml_mapping`'s ``fix``)."""

YAML_KINDS = {bool: "true/false value", int: "number", float: "number", str: "string", list: "list"}
"""What a YAML document that is not a mapping holds, in the words of an error message."""


class FrozenConfig(BaseModel):
    """Base for every config: immutable, and an unknown (misspelt) key is an error.

    So is a float that is not finite (``.inf``, ``.nan`` in YAML): no setting means infinity (a mixture
    weight of ``.inf`` would starve every other source, a learning rate of ``.inf`` diverge at once); a limit
    that can be off says so with ``null``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def load_yaml_mapping(path: str | Path, what: str, fix: str | None = None) -> dict[str, Any]:
    """Read a YAML file that must hold a mapping; errors name the file (and line) and say what to fix.

    ``fix`` replaces the usual advice (fix the syntax, save as UTF-8, …) for a file the user did not write
    (``run.yaml``: :data:`RUN_YAML_FIX`).
    """
    path = Path(path)
    if not path.is_file():
        problem = f"a folder, not a {what} file" if path.is_dir() else f"{what} file not found"
        raise ConfigError(f"{path}: {problem}; check the path.")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{path}{where}: invalid YAML ({problem}); {fix or 'fix the syntax'}.") from None
    except RecursionError:  # the parser recurses once per level of [ or {: thousands of them exhaust the stack
        raise ConfigError(f"{path}: invalid YAML (nested too deeply to read); {fix or 'fix the syntax'}.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; {fix or f'save the {what} as UTF-8'}.") from None
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"a {YAML_KINDS.get(type(data), type(data).__name__)}"
        raise ConfigError(f"{path}: a {what} must be a YAML mapping of keys (key: value lines), got {got}; "
                          f"{fix or 'write its keys as key: value lines'}.")
    return data


def describe_validation_error(err: ValidationError, source: str | Path,
                              model: type[BaseModel] | None = None) -> str:
    """One line per problem: ``file: key.path: message``, so the user knows which key to fix.

    ``model``: the model that was validated; with it an unknown key names the near one it may be a typo of
    (``train.max_stpes: unknown key (misspelt?); did you mean `max_steps`?``).
    """
    lines = []
    for problem in err.errors():
        key = ".".join(str(part) for part in problem["loc"]) or "(top level)"
        message = problem["msg"]
        if problem["type"] == "extra_forbidden":
            near = near_key(model, problem["loc"]) if model is not None else None
            hint = f"did you mean `{near}`? " if near else ""
            message = f"unknown key (misspelt?); {hint}remove it or check the documented keys"
        elif problem["type"] == "value_error":  # a validator's own message; pydantic prefixes "Value error, "
            message = str(problem.get("ctx", {}).get("error", message))
        elif problem["type"] == "finite_number":
            message = f"must be a finite number, got {problem['input']!r}; give a number (no .inf or .nan)"
        lines.append(f"{source}: {key}: {message}")
    return "; ".join(lines)


def near_key(model: type[BaseModel], loc: tuple[int | str, ...]) -> str | None:
    """The documented key closest to the unknown ``loc[-1]`` among the keys of the model(s) ``loc`` leads to.

    The path is followed through nested models, lists, dicts and unions: a part that is not a key of the
    models reached so far (a list index, a dict key, pydantic's union tag) keeps them.
    """
    models = {model}
    for part in loc[:-1]:
        fields = [found.model_fields[part] for found in models if isinstance(part, str) and part in found.model_fields]
        if fields:
            models = {nested for field in fields for nested in _models_in(field.annotation)}
    names = {alias for found in models for name, field in found.model_fields.items()
             for alias in (name, field.alias) if alias}
    matches = difflib.get_close_matches(str(loc[-1]), sorted(names), n=1, cutoff=0.6) if loc else []
    return matches[0] if matches else None


def _models_in(annotation: Any) -> set[type[BaseModel]]:
    """The pydantic models an annotation holds (``Model``, ``Model | None``, ``list[Model]``, ``dict[str, Model]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return {annotation}
    return {found for argument in typing.get_args(annotation) for found in _models_in(argument)}
