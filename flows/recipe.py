"""A run recipe (``configs/<run>.yaml``): every stage's config composed into one validated ``RunRecipe``."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from pydantic import Field, ValidationError

from pipeline.config import (
    DataConfig,
    DedupeConfig,
    FrozenConfig,
    describe_validation_error,
    load_yaml_mapping,
)
from pipeline.errors import ConfigError
from tokenization.config import PackConfig, TokenizerConfig
from trainer.config import ModelConfig, TrainConfig

DEFAULT_RECIPE = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


class RunRecipe(FrozenConfig):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """Run name; the default run dir is ``runs/<name>``."""
    run_dir: str | None = None
    """Where the run writes (default ``runs/<name>``, relative to the working directory)."""
    data: DataConfig
    dedupe: DedupeConfig = DedupeConfig()
    tokenizer: TokenizerConfig
    pack: PackConfig = PackConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    dask_address: str | None = None
    """Run the data stages on this Dask scheduler (``tcp://host:port``) instead of local threads."""


def load_recipe(path: str | Path) -> tuple[RunRecipe, Path]:
    """Load and validate a recipe; returns it (paths as written) and its absolute folder.

    Relative manifest and tokenizer paths are taken from the recipe's folder (see
    :func:`manifest_paths`); ``run.yaml`` keeps them as written, so a run dir holds no absolute paths.
    """
    path = Path(path)
    data = load_yaml_mapping(path, "recipe")
    try:
        recipe = RunRecipe.model_validate(data)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, path)) from None
    base = path.resolve().parent
    for manifest in manifest_paths(recipe, base):
        if not manifest.is_file():
            problem = "is a folder, not a manifest file" if manifest.is_dir() else "does not exist"
            raise ConfigError(f"{path}: data.manifests: {manifest} {problem}; fix the path "
                              "(relative to the recipe's folder).")
    tokenizer_path = tokenizer_file(recipe, base)
    if tokenizer_path is not None and not tokenizer_path.is_file():
        problem = "is a folder, not a tokenizer.json file" if tokenizer_path.is_dir() else "does not exist"
        raise ConfigError(f"{path}: tokenizer.path: {tokenizer_path} {problem}; fix the path.")
    return recipe, base


def manifest_paths(recipe: RunRecipe, base: Path) -> list[Path]:
    """Absolute manifest paths (relative ones are taken from the recipe's folder ``base``)."""
    return [(base / manifest).resolve() for manifest in recipe.data.manifests]


def tokenizer_file(recipe: RunRecipe, base: Path) -> Path | None:
    """Absolute path of a given ``tokenizer.json``, or None when the recipe trains one."""
    return None if recipe.tokenizer.path is None else (base / recipe.tokenizer.path).resolve()


def resolve_run_dir(recipe: RunRecipe, run_dir: str | Path | None) -> Path:
    """The run dir: the CLI/flow argument, else the recipe's ``run_dir``, else ``runs/<name>``."""
    chosen = run_dir or recipe.run_dir or f"runs/{recipe.name}"
    return Path(chosen).resolve()


def recipe_to_yaml(recipe: RunRecipe) -> str:
    """The resolved recipe (all defaults filled in) as YAML, for ``run.yaml``.

    ``run_dir`` is left out: the run dir is wherever ``run.yaml`` lies (it may be copied elsewhere).
    """
    return yaml.safe_dump(recipe.model_dump(mode="json", exclude={"run_dir"}), sort_keys=False)


def is_safe_name(name: str) -> bool:
    """True for names usable as a folder (sources, runs)."""
    return re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name) is not None


# Sections whose change makes the existing data stages' outputs meaningless to mix with new ones.
DATA_SECTIONS = ("data", "dedupe", "tokenizer", "pack")


def source_weights(recipe: RunRecipe, base: Path) -> dict[str, float]:
    """``{source name: mixture weight}`` from the recipe's manifests (the trainer reads it from run.yaml)."""
    from pipeline.manifest import load_manifest

    return {source.name: source.weight for path in manifest_paths(recipe, base)
            for source in load_manifest(path).sources}


def _recorded_recipe(path: Path) -> RunRecipe:
    """The recipe recorded in ``run.yaml``, re-validated so keys added in later versions get their defaults."""
    recorded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    try:
        return RunRecipe.model_validate({key: recorded[key] for key in RunRecipe.model_fields if key in recorded})
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, path) + "; the run dir was written by an "
                          "incompatible tokenmill: use another --run-dir.") from None


def changed_data_keys(previous: RunRecipe, current: RunRecipe) -> list[str]:
    """Dotted keys of the data sections whose values differ (e.g. ``pack.seq_len``)."""
    def flatten(value: object, prefix: str) -> dict[str, object]:
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flatten(item, f"{prefix}.{key}").items()}
        return {prefix: value}

    old = flatten(previous.model_dump(mode="json", include=set(DATA_SECTIONS)), "")
    new = flatten(current.model_dump(mode="json", include=set(DATA_SECTIONS)), "")
    return sorted(key.lstrip(".") for key in set(old) | set(new) if old.get(key) != new.get(key))


def record_recipe(recipe: RunRecipe, base: Path, run_dir: Path, *, fresh: bool = False) -> None:
    """Write ``run.yaml`` (resolved recipe, source mixture weights, code version).

    Refuses a changed data recipe on an existing run dir: its documents, tokenizer and shards were made
    with the old settings. ``train`` and ``model`` may change (the trainer checks its checkpoints).
    ``fresh=True`` is the user's explicit "start over".
    """
    from pipeline.atomic import write_text_atomic
    from pipeline.rundir import CODE_VERSION

    path = run_dir / "run.yaml"
    if path.is_file() and not fresh:
        changed = changed_data_keys(_recorded_recipe(path), recipe)
        if changed:
            raise ConfigError(
                f"{path}: the recipe changed since this run dir was prepared ({', '.join(changed)}); "
                "use another --run-dir, or delete the run dir to start fresh."
            )
    mixture = yaml.safe_dump({"mixture": source_weights(recipe, base)}, sort_keys=True)
    write_text_atomic(path, recipe_to_yaml(recipe) + mixture + f"code_version: {CODE_VERSION}\n")
