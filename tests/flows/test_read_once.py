"""Issue 35, item 5: the recipe and each manifest are read and validated once per command, ``run.yaml`` at most once,
and a launched trainer or evaluator reads the configuration its flow resolved (``stages/launch.json``) once, never
``run.yaml``.

Counted, not inferred: every YAML file tokenmill reads goes through ``core.config.load_yaml_mapping``, wrapped here
(in every module that took it by name) to count the files it reads, while real ``tokenmill prepare`` commands run in
this process. One core (``os.cpu_count``), so the ingest part runs here too and its reads are counted with the rest
(on more cores it runs in a worker process, which is handed the manifest the command loaded).
"""

from __future__ import annotations

import collections
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

import core.config
from tests.flows.conftest import write_small_recipe

Counts = collections.Counter[str]


def count_yaml_reads(monkeypatch: pytest.MonkeyPatch) -> Counts:
    """``{file name: reads}`` of every YAML file read from now on in this process."""
    import flows.cli.commands
    import flows.pipeline  # imported now: its modules' names are wrapped below

    counts: Counts = collections.Counter()
    original = core.config.load_yaml_mapping

    def counting(path: str | Path, what: str, fix: str | None = None) -> dict[str, Any]:
        counts[Path(path).name] += 1
        return original(path, what, fix)

    for module in list(sys.modules.values()):
        if getattr(module, "load_yaml_mapping", None) is original:
            monkeypatch.setattr(module, "load_yaml_mapping", counting)
    monkeypatch.setattr(flows.cli.commands, "_print_summary", lambda summary: None)
    return counts


def tokenmill(*args: str) -> None:
    """The ``tokenmill`` command, in this process."""
    from flows.cli.commands import app

    typer.main.get_command(app)(list(args), standalone_mode=False)


@pytest.fixture
def in_process_cli(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The command in this process on one core (its ingest part too), its state and console filters undone after."""
    import flows.cli.commands

    monkeypatch.setattr("os.cpu_count", lambda: 1)
    monkeypatch.setattr(flows.cli.commands, "STATE", dict(flows.cli.commands.STATE))
    filters = {handler: list(handler.filters) for handler in logging.getLogger().handlers}
    yield
    for handler, kept in filters.items():
        handler.filters[:] = kept


def count_reads(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...]) -> Counts:
    """``{file name: reads}`` of the files named ``names``, whatever reads them (``Path.read_text``)."""
    counts: Counts = collections.Counter()
    original: Callable[..., str] = Path.read_text

    def counting(self: Path, *args: Any, **kwargs: Any) -> str:
        if self.name in names:
            counts[self.name] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counting)
    return counts


def test_the_command_reads_the_recipe_each_manifest_and_run_yaml_once_and_a_launched_process_its_file_once(
        tmp_path: Path, prefect_server: None, in_process_cli: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tokenmill prepare`` on a new run dir, then again through its flow; then what ``python -m trainer.train`` and
    ``python -m trainer.eval.checkpoint`` do when the flow launches them (its flag, and the file the flow wrote, as
    ``train-model`` does before it launches), run in this process."""
    recipe = write_small_recipe(tmp_path, packages=("json",))
    with monkeypatch.context() as patch:
        counts = count_yaml_reads(patch)
        tokenmill("prepare", str(recipe))
        assert counts == {"recipe.yaml": 1, "manifest.yaml": 1}, "a new run dir has no run.yaml to read"
        for seal in (tmp_path / "run" / "stages" / "sealed").iterdir():
            seal.unlink()  # the re-run goes through the flow and every stage, not the command's seal
        counts.clear()
        tokenmill("prepare", str(recipe))
        assert counts == {"recipe.yaml": 1, "manifest.yaml": 1, "run.yaml": 1}

    from accelerate.state import AcceleratorState, GradientState

    from flows.recipe import resolve_run, write_launch_config
    from trainer import train
    from trainer.eval import checkpoint as eval_checkpoint
    from trainer.parallel.launch import LAUNCH_CONFIG_FLAG, eval_launch_command, launch_command

    write_launch_config(resolve_run(recipe))
    run_dir = str(tmp_path / "run")
    assert LAUNCH_CONFIG_FLAG in launch_command(Path(run_dir), 1, resolved=True)
    assert LAUNCH_CONFIG_FLAG in eval_launch_command(Path(run_dir), 1, 1, score=True, export=False, resolved=True)
    for main, args in ((train.main, ["--until-step", "1"]), (eval_checkpoint.main, ["--step", "1", "--score"])):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        with monkeypatch.context() as patch:
            counts = count_reads(patch, ("run.yaml", "launch.json"))
            assert main(["--run-dir", run_dir, *args, LAUNCH_CONFIG_FLAG]) == 0
        assert counts == {"launch.json": 1}, main.__module__
