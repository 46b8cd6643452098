"""The code a run would execute, and the one-line refusal when it comes from the run dir (:mod:`core.code_trust`).

``tokenmill eval RUN_DIR`` reads its settings from the run dir: a task folder it records, its ``eval/tasks/``,
a ``base_model/`` whose config.json names Python files (``auto_map``). :func:`refuse_untrusted_code` checks
them before a Prefect server starts or anything is imported from them; the same checks run again where the
code would be loaded (:func:`trainer.eval.lm_eval_tasks.task_manager`,
:func:`trainer.model.hf_model.load_causal_lm_config`).
"""

from __future__ import annotations

from pathlib import Path

from core.errors import ConfigError
from core.eval_results import VAL_SPLIT_TASK
from flows.recipe import ResolvedRun, model_source
from trainer.eval.task_folder_code import refuse_code_in_task_folders
from trainer.eval.tasks import include_dirs, recorded_include


def eval_task_folders(run: ResolvedRun) -> list[Path]:
    """The lm-eval task folders of the run's evaluation.

    From a recipe, its ``eval.include`` as it is now (and ``eval/tasks/`` when the built-in task is named); from
    ``tokenmill eval RUN_DIR`` (no recipe folder: the base is the run dir) the folders the eval-tasks stage
    resolved and recorded when the data were prepared.
    """
    recorded = recorded_include(run.paths) if run.base == run.paths.root else None
    return recorded or include_dirs(run.paths, run.recipe.eval, run.base)


def trusted_folders(run: ResolvedRun) -> list[str]:
    """The task folders whose Python and templates may run (those the recipe the user passed names), as text."""
    return sorted(str(folder) for folder in run.trust.task_folders)


def refuse_untrusted_code(run: ResolvedRun, task: str | None = None) -> None:
    """ConfigError (one line naming the file and key) when evaluating ``task`` (default every ``eval.tasks``)
    would run code the user did not name: a construct that runs code in a task folder not trusted, or model
    code :func:`refuse_untrusted_model_code` refuses."""
    if task not in (None, VAL_SPLIT_TASK) or (task is None and run.recipe.eval.tasks):
        folders = [folder for folder in [*eval_task_folders(run), run.paths.eval_tasks] if folder.is_dir()]
        refuse_code_in_task_folders(folders, run.trust.task_folders)
    refuse_untrusted_model_code(run)


def refuse_untrusted_model_code(run: ResolvedRun) -> None:
    """ConfigError naming the file when the launched trainer would import model code the user did not allow:
    ``base_model/config.json`` names Python files (``auto_map``) and the recipe passed does not set
    ``model.trust_remote_code``, or it does but ``base_model/`` holds other Python than the folder it names."""
    base_model_config = run.paths.base_model_config
    if not (run.recipe.model.is_hugging_face and base_model_config.is_file()):
        return
    from trainer.model.hf_model import refuse_model_code  # imports torch: only for a Hugging Face model

    refuse_model_code(base_model_config, run.trust.model_code)
    source = model_source(run.recipe, run.base)
    if run.trust.model_code and source is not None:
        from trainer.model.base_model import code_differences  # imports torch: only for remote code

        if differing := code_differences(source, run.paths.base_model):
            raise ConfigError(f"{run.paths.base_model / differing[0]}: not the file of the model folder the recipe "
                              f"names ({source}), and model.trust_remote_code would run it; run `tokenmill prepare` "
                              "with the recipe to bring that folder in again.")
