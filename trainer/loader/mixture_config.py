"""The ``mixture_schedule`` recipe section: stages of source weights by optimizer step, and max_repetition.

The trainer reads it from run.yaml (:func:`trainer.train.build_mixture` turns it into a
:class:`trainer.loader.mixture.MixtureOrder`); the flow's recipe carries it there unchanged.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from core.config import FrozenConfig


class MixtureStageConfig(FrozenConfig):
    """One stage: these weights from the step after the previous stage's ``until_step`` to its own."""

    until_step: int | None = Field(default=None, ge=1)
    """Last optimizer step of the stage (inclusive); null only on the last stage (= until training ends)."""
    weights: dict[str, Annotated[float, Field(ge=0)]]
    """Sampling weight per source name (any scale; 0 leaves a source out of this stage); every train source."""


class MixtureScheduleConfig(FrozenConfig):
    """Source weights that change during the run; replaces the manifests' static ``mixture``."""

    stages: list[MixtureStageConfig] = Field(min_length=1)
    """The stages in step order; a run continued past the last ``until_step`` keeps the last stage's weights."""
    max_repetition: dict[str, Annotated[float, Field(gt=0)]] = {}
    """{source: epochs}: a source is dropped from the mix before it would be seen more epochs than this (the
    others renormalised); training stops with an error when no source of the stage is left. Absent: no limit."""

    @model_validator(mode="after")
    def _stages_in_step_order(self) -> MixtureScheduleConfig:
        for index, (stage, following) in enumerate(zip(self.stages, self.stages[1:], strict=False)):
            if stage.until_step is None:
                raise ValueError(f"stages[{index}].until_step: only the last stage may leave it out (null); give "
                                 "the step this stage ends at")
            if following.until_step is not None and following.until_step <= stage.until_step:
                raise ValueError(f"stages[{index + 1}].until_step: {following.until_step} is not after stages"
                                 f"[{index}].until_step {stage.until_step}; list the stages in step order")
        unknown = sorted(set(self.max_repetition) - {name for stage in self.stages for name in stage.weights})
        if unknown:
            raise ValueError(f"max_repetition: source(s) {unknown} have no weight in any stage; fix the name or "
                             "remove them")
        return self
