"""``accelerate launch`` for one process on one machine, without the extra process it starts.

Accelerate's simple launcher (one process, no distributed backend) is a Python process that imports torch and
Accelerate only to compute the environment of the child it then starts, which imports them again: 2.5 CPU-s and
~3 s of wall time per launch on a 2-core machine (a `python -c 'import torch'` child: 6.0 s under `accelerate
launch`, 2.1–3.0 s alone), paid by every `tokenmill train` and every evaluated checkpoint. Here Accelerate's own
parser, checks and ``prepare_simple_launcher_cmd_env`` compute that same command and environment, and the module
then runs in this process (``runpy``, as ``python -m`` runs it) under that environment, with torch's thread
count set to the ``OMP_NUM_THREADS`` the child would have started with. Anything that would make ``accelerate
launch`` pick another launcher (an Accelerate config file asking for FSDP, DeepSpeed, several processes…) is
handed to ``accelerate launch`` itself, unchanged.

    python -m trainer.parallel.launch_one [accelerate launch options] -m trainer.train --run-dir RUN
"""

from __future__ import annotations

import copy
import os
import runpy
import sys
from argparse import Namespace

from accelerate.commands.launch import _validate_launch_command, launch_command, launch_command_parser
from accelerate.utils import ComputeEnvironment
from accelerate.utils.launch import prepare_simple_launcher_cmd_env

from trainer.parallel.launch import exit_with_parent


def simple_launch(args: Namespace) -> Namespace | None:
    """``args`` as Accelerate checked them, when ``accelerate launch`` would use its simple launcher; else None."""
    checked, defaults, _ = _validate_launch_command(copy.deepcopy(args))
    other_launcher = (checked.use_deepspeed or checked.use_fsdp or checked.use_megatron_lm or checked.multi_gpu
                      or checked.tpu) and not checked.cpu
    sagemaker = defaults is not None and defaults.compute_environment == ComputeEnvironment.AMAZON_SAGEMAKER
    if other_launcher or sagemaker or not checked.module or checked.num_machines > 1:
        return None
    return checked


def main(argv: list[str] | None = None) -> None:
    exit_with_parent()  # the ranks' parent (here, or torchrun's agent in this process) dies with its launcher
    args = launch_command_parser().parse_args(argv)
    checked = simple_launch(args)
    if checked is None:
        launch_command(args)
        return
    _, environment = prepare_simple_launcher_cmd_env(checked)
    os.environ.clear()
    os.environ.update(environment)
    import torch  # after os.environ is the launcher's: torch reads it on import

    torch.set_num_threads(int(environment["OMP_NUM_THREADS"]))  # torch read the variable before it was set
    sys.argv = [checked.training_script, *checked.training_script_args]
    runpy.run_module(checked.training_script, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
