"""What a trainer or an evaluator is configured by: the recipe's ``model`` and ``train`` sections and the mixture.

A process that the flow launches reads the resolved configuration the flow wrote for it
(``stages/launch.json``, :attr:`core.rundir.RunPaths.launch_config`): validated once by the command, written once,
read once here, with the same section models the recipe is made of. Started by hand
(``python -m trainer.train --run-dir RUN``), it reads the same sections from ``run.yaml``, the run's record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError, model_validator

from core.config import RUN_YAML_FIX, FrozenConfig, describe_validation_error, load_yaml_mapping
from core.errors import ConfigError
from core.files.atomic import read_json
from core.rundir import RunPaths
from trainer.config import ModelConfig, TrainConfig, check_tensor_parallel_dims
from trainer.loader.mixture_config import MixtureScheduleConfig
from trainer.parallel.launch import LAUNCH_CONFIG_FLAG

SECTIONS = ("model", "train", "mixture", "mixture_schedule")
"""The keys of a recipe (``run.yaml``) the trainer reads; the rest belongs to other stages."""


class TrainerSections(FrozenConfig):
    """The recipe sections the trainer reads (the rest of run.yaml belongs to other stages); the format of the
    resolved configuration a launched trainer or evaluator reads."""

    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    mixture: dict[str, Annotated[float, Field(ge=0)]] | None = None
    """Sampling weight per source name (from the corpus manifests); None = every train row equally likely."""
    mixture_schedule: MixtureScheduleConfig | None = None
    """Weights that change by step (the recipe's ``mixture_schedule``); replaces ``mixture``."""
    recipe: dict[str, Any] = {}
    """The whole recipe as ``run.yaml`` records it: the trackers' config of the run (shown, never interpreted)."""
    chat_template_file: str | None = None
    """The chat template file the chat data stage rendered the conversations with (absolute, or relative to the run
    dir), written into every export so that ``apply_chat_template`` on it renders what training saw. Not a recipe
    key: the launching flow resolves it; None = the run's ``tokenizer/chat_template.jinja`` if present, else the base
    model's own template (exported with its tokenizer files)."""

    @model_validator(mode="after")
    def _one_mixture(self) -> TrainerSections:
        if self.mixture is not None and self.mixture_schedule is not None:
            raise ValueError("mixture and mixture_schedule are both set; keep one (a recipe with a "
                             "mixture_schedule records no mixture: remove the mixture section)")
        dpo = self.train.dpo
        if dpo is not None and dpo.uses_reference and self.model.from_pretrained is None:
            raise ValueError("train.mode dpo with train.dpo.loss sigmoid needs model.from_pretrained: the reference "
                             "model is the run's base model (the SFT model it continues from); set "
                             "model.from_pretrained, or use train.dpo.loss: simpo (reference-free)")
        return self


def read_trainer_config(run_dir: Path, trust_remote_code: bool = False, resolved: bool = False) -> TrainerSections:
    """Validate ``model``, ``train``, ``mixture`` and ``mixture_schedule`` of ``RUN/run.yaml`` (``resolved``: of the
    configuration the launching flow wrote, ``RUN/stages/launch.json``); raises ConfigError naming the key to fix.

    ``model.trust_remote_code`` is ``trust_remote_code``, the launching command's decision (``--trust-remote-code``),
    whatever the run dir records: a run dir is data and never decides that its own code runs (:mod:`core.code_trust`).
    """
    paths = RunPaths(run_dir)
    path = paths.launch_config if resolved else paths.recipe
    recipe = _read_launch_config(path) if resolved else load_yaml_mapping(path, "run recipe", RUN_YAML_FIX)
    sections: dict[str, Any] = {key: recipe[key] for key in SECTIONS if recipe.get(key) is not None}
    sections["recipe"] = recipe.get("recipe", {}) if resolved else recipe
    if isinstance(sections.get("model"), dict):
        sections["model"] = {**sections["model"], "trust_remote_code": trust_remote_code}
    try:
        config = TrainerSections.model_validate(sections)
        if not config.model.is_hugging_face:  # a Hugging Face model's dims are checked once its config is read
            check_tensor_parallel_dims(config.model.resolved_dims(), config.train.tensor_parallel_size)
    except (ValidationError, ValueError) as err:
        message = (describe_validation_error(err, path, TrainerSections) if isinstance(err, ValidationError)
                   else f"{path}: {err}")
        raise ConfigError(message) from None
    return config


def _read_launch_config(path: Path) -> dict[str, Any]:
    """The resolved configuration as the flow wrote it; one line naming the file when it is missing or damaged."""
    fix = "the flow writes it before it launches: re-run the tokenmill command, or start the trainer without " \
          f"{LAUNCH_CONFIG_FLAG} to read run.yaml"
    try:
        data = read_json(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no resolved configuration; {fix}.") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: cannot be read ({type(err).__name__}: {err}); {fix}.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a mapping of sections; {fix}.")
    return data
