"""A run recipe (``configs/<run>.yaml``): every stage's config composed into one validated ``RunRecipe``."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import AfterValidator, Field, ValidationError, model_validator

from core.bucket.run_dir import working_copy_root
from core.code_trust import NO_CODE, CodeTrust
from core.config import RUN_YAML_FIX, FrozenConfig, describe_validation_error, load_yaml_mapping
from core.documents import document_part_files
from core.errors import ConfigError
from core.files.path_limits import checked_name
from core.rundir import CODE_VERSION, RunPaths
from pipeline.config import DataConfig, DedupeConfig
from pipeline.manifest import (
    CorpusManifest,
    ManifestFile,
    changed_manifest_keys,
    changed_threshold_keys,
    load_manifest_file,
    portable_manifest,
)
from pipeline.objects import check_url, is_remote
from tokenization.chat.config import ChatConfig
from tokenization.chat.rendered import sources_with_records
from tokenization.config import PackConfig, TokenizerConfig
from trainer.config import EvalConfig, ModelConfig, TrainConfig
from trainer.loader.mixture_config import MixtureScheduleConfig
from trainer.run_config import TrainerSections

DEFAULT_RECIPE = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


class RunRecipe(FrozenConfig):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"), AfterValidator(checked_name)]
    """Run name; the default run dir is ``runs/<name>``."""
    run_dir: str | None = None
    """Where the run writes (default ``runs/<name>``, relative to the working directory)."""
    data: DataConfig
    dedupe: DedupeConfig = DedupeConfig()
    tokenizer: TokenizerConfig | None = None
    """None (no section): a Hugging Face model's own tokenizer (its folder's tokenizer.json); required otherwise."""
    pack: PackConfig = PackConfig()
    chat: ChatConfig | None = None
    """How sources with ``records: chat`` or ``records: preference`` render and mask (docs/recipe.md, ``chat``);
    None: the defaults."""
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    """The full evaluation after training: whole val split, per source, downstream tasks (see docs/evaluation.md)."""
    dask_address: str | None = None
    """Run the data stages on this Dask scheduler (``tcp://host:port``) instead of local threads."""
    mixture_schedule: MixtureScheduleConfig | None = None
    """Source weights by optimizer step, and max_repetition (docs/training.md); replaces the manifests' weights."""

    @model_validator(mode="after")
    def _tokenizer_fits_model(self) -> RunRecipe:
        if self.tokenizer is None and not self.model.is_hugging_face:
            raise ValueError("tokenizer: required with the built-in model; set tokenizer.vocab_size (train one) or "
                             "tokenizer.path (load one). Only a Hugging Face model (model.from_pretrained or "
                             "model.hf_config) brings its own tokenizer")
        if self.tokenizer is not None and self.tokenizer.vocab_size is not None and self.model.from_pretrained:
            raise ValueError("tokenizer.vocab_size cannot be combined with model.from_pretrained: the pretrained "
                             "embedding is indexed by the model's own token ids; remove the tokenizer section (use "
                             "the model's tokenizer) or set tokenizer.path to a tokenizer that fits the model")
        return self


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
        raise ConfigError(describe_validation_error(err, path, RunRecipe)) from None
    base = path.resolve().parent
    for manifest in manifest_paths(recipe, base):
        if not manifest.is_file():
            problem = "is a folder, not a manifest file" if manifest.is_dir() else "does not exist"
            raise ConfigError(f"{path}: data.manifests: {manifest} {problem}; fix the path "
                              "(relative to the recipe's folder).")
    model_path = model_source(recipe, base)
    if model_path is not None and not model_path.exists():
        key = "from_pretrained" if recipe.model.from_pretrained is not None else "hf_config"
        raise ConfigError(f"{path}: model.{key}: {model_path} does not exist; fix the path (relative to the "
                          "recipe's folder). Models are read from local folders only, never downloaded.")
    tokenizer_path = tokenizer_file(recipe, base)
    if tokenizer_path is not None and not tokenizer_path.is_file():
        problem = "is a folder, not a tokenizer.json file" if tokenizer_path.is_dir() else "does not exist"
        raise ConfigError(f"{path}: tokenizer.path: {tokenizer_path} {problem}; fix the path.")
    return recipe, base


def manifest_paths(recipe: RunRecipe, base: Path) -> list[Path]:
    """Absolute manifest paths (relative ones are taken from the recipe's folder ``base``)."""
    return [(base / manifest).resolve() for manifest in recipe.data.manifests]


def tokenizer_file(recipe: RunRecipe, base: Path) -> Path | None:
    """Absolute path of a given ``tokenizer.json``, or None when the recipe trains one or uses the model's."""
    if recipe.tokenizer is None or recipe.tokenizer.path is None:
        return None
    return (base / recipe.tokenizer.path).resolve()


def model_source(recipe: RunRecipe, base: Path) -> Path | None:
    """Absolute path of the recipe's ``model.from_pretrained`` / ``model.hf_config``; None for the built-in model."""
    written = recipe.model.hugging_face_path
    return None if written is None else (base / written).resolve()


def resolve_run_dir(recipe: RunRecipe, run_dir: str | Path | None) -> Path:
    """The run dir: the CLI/flow argument, else the recipe's ``run_dir``, else ``runs/<name>``.

    A bucket URL (``s3://bucket/runs/NAME``) resolves to its local working copy (:mod:`core.bucket.run_dir`),
    which the ``tokenmill`` command pulls before and publishes after the flow.
    """
    url = run_dir_url(recipe, run_dir)
    if url is not None:
        return working_copy_root(url)
    chosen = run_dir or recipe.run_dir or f"runs/{recipe.name}"
    return Path(chosen).resolve()


def run_dir_url(recipe: RunRecipe, run_dir: str | Path | None) -> str | None:
    """The chosen run dir when it is a URL in a bucket (``--run-dir`` first, then the recipe's), else None."""
    chosen = str(run_dir or recipe.run_dir or "")
    if not is_remote(chosen):
        return None
    try:
        return check_url(chosen.rstrip("/"))
    except ValueError as err:
        raise ConfigError(f"run_dir: {err}") from None


@dataclass(frozen=True)
class RunRecord:
    """``run.yaml`` as a command found it: read and validated once (:func:`read_record`), then compared with the
    recipe (:func:`refuse_changed_recipe`) and, for ``tokenmill eval RUN_DIR``, the run's recipe itself."""

    path: Path
    recipe: RunRecipe
    """Re-validated: keys added in later versions get their defaults."""
    manifests: list[CorpusManifest] | None
    """The manifests' content as recorded; None when a tokenmill that did not record them wrote the file."""
    data: dict[str, Any]
    """The file's mapping as read (its ``mixture`` is what a launched trainer of a recorded run is given)."""


@dataclass(frozen=True)
class ResolvedRun:
    """A recipe, its manifests and the run dir's ``run.yaml``, each read and validated once, with the run dir they
    resolve to: what an entry hands its flows and stages down, so that no stage reads them again.

    The flows take it in place of a recipe path, so one ``tokenmill run`` reads the recipe once; a deployment
    still starts them with a path (see :func:`as_resolved`).
    """

    recipe: RunRecipe
    base: Path
    """The recipe's folder (absolute): relative manifest and tokenizer paths are taken from it."""
    paths: RunPaths
    trust: CodeTrust = NO_CODE
    """The code this run may execute: what the recipe the user passed names (:func:`recipe_trust`), nothing when the
    recipe was read from the run dir's run.yaml."""
    manifests: tuple[ManifestFile, ...] = ()
    """The recipe's manifests in its order, loaded once; none for a run read from its run.yaml (its recipe's folder,
    which relative manifest paths are taken from, is unknown)."""
    record: RunRecord | None = None
    """``run.yaml`` as the command found it; None for a new run dir."""


def resolve_run(recipe_path: str | Path, run_dir: str | Path | None = None) -> ResolvedRun:
    """Read the recipe at ``recipe_path``; its run dir is ``run_dir``, else the recipe's, else ``runs/<name>``.

    The recipe is the user's (a command-line argument, a deployment's parameter, a Python caller's path): the
    task folders and model code it names may run.
    """
    return resolve_loaded(*load_recipe(recipe_path), run_dir)


def resolve_loaded(recipe: RunRecipe, base: Path, run_dir: str | Path | None = None) -> ResolvedRun:
    """:func:`resolve_run` for a recipe already loaded (:func:`load_recipe`): its manifests and the run dir's
    ``run.yaml`` are read here, once. A run dir in a bucket: call it once its working copy is pulled."""
    paths = RunPaths(resolve_run_dir(recipe, run_dir))
    manifests = tuple(load_manifest_file(path) for path in manifest_paths(recipe, base))
    return ResolvedRun(recipe, base, paths, recipe_trust(recipe, base), manifests, read_record(paths))


def recipe_trust(recipe: RunRecipe, base: Path) -> CodeTrust:
    """The code a recipe the user passed allows: its ``eval.include`` folders, ``model.trust_remote_code``."""
    return CodeTrust.of([base / folder for folder in recipe.eval.include], recipe.model.trust_remote_code)


def resolve_recorded_run(run_dir: str | Path) -> ResolvedRun:
    """The run as its ``run.yaml`` records it (``tokenmill eval RUN_DIR``: no recipe file needed).

    Relative paths in it were relative to the recipe's folder, which is unknown here: they are taken from the
    run dir, and stages that need them read what they recorded instead (the eval-tasks stage its folders).
    run.yaml is data from whoever made the run dir: the run may execute none of the code it names (NO_CODE).
    """
    paths = RunPaths(Path(run_dir).resolve())
    if not paths.recipe.is_file():
        if paths.recipe.is_dir():
            raise ConfigError(f"{paths.recipe}: a folder where the run's recipe file must be; move it out of the "
                              "way, or give a run dir that tokenmill wrote (runs/<name>).")
        raise ConfigError(f"{paths.root}: no run.yaml; give a run dir that tokenmill wrote (runs/<name>).")
    record = read_record(paths)
    assert record is not None  # the file is there
    return ResolvedRun(record.recipe, paths.root, paths, NO_CODE, record=record)


def read_record(paths: RunPaths) -> RunRecord | None:
    """The run dir's ``run.yaml``, read and validated (the recipe, then the manifests); None when there is none."""
    path = paths.recipe
    if path.is_dir():
        raise ConfigError(f"{path}: a folder where the run's recipe file must be; move it out of the way, or use "
                          "another --run-dir.")
    if not path.is_file():
        return None
    data = load_yaml_mapping(path, "run recipe", RUN_YAML_FIX)
    return RunRecord(path, _recorded_recipe(path, data), _recorded_manifests(path, data), data)


def as_resolved(recipe: str | Path | ResolvedRun, run_dir: str | Path | None = None) -> ResolvedRun:
    """A flow's run: ``recipe`` as it is when its caller already resolved it, else read from its path.

    ``run_dir`` goes with a recipe path only (a resolved run has its run dir); both is a caller's mistake.
    """
    if not isinstance(recipe, ResolvedRun):
        loaded, base = load_recipe(recipe)
        if run_dir_url(loaded, run_dir) is not None:
            raise ConfigError(f"{recipe}: run dir {run_dir_url(loaded, run_dir)} is in a bucket; the `tokenmill` "
                              "command (run, prepare, train) pulls, locks and publishes such a run dir, a "
                              "deployment or a flow called from Python does not yet: give a local run_dir here.")
        return resolve_loaded(loaded, base, run_dir)
    if run_dir is not None:
        raise ValueError(f"run_dir={run_dir!r} given with an already resolved run ({recipe.paths.root}); "
                         "pass it to resolve_run instead.")
    return recipe


def recipe_to_yaml(recipe: RunRecipe) -> str:
    """The resolved recipe (all defaults filled in) as YAML, for ``run.yaml``.

    ``run_dir`` is left out: the run dir is wherever ``run.yaml`` lies (it may be copied elsewhere).
    """
    return yaml.safe_dump(recipe.model_dump(mode="json", exclude={"run_dir"}), sort_keys=False)


# Sections whose change makes the existing data stages' outputs meaningless to mix with new ones.
DATA_SECTIONS = ("data", "dedupe", "tokenizer", "pack")


def _mixture(manifests: list[CorpusManifest]) -> dict[str, float]:
    return {source.name: source.weight for manifest in manifests for source in manifest.sources}


def _recorded_recipe(path: Path, recorded: dict[str, Any]) -> RunRecipe:
    """The recipe recorded in ``run.yaml``, re-validated so keys added in later versions get their defaults."""
    try:
        return RunRecipe.model_validate({key: recorded[key] for key in RunRecipe.model_fields if key in recorded})
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, path, RunRecipe) + "; the run dir was written by an "
                          "incompatible tokenmill: use another --run-dir.") from None


