"""Which code a command may run: decided once, from what the user passed, never from what a run dir holds.

A run dir is data from whoever made it (SECURITY.md). Some settings make tokenmill execute code: an lm-eval
task folder (``!function`` modules, Python task classes and hooks, Jinja templates, see
:mod:`trainer.eval.task_folder_code`) and a model folder's own Python (``auto_map`` with
``model.trust_remote_code``). They count only when they come from the recipe the user passed on this command
line, or that a Python caller passed explicitly. ``tokenmill eval RUN_DIR`` takes its settings from
``run.yaml``, which is data: its trust is :data:`NO_CODE`. The processes a command launches get its decision
as an argument (:data:`TRUST_REMOTE_CODE_FLAG`), never from ``run.yaml``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

TRUST_REMOTE_CODE_FLAG = "--trust-remote-code"
"""Argument of ``trainer.train`` and ``trainer.eval.checkpoint``: the launching command allows model code."""
HOW_TO_RUN_CODE = ("to run it deliberately, name the folder in eval.include of a recipe you pass (`tokenmill eval "
                   "RUN_DIR --recipe RECIPE`, `tokenmill train RECIPE`); a run dir's run.yaml never counts")
"""The end of every refusal: the one way to run such code on purpose."""


@dataclass(frozen=True)
class CodeTrust:
    """The code this command may run; :data:`NO_CODE` unless the user passed a recipe."""

    task_folders: frozenset[Path] = field(default_factory=frozenset)
    """lm-eval task folders (absolute) whose Python and templates may run: the passed recipe's ``eval.include``."""
    model_code: bool = False
    """A model folder's Python (``auto_map``) may run: the passed recipe sets ``model.trust_remote_code``."""

    @classmethod
    def of(cls, task_folders: Iterable[Path] = (), model_code: bool = False) -> CodeTrust:
        """The trust of folders and a model setting the user named (folders resolved, so any spelling matches)."""
        return cls(frozenset(Path(folder).resolve() for folder in task_folders), model_code)

    def trusts_task_folder(self, folder: Path) -> bool:
        return Path(folder).resolve() in self.task_folders


NO_CODE = CodeTrust()
"""Run nothing a run dir supplies: the trust of a run read from its ``run.yaml``."""
