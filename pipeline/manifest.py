"""Corpus manifests (``data_manifests/*.yaml``): which files make up a corpus and how to read them."""

from __future__ import annotations

import hashlib
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, PrivateAttr, ValidationError, field_validator, model_validator

from core.config import FrozenConfig, describe_validation_error, load_yaml_mapping
from core.errors import ConfigError, ManifestError
from core.files.path_limits import checked_name
from core.schemas import NAME_PATTERN
from pipeline.filters.language import LANGUAGE_CODES
from pipeline.filters.quality_classifier import check_model_file, label_names
from pipeline.filters.thresholds import decision_settings, measurement_settings
from pipeline.filters.web_filter_config import C4Config, FineWebConfig, GopherQualityConfig, GopherRepetitionConfig
from pipeline.globs import checked_glob
from pipeline.objects import ObjectPath, check_storage_options, check_url, is_remote

SourceFormat = Literal["jsonl", "parquet", "text", "hf_disk", "hf_local"]
HF_FORMATS = ("hf_disk", "hf_local")
"""Formats read through the ``datasets`` library (local paths only, never a hub name)."""

# Placeholders a manifest path may start with, expanded on the machine that runs the stage.
PATH_PLACEHOLDERS = {"${PYTHON_STDLIB}": lambda: sysconfig.get_paths()["stdlib"]}


class LanguageFilterConfig(FrozenConfig):
    """A manifest's ``filters.language``: keep documents identified as one of ``allowed`` with at least
    ``min_score`` (fastText's ``lid.176``, :mod:`pipeline.filters.language`); others are rejected as ``language``."""

    allowed: list[str] = Field(min_length=1)
    """ISO 639 codes of the languages to keep, as ``lid.176`` names them (``en``, ``de``, ``zh``, ``ceb``, ...)."""
    min_score: float = Field(default=0.65, ge=0.0, le=1.0)
    """Least probability (0..1) of the detected language; below it a document is rejected even in an allowed
    language (mixed-language, code or boilerplate text). 0.65 as in FineWeb's language filter."""

    @field_validator("allowed")
    @classmethod
    def _known_codes(cls, codes: list[str]) -> list[str]:
        unknown = [code for code in codes if code not in LANGUAGE_CODES]
        if unknown:
            raise ValueError(f"unknown language code(s) {unknown}; use lower-case ISO 639 codes as fastText's lid.176 "
                             "names them (en, de, fr, es, zh, ja, pt, ...; docs/data.md lists all 176)")
        return codes


class QualityClassifierConfig(FrozenConfig):
    """A manifest's ``filters.quality_classifier``: keep documents a fastText classifier gives at least
    ``min_score`` for ``label`` (:mod:`pipeline.filters.quality_classifier`); others are rejected as
    ``quality_classifier``."""

    path: str
    """The model file (fastText ``.bin``/``.ftz``), relative to the manifest's folder; e.g. one written by
    ``tokenmill classifier train``."""
    label: str = Field(default="positive", pattern=r"^\S+$")
    """The label whose probability is the score, with or without ``__label__`` (``tokenmill classifier train``
    names its labels ``positive`` and ``negative``)."""
    min_score: float = Field(default=0.5, ge=0.0, le=1.0)
    """Least probability (0..1) of ``label``; below it a document is rejected."""
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """sha256 of the model file: given, a different file is refused; left out, :func:`load_manifest` fills it in,
    so the ingest fingerprint and ``run.yaml`` change with the model's content."""
    _model_file: Path | None = PrivateAttr(default=None)

    def model_file(self) -> Path:
        """The checked model file, resolved by :func:`load_manifest` (ConfigError for a config built otherwise)."""
        if self._model_file is None:
            raise ConfigError("filters.quality_classifier was not loaded through pipeline.manifest.load_manifest, "
                              "which resolves and checks its path")
        return self._model_file