def _recorded_manifests(path: Path, recorded: dict[str, Any]) -> list[CorpusManifest] | None:
    """The manifests recorded in ``run.yaml`` (re-validated: later keys get their defaults), or None when
    the run dir was prepared by a tokenmill that did not record them."""
    if "manifests" not in recorded:
        return None
    items = recorded["manifests"]
    try:
        if not isinstance(items, list):
            raise ValueError(f"manifests: a list of manifests, not {type(items).__name__}")
        return [CorpusManifest.model_validate(item) for item in items]
    except (ValidationError, ValueError) as err:
        detail = (describe_validation_error(err, path, CorpusManifest) if isinstance(err, ValidationError)
                  else f"{path}: {err}")
        raise ConfigError(detail + "; the run dir was written by an incompatible tokenmill: use another "
                          "--run-dir.") from None


def changed_data_keys(previous: RunRecipe, current: RunRecipe) -> list[str]:
    """Dotted keys of the data sections whose values differ (e.g. ``pack.seq_len``)."""
    def flatten(value: object, prefix: str) -> dict[str, object]:
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flatten(item, f"{prefix}.{key}").items()}
        return {prefix: value}

    old = flatten(previous.model_dump(mode="json", include=set(DATA_SECTIONS)), "")
    new = flatten(current.model_dump(mode="json", include=set(DATA_SECTIONS)), "")
    return sorted(key.lstrip(".") for key in set(old) | set(new) if old.get(key) != new.get(key))


