"""Launch: a run dir -> the ``accelerate launch`` argv that starts ``trainer.train`` on 1..N processes.

The flow runs this argv as a subprocess (never through a shell). Facts behind the flags (docs/library-facts.md):
``--num_processes 2`` alone, or with ``--cpu``, silently starts ONE process; ``--multi_gpu`` goes
through torchrun and, on a machine without GPUs, forms a gloo group (MULTI_CPU). The other flags only
pin Accelerate's defaults so it does not print a warning for each; ``--mixed_precision no`` does not
override the recipe: the trainer does mixed precision itself (``trainer.precision``), and FSDP, tensor
parallelism or DeepSpeed come from the recipe (``trainer.parallel.accelerator``), not from flags here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from core.code_trust import TRUST_REMOTE_CODE_FLAG
from core.files.fence import fence_on, is_ancestor
from core.layout import RELATIVE, run_key
from core.rundir import RunPaths

LAUNCH_CONFIG_FLAG = "--resolved-config"
"""The flag with which a launched trainer or evaluator reads the configuration its flow resolved
(:attr:`core.rundir.RunPaths.launch_config`, :mod:`trainer.run_config`), not ``run.yaml``."""


def launch_command(run_dir: Path, num_processes: int, until_step: int | None = None,
                   allow_data_change: bool = False, *, num_machines: int = 1, machine_rank: int = 0,
                   main_process_ip: str | None = None, main_process_port: int = 29500,
                   module: str = "trainer.train", module_args: Sequence[str] = (),
                   trust_remote_code: bool = False, resolved: bool = False) -> list[str]:
    """argv for ``python -m accelerate.commands.launch … -m trainer.train --run-dir RUN``; num_processes >= 1.

    ``trust_remote_code``: the launching command allows the model folder's own Python (the recipe the user passed
    sets ``model.trust_remote_code``); the trainer never takes that from ``run.yaml`` (:mod:`core.code_trust`).
    ``resolved``: the trainer reads the configuration the flow resolved and wrote (``stages/launch.json``), not
    ``run.yaml`` (:mod:`trainer.run_config`).

    One process on one machine: ``python -m trainer.parallel.launch_one`` with the same options, which applies
    Accelerate's simple launcher in the process it runs the module in (:mod:`trainer.parallel.launch_one`: one torch
    start-up per launch instead of two). Several processes: ``python -m trainer.parallel.launch_one`` too, which hands
    them to ``accelerate launch`` in its own process, so that process (torchrun's agent, the ranks' parent) dies
    with its launcher (:func:`exit_with_parent`). Several machines: run the same argv on each with its own
    ``machine_rank`` (0 on the machine at ``main_process_ip``); ``num_processes`` counts the processes of ALL
    machines (Accelerate's convention).
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if num_machines > 1 and main_process_ip is None:
        raise ValueError("several machines need main_process_ip (the address of the machine with machine_rank 0)")
    command = [sys.executable, "-m", "trainer.parallel.launch_one"]
    if num_processes > 1:
        command.append("--multi_gpu")
    command += ["--num_processes", str(num_processes), "--num_machines", str(num_machines)]
    if OMP_THREADS_ENV not in os.environ:
        command += ["--num_cpu_threads_per_process", str(cpu_threads_per_process(num_processes, num_machines))]
    if num_machines > 1:
        command += ["--machine_rank", str(machine_rank), "--main_process_ip", str(main_process_ip),
                    "--main_process_port", str(main_process_port)]
    command += ["--mixed_precision", "no", "--dynamo_backend", "no", "-m", module, "--run-dir", str(run_dir)]
    if until_step is not None:
        command += ["--until-step", str(until_step)]
    if allow_data_change:
        command.append("--allow-data-change")
    if trust_remote_code:
        command.append(TRUST_REMOTE_CODE_FLAG)
    if resolved:
        command.append(LAUNCH_CONFIG_FLAG)
    return command + list(module_args)


def eval_launch_command(run_dir: Path, num_processes: int, step: int, *, score: bool, export: bool,
                        trust_remote_code: bool = False, resolved: bool = False, pairs: bool = False) -> list[str]:
    """argv for ``accelerate launch … -m trainer.eval.checkpoint``: evaluate one checkpoint on ``num_processes``
    (``pairs``: score a DPO run's preference pairs)."""
    flags = (["--step", str(step)] + (["--score"] if score else []) + (["--pairs"] if pairs else [])
             + (["--export"] if export else []))
    return launch_command(run_dir, num_processes, module="trainer.eval.checkpoint", module_args=flags,
                          trust_remote_code=trust_remote_code, resolved=resolved)


LOCK_SUFFIX = f"/{run_key(RELATIVE.lock_file)}"
"""How a descriptor's target ends when it is a run dir's lock."""
OMP_THREADS_ENV = "OMP_NUM_THREADS"


def cpu_threads_per_process(num_processes: int, num_machines: int = 1) -> int:
    """The CPU threads each launched rank gets: this machine's usable cores over its ranks, at least 1.

    ``accelerate launch`` sets ``OMP_NUM_THREADS`` in the ranks' environment to ``--num_cpu_threads_per_process``,
    which it defaults to 1 (not to the cores) unless ``--cpu`` is passed: a flow-launched CPU trainer then ran
    its matmuls on one core of two. Measured on a quiet 2-core machine, tiny preset, seq 256: 1 thread 2,049 and
    2,154 tokens/s, 2 threads 3,978 and 3,764 (1.8x). A user's own ``OMP_NUM_THREADS`` is left alone
    (launch_command passes no flag then).
    """
    ranks_here = max(1, num_processes // max(1, num_machines))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // ranks_here)


PARENT_PID_ENV = "TOKENMILL_PARENT_PID"


def parent_watch_env() -> dict[str, str]:
    """Environment telling the launched trainer which process to outlive no longer (see exit_with_parent)."""
    return {PARENT_PID_ENV: str(os.getpid())}


def launched_env() -> dict[str, str]:
    """What a flow adds to the environment of ``accelerate launch … -m trainer.…``: the parent watch, and
    ``PYTHONSAFEPATH=1``.

    ``python -m trainer.train`` puts the working folder first on ``sys.path``, so run from a project with a
    ``trainer/`` package of its own (a common name) it imported that package instead of tokenmill's and failed,
    or ran the wrong code. With PYTHONSAFEPATH (Python >= 3.11) ``-m`` finds tokenmill's installed package.
    """
    return {**parent_watch_env(), "PYTHONSAFEPATH": "1"}


def run_dir_lock(run_dir: Path) -> contextlib.AbstractContextManager[object]:
    """The run-dir lock a trainer process holds while it trains: one training job per run dir, whoever starts it.

    Only global rank 0 (``RANK``, unset = 0: one process) takes it; the other ranks of the launch run under
    rank 0's lock, so the ranks of one ``accelerate launch`` never refuse each other, whether it was started
    by hand or by the flow, on one machine or several sharing the run dir (the machines other than rank 0's
    take no lock, so a copy of the run dir local to one of them is not guarded). Rank 0 takes the lock before
    the process group forms: refused, it exits with the lock message and the launcher stops the other ranks.
    Launched by a flow that holds the lock (``TOKENMILL_PARENT_PID`` names that flow, an ancestor), rank 0
    shares it instead of being refused; started by hand, it takes it, and a ``tokenmill prepare`` is refused.
    """
    if int(os.environ.get("RANK", "0")) != 0:
        return contextlib.nullcontext()
    parent = os.environ.get(PARENT_PID_ENV)
    return RunPaths(run_dir).lock(launched_by=int(parent) if parent and parent.isdigit() else None)


def launched_fds(paths: RunPaths) -> tuple[int, ...]:
    """The descriptors a launched trainer inherits (``Popen(pass_fds=…)``): the run-dir lock this process holds.

    Sharing the lock's open file description, the launched process keeps the run dir locked until it is gone,
    even when its launcher is killed first: a re-run waits for it (:class:`core.runlock.RunLock`) instead of
    writing beside it. Empty when this process does not hold the lock itself.
    """
    fd = paths.held_lock_fd()
    return () if fd is None else (fd,)


PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal this process gets when the thread that started it exits (Linux)."""


def die_with_parent() -> bool:
    """Have the kernel SIGKILL this process the moment its parent exits (Linux ``PR_SET_PDEATHSIG``); False elsewhere.

    The signal comes when the *thread* that forked this process exits: the flow's run_streaming thread and
    torchrun's agent thread each wait for their child, so they outlive it unless their process dies.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def keep_lent_lock_here() -> None:
    """Stop the run-dir lock's descriptor this process inherited (:func:`launched_fds`) from going further.

    A process this one starts with ``exec`` (a tracker's service, a compiler worker) would otherwise hold the lock
    too, and keep the run dir locked after the trainer is gone. Python opens descriptors non-inheritable, so the
    inheritable ones here came through ``pass_fds``; only those open on a ``.lock`` file are changed.
    """
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            with contextlib.suppress(OSError):
                if fd > 2 and os.get_inheritable(fd) and os.readlink(f"/proc/self/fd/{fd}").endswith(LOCK_SUFFIX):
                    os.set_inheritable(fd, False)


_watching: list[int] = []
"""The launcher this process already watches (exit_with_parent runs in trainer.parallel.launch_one and again in the
module it runs in the same process)."""


def exit_with_parent(poll_s: float = 1.0) -> None:
    """Exit this process at once when the process that started it, or the one named in ``TOKENMILL_PARENT_PID``
    (the flow holding the run-dir lock), is gone.

    The flow that launched training may be killed with ``kill -9``. Three things keep the orphan from writing:
    the kernel kills it with its parent (:func:`die_with_parent`, set in every process tokenmill starts in the
    chain: trainer.parallel.launch_one, torchrun's agent in it, each rank); every run-dir write checks the launcher is
    still an ancestor first (:mod:`core.files.fence`: rank 0 through the lock it shares, the other ranks here); and,
    where the kernel cannot help, a watchdog polls the launcher every ``poll_s``. Every checkpoint and export is
    atomic, so exiting at any moment loses at most the steps since the last one.
    """
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not parent.isdigit() or _watching:
        return
    launcher = int(parent)
    _watching.append(launcher)
    die_with_parent()
    keep_lent_lock_here()
    if int(os.environ.get("RANK", "0")) != 0 and is_ancestor(launcher):
        fence_on(launcher)  # rank 0 is fenced through the lock its launcher lends it (core.runlock)

    def watch() -> None:
        while True:
            try:
                os.kill(launcher, 0)
            except ProcessLookupError:
                os._exit(137)
            time.sleep(poll_s)

    # Its first look comes at once: a launcher that died before the parent-death signal was set is caught here.
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
