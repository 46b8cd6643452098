"""The flows' decorator: a flow run shows the recipe it ran, readably, not the resolved run's internals.

Prefect records a flow run's parameters with FastAPI's ``jsonable_encoder``, which turns the
:class:`flows.recipe.ResolvedRun` the commands hand their flows (read once) into every field of every section, the
defaults included, plus its code-trust and path objects (1,875 characters on the quick start). The run page shows
instead the recipe's name, folder and run dir and the settings it sets to other than their defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import Flow

from flows.recipe import ResolvedRun


def shown(run: ResolvedRun) -> dict[str, Any]:
    """What a flow run's page shows for ``run``: ``{"recipe", "folder", "run_dir", "settings"}``."""
    return {"recipe": run.recipe.name, "folder": str(run.base), "run_dir": str(run.paths.root),
            "settings": run.recipe.model_dump(mode="json", exclude_defaults=True)}


class RecipeFlow(Flow):
    """A Prefect flow whose ResolvedRun parameters are recorded as :func:`shown` gives them."""

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        return super().serialize_parameters(
            {key: shown(value) if isinstance(value, ResolvedRun) else value for key, value in parameters.items()})

    def with_options(self, **options: Any) -> RecipeFlow:
        copy = super().with_options(**options)
        copy.__class__ = RecipeFlow  # Prefect builds a plain Flow; the copy (a Dask task runner's) shows alike
        return copy


def recipe_flow(**options: Any) -> Callable[[Callable[..., Any]], RecipeFlow]:
    """``@flow(**options)`` for the flows that take a recipe (path or resolved run)."""
    def decorate(function: Callable[..., Any]) -> RecipeFlow:
        return RecipeFlow(fn=function, **options)

    return decorate