def recipe_changes(record: RunRecord, recipe: RunRecipe, manifests: list[CorpusManifest]) -> list[str]:
    """What changed since ``run.yaml`` (``record``) was written: data-section keys (``pack.seq_len, …``), then
    one ``manifest corpus 'x': filters.min_chars, sources[s].glob`` per corpus whose content changed.

    Manifests are compared by content (:func:`pipeline.manifest.changed_manifest_keys`), so ``data.manifests``
    (the manifests' path strings) may change. A run dir prepared before manifests were recorded is compared
    as before (recipe sections only, ``data.manifests`` included), with a warning; its manifests are recorded
    now, so later changes are seen.
    """
    data_keys = changed_data_keys(record.recipe, recipe)
    previous = record.manifests
    if previous is None:
        warnings.warn(f"{record.path} was written by an earlier tokenmill that did not record the manifests' content: "
                      "a manifest changed before this run is not detected; the current manifests are recorded "
                      "now, and later changes are refused.", stacklevel=3)
        return data_keys
    by_corpus = changed_manifest_keys(previous, manifests)
    data_part = [", ".join(key for key in data_keys if key != "data.manifests")]
    manifest_parts = [f"manifest corpus '{corpus}': {', '.join(keys)}" for corpus, keys in by_corpus.items()]
    return [part for part in data_part + manifest_parts if part]