class FilterConfig(FrozenConfig):
    """A manifest's ``filters:``: the thresholds of the quality filters, each read by one row of
    ``pipeline.filters.screen.QUALITY_FILTERS`` (whose reason its docstring names), and PII redaction, which never
    rejects."""

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
    """Share of characters in lines repeating an earlier line above which a document is rejected (``duplicate_lines``;
    1.0: off)."""
    redact_pii: bool = False
    """Replace e-mail addresses with ``<EMAIL>`` and IPv4/IPv6 addresses with ``<IP>`` before hashing."""
    language: LanguageFilterConfig | None = None
    """Language identification (``language`` rejects); None (the default): off, no model is loaded."""
    gopher_repetition: GopherRepetitionConfig | None = None
    """Gopher's repetition rules (``gopher_repetition`` rejects); ``{}``: the published thresholds; None: off."""
    gopher_quality: GopherQualityConfig | None = None
    """Gopher's quality rules (``gopher_quality`` rejects); ``{}``: the published thresholds; None: off."""
    c4: C4Config | None = None
    """C4's line rules, removing lines, and page rules (``c4`` rejects); ``{}``: as published; None: off."""
    fineweb: FineWebConfig | None = None
    """FineWeb's line-level rules (``fineweb`` rejects); ``{}``: the published thresholds; None: off."""
    quality_classifier: QualityClassifierConfig | None = None
    """A fastText quality classifier (``quality_classifier`` rejects); None (the default): off."""

    @model_validator(mode="after")
    def _word_length_bounds_ordered(self) -> FilterConfig:
        if self.min_mean_word_length > self.max_mean_word_length:
            raise ValueError(f"min_mean_word_length={self.min_mean_word_length} is above "
                             f"max_mean_word_length={self.max_mean_word_length}; swap or fix them")
        return self


class SourceConfig(FrozenConfig):
    name: Annotated[str, Field(pattern=NAME_PATTERN), AfterValidator(checked_name)]
    """Source name: a shard folder (``source=<name>``) and the ``source`` column."""
    path: str
    """File or folder, relative to the manifest's folder; may start with ``${PYTHON_STDLIB}``; or an object or
    prefix in a bucket, ``s3://bucket/prefix/`` (any fsspec URL; jsonl, parquet and text formats)."""
    storage_options: dict[str, Any] = {}
    """Options of the fsspec filesystem of a ``s3://`` path, no secrets: ``endpoint_url``, ``region_name``,
    ``client_kwargs.endpoint_url``, ``anon``, … Credentials come from the AWS environment or config."""
    format: SourceFormat
    """How to read the files: jsonl (plain/.gz/.zst), parquet, text (one document per file), hf_disk (a
    ``save_to_disk`` folder), hf_local (json/jsonl/parquet/csv files through ``datasets.load_dataset``)."""
    glob: str = "**/*"
    """Files under ``path`` to read (when ``path`` is a folder)."""
    exclude: list[str] = []
    """Glob patterns (relative to ``path``) of files to skip."""
    records: Literal["text", "chat", "preference"] = "text"
    """What a record is: ``text`` (a document in ``text_field``), ``chat`` (a conversation: a ``messages`` list, or
    ``prompt``/``completion``, read by :mod:`core.conversations`) or ``preference`` (a pair: ``prompt`` or
    ``messages`` with ``chosen`` and ``rejected``, or ``chosen``/``rejected`` alone with an implicit prompt, read
    by :mod:`core.preference_pairs`); a record that is not one is rejected with its reason. A chat document's
    ``text`` is its messages' contents joined by a blank line, a pair's its prompt's (what dedupe, the filters and
    decontamination read: two pairs on one prompt dedupe to one); its ``record`` is the normalised conversation or
    pair the SFT or preference data stage renders."""
    text_field: str = "text"
    """Field/column holding the document text (jsonl, parquet, hf_disk, hf_local); not read with ``records: chat``
    or ``records: preference``."""
    id_field: str | None = None
    """Field/column holding the record's own id, kept as ``source_id``."""
    license: str | None = None
    """Licence of the source, recorded for the data team."""
    weight: float = Field(default=1.0, gt=0.0)
    """Mixture weight of this source in training batches."""
    on_error: Literal["fail", "skip"] = "fail"
    """A file that cannot be read at all: stop with an error (fail) or record one reject and go on (skip)."""

    @model_validator(mode="after")
    def _chat_records_have_fields(self) -> SourceConfig:
        if self.records != "text" and self.format == "text":
            raise ValueError(f"records: {self.records} needs a format whose records have fields (jsonl, parquet, "
                             "hf_disk, hf_local); format: text reads one document per file")
        return self

    @field_validator("storage_options")
    @classmethod
    def _no_secret_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        return check_storage_options(options)

    @field_validator("path")
    @classmethod
    def _no_credentials_in_url(cls, path: str) -> str:
        return check_url(path) if is_remote(path) else path

    @field_validator("glob")
    @classmethod
    def _glob_compiles(cls, pattern: str) -> str:
        return checked_glob(pattern)

    @field_validator("exclude")
    @classmethod
    def _excludes_compile(cls, patterns: list[str]) -> list[str]:
        return [checked_glob(pattern) for pattern in patterns]


