"""The config base every stage's settings build on, and loading YAML that users write (recipes, manifests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from core.errors import ConfigError


class FrozenConfig(BaseModel):
    """Base for every config: immutable, and an unknown (misspelt) key is an error."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def load_yaml_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """Read a YAML file that must hold a mapping; errors name the file and say what to fix."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: {what} file not found; check the path.")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{path}{where}: invalid YAML ({problem}); fix the syntax.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; save the {what} as UTF-8.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a {what} must be a YAML mapping of keys, got {type(data).__name__}.")
    return data


def describe_validation_error(err: ValidationError, source: str | Path) -> str:
    """One line per problem: ``file: key.path: message``, so the user knows which key to fix."""
    lines = []
    for problem in err.errors():
        key = ".".join(str(part) for part in problem["loc"]) or "(top level)"
        message = problem["msg"]
        if problem["type"] == "extra_forbidden":
            message = "unknown key (misspelt?); remove it or check the documented keys"
        lines.append(f"{source}: {key}: {message}")
    return "; ".join(lines)
