"""Typed, frozen settings for the data stages (the ``data`` and ``dedupe`` sections of a recipe)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.errors import ConfigError


class FrozenConfig(BaseModel):
    """Base for every config: immutable, and an unknown (misspelt) key is an error."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class DataConfig(FrozenConfig):
    manifests: list[str] = Field(min_length=1)
    """Corpus manifest paths, relative to the recipe's folder (or absolute)."""
    val_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    """Share of documents (by content hash) that go to the validation split."""
    part_size_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    """Small input files are grouped into ingest parts of about this many bytes (one task each)."""


class NearDedupeConfig(FrozenConfig):
    enabled: bool = True
    """Remove near-duplicates (MinHash + LSH) after exact dedupe."""
    threshold: float = Field(default=0.8, gt=0.0, le=1.0)
    """Estimated Jaccard similarity of shingle sets at or above which two documents are duplicates."""
    num_perm: int = Field(default=128, ge=16, le=1024)
    """MinHash permutations (signature length)."""
    ngram: int = Field(default=5, ge=1, le=32)
    """Shingle size in words."""
    exact_verify_margin: float = Field(default=0.1, ge=0.0, le=1.0)
    """Candidate pairs whose MinHash estimate is within this of the threshold are decided by exact shingle
    Jaccard (re-reading their texts); 0 decides by the estimate alone."""


class DecontaminateConfig(FrozenConfig):
    enabled: bool = False
    """Drop train documents sharing a long word n-gram with the val split or an eval file (after dedupe)."""
    ngram: int = Field(default=13, ge=3, le=32)
    """N-gram length in words (lower-cased, whitespace-separated); 13 as in the GPT-3 contamination study."""
    against_val: bool = True
    """Check train documents against this run's own validation split."""
    eval_files: list[str] = []
    """Eval files, relative to the recipe's folder: ``.jsonl[.gz|.zst]`` (a text per line) or text (one per file)."""
    eval_text_field: str = "text"
    """Field holding the text in jsonl evaluation files."""
    max_ngram_train_docs: int | None = Field(default=None, ge=1)
    """An n-gram found in more train documents than this is boilerplate (licence header, template) and
    alone does not contaminate; None: every shared n-gram counts."""


class DedupeConfig(FrozenConfig):
    exact: bool = True
    """Remove documents whose normalised text was already seen (in this or an earlier run)."""
    near: NearDedupeConfig = NearDedupeConfig()
    decontaminate: DecontaminateConfig = DecontaminateConfig()
    """Train/eval decontamination, run by ``pipeline.decontaminate.decontaminate_documents`` after dedupe."""


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