class CorpusManifest(FrozenConfig):
    name: Annotated[str, Field(pattern=NAME_PATTERN), AfterValidator(checked_name)]
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
        manifest = CorpusManifest.model_validate(data)
    except ValidationError as err:
        raise ManifestError(describe_validation_error(err, path, CorpusManifest)) from None
    except ManifestError:
        raise
    except Exception as err:  # ConfigError from the YAML loader
        raise ManifestError(str(err)) from None
    if manifest.filters.quality_classifier is None:
        return manifest
    filters = manifest.filters.model_copy(
        update={"quality_classifier": checked_classifier(manifest.filters.quality_classifier, path)})
    return manifest.model_copy(update={"filters": filters})


@dataclass(frozen=True)
class ManifestFile:
    """A manifest loaded once (:func:`load_manifest_file`) and handed down with the file it came from: a source's
    relative path is taken from that file's folder, so every stage needs both."""

    path: Path
    """Absolute."""
    manifest: CorpusManifest


def load_manifest_file(path: str | Path) -> ManifestFile:
    """:func:`load_manifest` with its absolute path kept beside it."""
    path = Path(path).resolve()
    return ManifestFile(path, load_manifest(path))


def as_manifest_files(manifests: list[Path] | list[ManifestFile]) -> list[ManifestFile]:
    """Manifests as loaded by the caller (a flow's resolved run) kept as they are; paths (a test, a benchmark, a
    Python caller) loaded here."""
    return [item if isinstance(item, ManifestFile) else load_manifest_file(item) for item in manifests]


def checked_classifier(config: QualityClassifierConfig, manifest_path: str | Path) -> QualityClassifierConfig:
    """``config`` with its model file resolved (from the manifest's folder) and checked, and ``sha256`` filled in.

    Raises :class:`ManifestError` naming ``filters.quality_classifier.path``, ``.label`` or ``.sha256``.
    """
    key = f"{manifest_path}: filters.quality_classifier"
    model_file = Path(config.path)
    if not model_file.is_absolute():
        model_file = Path(manifest_path).resolve().parent / model_file
    try:
        stat = model_file.stat()
        labels, sha256 = check_model_file(model_file, stat.st_size, stat.st_mtime_ns, stat.st_ino)
    except (OSError, ValueError) as err:
        why = f"cannot be read ({err.strerror or err})" if isinstance(err, OSError) else str(err)
        raise ManifestError(f"{key}.path {config.path!r} (resolved to {model_file}) {why}; give a model written by "
                            "`tokenmill classifier train POSITIVE NEGATIVE --out FILE`, relative to the manifest's "
                            "folder") from None
    if "__label__" + config.label.removeprefix("__label__") not in labels:
        raise ManifestError(f"{key}.label {config.label!r} is not a label of {config.path}; it has: "
                            f"{label_names(labels)}")
    if config.sha256 is not None and config.sha256 != sha256:
        raise ManifestError(f"{key}.sha256 {config.sha256} is not the sha256 of {config.path} ({sha256}); the "
                            "model changed: use the one pinned, or pin the new one")
    checked = config.model_copy(update={"sha256": sha256})
    checked._model_file = model_file
    return checked