def refuse_changed_recipe(recipe: RunRecipe, base: Path, run_dir: Path) -> None:
    """:func:`refuse_changed_run` for a recipe loaded by the caller (:func:`load_recipe`) and a run dir."""
    refuse_changed_run(resolve_loaded(recipe, base, run_dir))


def refuse_changed_run(run: ResolvedRun) -> None:
    """ConfigError when the run dir was prepared with other data settings (what :func:`record_run` refuses).

    The CLI calls it before a Prefect server starts, so the refusal is one line in well under a second.
    """
    _refuse_changes(run, _portable(run))


def _portable(run: ResolvedRun) -> list[CorpusManifest]:
    return [portable_manifest(item.manifest) for item in run.manifests]


def _refuse_changes(run: ResolvedRun, manifests: list[CorpusManifest]) -> None:
    record = run.record
    if record is None:
        return
    if changed := recipe_changes(record, run.recipe, manifests):
        raise ConfigError(f"{record.path}: the recipe changed since this run dir was prepared ({'; '.join(changed)}); "
                          "use another --run-dir, or delete the run dir to start fresh.")
    thresholds = changed_threshold_keys(record.manifests, manifests) if record.manifests is not None else {}
    unattributed = [name for name in _ingested_part_names(run.paths) if not (run.paths.attributes / name).is_file()]
    if thresholds and unattributed:
        keys = "; ".join(f"manifest corpus '{corpus}': {', '.join(keys)}" for corpus, keys in thresholds.items())
        raise ConfigError(f"{record.path}: thresholds changed ({keys}) but {len(unattributed)} ingested part(s) have "
                          f"no attributes/ to re-decide from (ingested by an earlier tokenmill, e.g. "
                          f"{unattributed[0]}); use another --run-dir, or delete the run dir to start fresh.")


def _ingested_part_names(paths: RunPaths) -> list[str]:
    """``part-NNNNN.parquet`` of each ingested documents part of the run."""
    return [part.name for part in document_part_files(paths)]


def record_recipe(recipe: RunRecipe, base: Path, run_dir: Path) -> None:
    """:func:`record_run` for a recipe loaded by the caller (:func:`load_recipe`) and a run dir."""
    record_run(resolve_loaded(recipe, base, run_dir))


