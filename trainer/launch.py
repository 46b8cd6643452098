"""Launch: a run dir -> the ``accelerate launch`` argv that starts ``trainer.train`` on 1..N processes.

The flow runs this argv as a subprocess (never through a shell). Facts behind the flags (FACTS.md):
``--num_processes 2`` alone, or with ``--cpu``, silently starts ONE process; ``--multi_gpu`` goes
through torchrun and, on a machine without GPUs, forms a gloo group (MULTI_CPU). The other flags only
pin Accelerate's defaults so it does not print a warning for each; ``--mixed_precision no`` does not
override the recipe, because the script passes ``train.precision`` to ``Accelerator`` explicitly.
"""

from __future__ import annotations

import os
import sys
import threading
import time
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


PARENT_PID_ENV = "TOKENMILL_PARENT_PID"


def parent_watch_env() -> dict[str, str]:
    """Environment telling the launched trainer which process to outlive no longer (see exit_with_parent)."""
    return {PARENT_PID_ENV: str(os.getpid())}


def exit_with_parent(poll_s: float = 1.0) -> None:
    """Exit this process soon after the process named in ``TOKENMILL_PARENT_PID`` is gone.

    The flow that launched training may be killed with ``kill -9``; its run-dir lock dies with it,
    and an orphaned trainer would keep writing into a run dir that a re-run then also writes. Every
    checkpoint and export is atomic, so exiting at any moment loses at most the steps since the last one.
    """
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent:
        return

    def watch() -> None:
        while True:
            try:
                os.kill(int(parent), 0)
            except ProcessLookupError:
                os._exit(137)
            time.sleep(poll_s)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