def resolve_source_path(source: SourceConfig, manifest_path: str | Path) -> Path | ObjectPath:
    """Absolute path of a source: placeholders expanded, relative paths taken from the manifest's folder; an
    :class:`ObjectPath` for a URL (``s3://…``) of a jsonl, parquet or text source (checked to exist)."""
    raw = source.path
    for placeholder, expand in PATH_PLACEHOLDERS.items():
        if raw.startswith(placeholder):
            raw = expand() + raw[len(placeholder) :]
    if is_remote(raw) and source.format not in HF_FORMATS:
        remote = ObjectPath(raw, dict(source.storage_options))
        if not remote.exists():
            raise ManifestError(
                f"{manifest_path}: sources[{source.name}].path {source.path!r}: no object or prefix there; check the "
                "bucket and prefix, and AWS_ENDPOINT_URL (or storage_options.endpoint_url) for a store other than AWS."
            )
        return remote
    if re.match(r"^[a-z][a-z0-9+.-]*://", raw):
        raise ManifestError(
            f"{manifest_path}: sources[{source.name}].path {source.path!r} looks like a remote or hub "
            f"name; {source.format} reads local files only (save the dataset with save_to_disk and point at it)."
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


# ---- comparing a manifest with the one a run dir was prepared with ---------------------------------

TRAINING_SIDE_KEYS = frozenset({"weight", "license"})
"""Source keys that may change on a prepared run dir: no data stage reads them. The trainer reads the mixture
weights from run.yaml at each launch (shards are per source, unweighted); the licence is metadata."""


def portable_manifest(manifest: CorpusManifest) -> CorpusManifest:
    """The manifest as ``run.yaml`` records it: source paths as written (relative or ``${PYTHON_STDLIB}/…``),
    except an absolute one, recorded as ``sha256:<hex>`` of its text.

    A run dir holds no absolute paths (it is copied and shared), yet a changed absolute path is still seen.
    Paths are compared as written, never resolved: a run dir, recipe and manifests copied to another folder
    or machine compare equal.
    """
    sources = [source.model_copy(update={"path": _portable_path(source.path)}) for source in manifest.sources]
    classifier = manifest.filters.quality_classifier
    if classifier is not None:
        classifier = classifier.model_copy(update={"path": _portable_path(classifier.path)})
        filters = manifest.filters.model_copy(update={"quality_classifier": classifier})
        return manifest.model_copy(update={"sources": sources, "filters": filters})
    return manifest.model_copy(update={"sources": sources})


def _portable_path(path: str) -> str:
    if not Path(path).is_absolute():
        return path
    return "sha256:" + hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def changed_manifest_keys(previous: list[CorpusManifest], current: list[CorpusManifest]) -> dict[str, list[str]]:
    """``{corpus name: changed keys}`` between two recipes' manifests, e.g. ``{"x": ["filters.max_chars",
    "sources[stdlib].glob"]}``; empty when every source would be read and measured as before (a threshold change,
    :func:`changed_threshold_keys`, is re-decided from stored attributes: not listed here).

    Sources are matched by name (unique across a recipe), each with its manifest's filters, so renaming a
    corpus, reordering manifests or moving a source between manifests with equal filters is no change. Keys in
    :data:`TRAINING_SIDE_KEYS` are ignored, and so is ``on_error`` going from ``fail`` to ``skip`` (under
    ``fail`` every completed part read all its files, so it holds what ``skip`` would have written).
    """
    old, new = _source_settings(previous), _source_settings(current)
    changed: dict[str, set[str]] = {}
    for name in sorted(old.keys() | new.keys()):
        corpus = (new.get(name) or old[name])[0]
        if name not in old:
            keys = {f"sources[{name}] (new source)"}
        elif name not in new:
            keys = {f"sources[{name}] (removed)"}
        else:
            keys = _changed_settings(name, old[name][1], new[name][1])
        if keys:
            changed.setdefault(corpus, set()).update(keys)
    return {corpus: sorted(keys) for corpus, keys in sorted(changed.items())}


def changed_threshold_keys(previous: list[CorpusManifest], current: list[CorpusManifest]) -> dict[str, list[str]]:
    """``{corpus name: changed threshold keys}`` (``filters.language.min_score``, ...) of the sources in both recipes:
    the changes :func:`changed_manifest_keys` leaves out, because a run re-decides them from stored attributes."""
    old, new = _source_thresholds(previous), _source_thresholds(current)
    changed: dict[str, set[str]] = {}
    for name in sorted(old.keys() & new.keys()):
        before, after = old[name][1], new[name][1]
        keys = {f"filters.{key}" for key in before.keys() | after.keys() if before.get(key) != after.get(key)}
        if keys:
            changed.setdefault(new[name][0], set()).update(keys)
    return {corpus: sorted(keys) for corpus, keys in sorted(changed.items())}


def _source_thresholds(manifests: list[CorpusManifest]) -> dict[str, tuple[str, dict[str, object]]]:
    return {source.name: (manifest.name, decision_settings(manifest.filters))
            for manifest in manifests for source in manifest.sources}


def _source_settings(manifests: list[CorpusManifest]) -> dict[str, tuple[str, dict[str, object]]]:
    """``{source name: (corpus name, {key: value})}``: what decides how the source is read and measured (its
    filters' thresholds are left out: :mod:`pipeline.filters.thresholds`)."""
    settings = {}
    for manifest in manifests:
        filters = {f"filters.{key}": value for key, value in measurement_settings(manifest.filters).items()}
        for source in manifest.sources:
            # storage_options say where the store answers (an endpoint), not what is read: moving is no change
            own = source.model_dump(mode="json", exclude={"name", "storage_options", *TRAINING_SIDE_KEYS})
            settings[source.name] = (manifest.name, {**own, **filters})
    return settings


def _changed_settings(name: str, old: dict[str, object], new: dict[str, object]) -> set[str]:
    keys = set()
    for key in old.keys() | new.keys():
        before, after = old.get(key), new.get(key)
        if before == after or (key == "on_error" and (before, after) == ("fail", "skip")):
            continue
        keys.add(key if key.startswith("filters.") else f"sources[{name}].{key}")
    return keys
