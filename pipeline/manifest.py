"""Corpus manifests (``data_manifests/*.yaml``): which files make up a corpus and how to read them."""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from pipeline.config import FrozenConfig, describe_validation_error, load_yaml_mapping
from pipeline.errors import ManifestError

SourceFormat = Literal["jsonl", "parquet", "text", "hf_disk", "hf_local"]
HF_FORMATS = ("hf_disk", "hf_local")
"""Formats read through the ``datasets`` library (local paths only, never a hub name)."""
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"

# Placeholders a manifest path may start with, expanded on the machine that runs the stage.
PATH_PLACEHOLDERS = {"${PYTHON_STDLIB}": lambda: sysconfig.get_paths()["stdlib"]}


class FilterConfig(FrozenConfig):
    min_chars: int = Field(default=1, ge=1)
    """Documents shorter than this (after normalisation) are rejected as ``too_short``."""
    max_chars: int = Field(default=2_000_000, ge=1)
    """Documents longer than this are rejected as ``too_long``."""
    max_control_char_fraction: float = Field(default=0.01, ge=0.0, le=1.0)
    """Share of control/NUL characters above which a document is rejected as ``binary``."""
    min_mean_word_length: float = Field(default=2.0, ge=0.0)
    """Mean characters per whitespace-separated word below which a document is rejected (``mean_word_length``)."""
    max_mean_word_length: float = Field(default=40.0, gt=0.0)
    """Mean characters per word above which a document is rejected (``mean_word_length``): base64, minified code."""
    max_symbol_ratio: float = Field(default=3.0, ge=0.0)
    """Non-space symbols per letter/digit above which a document is rejected (``symbol_ratio``): ASCII art, tables."""
    max_duplicate_line_fraction: float = Field(default=0.9, ge=0.0, le=1.0)
    """Share of characters in lines repeating an earlier line above which a document is rejected (1.0: off)."""
    redact_pii: bool = False
    """Replace e-mail addresses with ``<EMAIL>`` and IPv4/IPv6 addresses with ``<IP>`` before hashing."""

    @model_validator(mode="after")
    def _word_length_bounds_ordered(self) -> FilterConfig:
        if self.min_mean_word_length > self.max_mean_word_length:
            raise ValueError(f"min_mean_word_length={self.min_mean_word_length} is above "
                             f"max_mean_word_length={self.max_mean_word_length}; swap or fix them")
        return self


class SourceConfig(FrozenConfig):
    name: str = Field(pattern=NAME_PATTERN)
    """Source name: a shard folder (``source=<name>``) and the ``source`` column."""
    path: str
    """File or folder, relative to the manifest's folder; may start with ``${PYTHON_STDLIB}``."""
    format: SourceFormat
    """How to read the files: jsonl (plain/.gz/.zst), parquet, text (one document per file), hf_disk (a
    ``save_to_disk`` folder), hf_local (json/jsonl/parquet/csv files through ``datasets.load_dataset``)."""
    glob: str = "**/*"
    """Files under ``path`` to read (when ``path`` is a folder)."""
    exclude: list[str] = []
    """Glob patterns (relative to ``path``) of files to skip."""
    text_field: str = "text"
    """Field/column holding the document text (jsonl, parquet, hf_disk, hf_local)."""
    id_field: str | None = None
    """Field/column holding the record's own id, kept as ``source_id``."""
    license: str | None = None
    """Licence of the source, recorded for the data team."""
    weight: float = Field(default=1.0, gt=0.0)
    """Mixture weight of this source in training batches."""
    on_error: Literal["fail", "skip"] = "fail"
    """A file that cannot be read at all: stop with an error (fail) or record one reject and go on (skip)."""


class CorpusManifest(FrozenConfig):
    name: str = Field(pattern=NAME_PATTERN)
    """Corpus name."""
    sources: list[SourceConfig] = Field(min_length=1)
    """The corpus's sources; names must be unique across all manifests of a recipe."""
    filters: FilterConfig = FilterConfig()
    """Quality filters applied to every source of this manifest."""

    @field_validator("sources")
    @classmethod
    def _unique_source_names(cls, sources: list[SourceConfig]) -> list[SourceConfig]:
        names = [source.name for source in sources]
        duplicated = sorted({name for name in names if names.count(name) > 1})
        if duplicated:
            raise ValueError(f"source names must be unique, repeated: {duplicated}")
        return sources


def load_manifest(path: str | Path) -> CorpusManifest:
    """Load and validate a manifest; raise :class:`ManifestError` naming the file and key."""
    try:
        data = load_yaml_mapping(path, "manifest")
        return CorpusManifest.model_validate(data)
    except ValidationError as err:
        raise ManifestError(describe_validation_error(err, path)) from None
    except ManifestError:
        raise
    except Exception as err:  # ConfigError from the YAML loader
        raise ManifestError(str(err)) from None


def resolve_source_path(source: SourceConfig, manifest_path: str | Path) -> Path:
    """Absolute path of a source: placeholders expanded, relative paths taken from the manifest's folder."""
    raw = source.path
    for placeholder, expand in PATH_PLACEHOLDERS.items():
        if raw.startswith(placeholder):
            raw = expand() + raw[len(placeholder) :]
    if re.match(r"^[a-z][a-z0-9+.-]*://", raw):
        raise ManifestError(
            f"{manifest_path}: sources[{source.name}].path {source.path!r} looks like a remote or hub "
            "name; tokenmill reads local files only (save the dataset with save_to_disk and point at it)."
        )
    path = Path(raw)
    if not path.is_absolute():
        path = Path(manifest_path).resolve().parent / path
    try:
        path = path.resolve()
    except (RuntimeError, OSError) as err:  # a symlink loop: RuntimeError up to Python 3.12, OSError (ELOOP) since
        raise ManifestError(
            f"{manifest_path}: sources[{source.name}].path {source.path!r} cannot be resolved ({err}); "
            "fix the path or the symlink it goes through."
        ) from None
    if not path.exists() and source.format in HF_FORMATS:
        raise ManifestError(
            f"{manifest_path}: sources[{source.name}].path {source.path!r} is not an existing local path "
            f"(resolved to {path}); tokenmill never downloads hub datasets: load it with datasets, "
            "save_to_disk, and point path at that folder (relative to the manifest's folder)."
        )
    if not path.exists():
        raise ManifestError(
            f"{manifest_path}: sources[{source.name}].path {source.path!r} does not exist "
            f"(resolved to {path}); fix the path, relative to the manifest's folder."
        )
    return path