def record_run(run: ResolvedRun) -> None:
    """Write ``run.yaml`` (resolved recipe, resolved manifests, source mixture weights, code version).

    Refuses a changed data recipe on an existing run dir, in the recipe's data sections or in any manifest it
    names (filters, a source's path, format, glob, fields, a new or removed source): its documents, tokenizer
    and shards were made with the old settings. ``train``, ``model`` and the sources' ``weight`` and
    ``license`` may change (the trainer reads the mixture from run.yaml and checks its checkpoints); new files
    in a source folder are the refresh's business, not a change. So may a filter's thresholds
    (:data:`pipeline.filters.thresholds.THRESHOLD_KEYS`): ingest re-decides its parts from their stored attributes, and
    run.yaml records the new manifests. To start over, the user deletes the run dir (or its ``run.yaml``), as the
    error says. Compared with ``run.yaml`` as the command found it (``run.record``): read once, not again here.
    """
    _refuse_changes(run, _portable(run))
    check_mixture_schedule(run.recipe, _mixture([item.manifest for item in run.manifests]))
    recorded = run_yaml_mapping(run)
    manifests = yaml.safe_dump({"manifests": recorded["manifests"]}, sort_keys=False)
    mixture = yaml.safe_dump({"mixture": recorded["mixture"]}, sort_keys=True)
    run.paths.write_text(run.paths.recipe, recipe_to_yaml(run.recipe) + manifests + mixture
                         + f"code_version: {CODE_VERSION}\n")


def run_yaml_mapping(run: ResolvedRun) -> dict[str, Any]:
    """What ``run.yaml`` records for a run resolved from its recipe: the recipe with every default filled in (no
    ``run_dir``), the manifests as portable content, the source mixture weights and the code version."""
    recipe = run.recipe
    mixture = None if recipe.mixture_schedule else _mixture([item.manifest for item in run.manifests])
    return {**recipe.model_dump(mode="json", exclude={"run_dir"}),
            "manifests": [manifest.model_dump(mode="json") for manifest in _portable(run)],
            "mixture": mixture, "code_version": CODE_VERSION}


def write_launch_config(run: ResolvedRun) -> None:
    """Write the resolved configuration a launched trainer or evaluator reads (``stages/launch.json``): the run's
    ``model``, ``train`` and mixture sections, as this command validated them (:mod:`trainer.run_config`), so
    that the launched process reads one file once instead of ``run.yaml`` again. A run read from its run.yaml
    (``tokenmill eval RUN_DIR``) gives the mixture that file records."""
    recorded = run_yaml_mapping(run) if run.manifests or run.record is None else run.record.data
    sections = TrainerSections(model=run.recipe.model, train=run.recipe.train, mixture=recorded.get("mixture"),
                               mixture_schedule=run.recipe.mixture_schedule, recipe=recorded)
    run.paths.write_json(run.paths.launch_config, sections.model_dump(mode="json"))


def check_mixture_schedule(recipe: RunRecipe, weights: dict[str, float]) -> None:
    """ConfigError for a schedule naming a source no manifest has; a warning when it overrides manifest weights."""
    if recipe.mixture_schedule is None:
        return
    for index, stage in enumerate(recipe.mixture_schedule.stages):
        unknown = sorted(set(stage.weights) - set(weights))
        if unknown:
            raise ConfigError(f"mixture_schedule.stages[{index}].weights: unknown source(s) {unknown} (the manifests "
                              f"name {sorted(weights)}); fix the name or remove it")
    weighted = sorted(name for name, weight in weights.items() if weight != 1.0)
    if weighted:
        warnings.warn(f"the manifests' weights of {weighted} have no effect: the recipe's mixture_schedule sets the "
                      "mix (remove the weights, or the mixture_schedule)", stacklevel=3)


def check_chat_template(run: ResolvedRun) -> None:
    """ConfigError (one line) before any work when the recipe has chat or preference sources (``records: chat``,
    ``records: preference``) but no Hugging Face model to render them with, or a chat template that does not fit the
    model's tokenizer (it emits special tokens the tokenizer lacks, or fails on a plain conversation):
    :func:`tokenization.chat.template.load_chat_template` on the model folder the recipe names and its
    ``chat.template_file``. Imports transformers only for such a run."""
    by_records = {records: sources for records in ("chat", "preference")
                  if (sources := sources_with_records(run, records))}
    if not by_records or not run.manifests:
        return
    source = model_source(run.recipe, run.base)
    if source is None:
        records, sources = next(iter(by_records.items()))
        raise ConfigError(f"sources {sources} have records: {records}, which render with a Hugging Face model's "
                          "tokenizer and chat template; set model.from_pretrained (or model.hf_config) to a local "
                          "model folder")
    from tokenization.chat.template import load_chat_template  # transformers (~2 s): only for a chat run

    chat = run.recipe.chat or ChatConfig()
    template_file = None if chat.template_file is None else (run.base / chat.template_file).resolve()
    load_chat_template(source if source.is_dir() else source.parent, template_file)
