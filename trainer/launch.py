"""Launch: a run dir -> the ``accelerate launch`` argv that starts ``trainer.train`` on 1..N processes.

The flow runs this argv as a subprocess (never through a shell). Facts behind the flags (FACTS.md):
``--num_processes 2`` alone, or with ``--cpu``, silently starts ONE process; ``--multi_gpu`` goes
through torchrun and, on a machine without GPUs, forms a gloo group (MULTI_CPU). The other flags only
pin Accelerate's defaults so it does not print a warning for each; ``--mixed_precision no`` does not
override the recipe, because the script passes ``train.precision`` to ``Accelerator`` explicitly.
"""

from __future__ import annotations

import sys
from pathlib import Path


def launch_command(run_dir: Path, num_processes: int, until_step: int | None = None,
                   allow_data_change: bool = False) -> list[str]:
    """argv for ``python -m accelerate.commands.launch … -m trainer.train --run-dir RUN``; num_processes >= 1."""
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    if num_processes > 1:
        command.append("--multi_gpu")
    command += ["--num_processes", str(num_processes), "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no",
                "-m", "trainer.train", "--run-dir", str(run_dir)]
    if until_step is not None:
        command += ["--until-step", str(until_step)]
    if allow_data_change:
        command.append("--allow-data-change")
    return command
