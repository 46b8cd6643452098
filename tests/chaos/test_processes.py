"""One process per run dir whatever starts it, and no process outlives tokenmill.

A trainer started by hand (``python -m trainer.train``, ``accelerate launch``) holds the run-dir lock as the CLI
does, the ranks of one launch never refuse each other, and a flow-launched 2-rank training shares the flow's
lock. A temporary Prefect server that tokenmill started goes when tokenmill goes (``kill -9``), and survives a
Ctrl-C until tokenmill has stopped (exit 130, no retries against a dead server).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.chaos.conftest import (
    LiveCommand,
    build_chaos_corpus,
    run_data_stages,
    start_tokenmill,
    tokenmill,
    write_chaos_recipe,
)
from trainer.metrics.sink import read_metric_rows
from trainer.parallel.launch import PARENT_PID_ENV, launch_command

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER_MARK = "prefect.server.api.server:create_app"
"""In the command line of a temporary Prefect server (Prefect's own and tokenmill's guarded one)."""
LIVENESS_S = 30
"""How long a process that should be gone may take to go: a bound on a liveness check, not a speed claim."""
STEP_2 = re.compile(r"\bstep 2/\d+ \|")
LOCK_MESSAGE = "run directory is in use by pid {pid} on host "


def lock_holder_pid(run_dir: Path) -> int | None:
    """The pid the run dir's lock file names (its holder, or the last one), None while there is none."""
    text = (run_dir / ".lock").read_text() if (run_dir / ".lock").is_file() else ""
    return int(text.split()[1]) if text.startswith("pid ") else None


def wait_for_holder(run_dir: Path, pid: int, process: subprocess.Popen, timeout_s: float = 240) -> None:
    """Wait until the run dir's lock file names ``pid``; fails when ``process`` ended first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if lock_holder_pid(run_dir) == pid:
            return
        assert process.poll() is None, f"exited with {process.returncode} before holding {run_dir}"
        time.sleep(0.02)
    raise AssertionError(f"{run_dir}/.lock never named pid {pid}")


def running(process: psutil.Process) -> bool:
    """Alive and not a zombie (an exited orphan waits for init to reap it: it is gone for our purposes)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def still_running_after(processes: list[psutil.Process], timeout_s: float = LIVENESS_S) -> list[psutil.Process]:
    """Poll until none of ``processes`` runs, for at most ``timeout_s``; return those still running."""
    deadline = time.monotonic() + timeout_s
    alive = [process for process in processes if running(process)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [process for process in alive if running(process)]
    return alive


def kill_all(processes: list[psutil.Process]) -> None:
    """Cleanup after a failed check: nothing this test started may outlive it."""
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def trainers_of(run_dir: Path) -> list[psutil.Process]:
    """Every process on the machine running ``trainer.train`` on ``run_dir`` (ranks start sessions of their own)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "trainer.train" in cmdline and str(run_dir) in cmdline:
            found.append(process)
    return found


def hand_env() -> dict[str, str]:
    """The environment of a trainer started by hand: no launching flow named."""
    return {key: value for key, value in os.environ.items() if key != PARENT_PID_ENV} | {"PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A recipe whose training would run for hours, and a run dir holding its shards (prepared without Prefect)."""
    root = tmp_path_factory.mktemp("processes")
    recipe = write_chaos_recipe(root, build_chaos_corpus(root),
                                train={"max_steps": 100_000, "checkpoint_every": 100_000, "eval_every": 100_000})
    run_data_stages(recipe, root / "prepared")
    return recipe, root / "prepared"


@contextlib.contextmanager
def hand_launched_training(run_dir: Path, num_processes: int) -> Iterator[LiveCommand]:
    """``accelerate launch … -m trainer.train --run-dir RUN`` started by hand (no flow), stopped at the end."""
    process = subprocess.Popen(launch_command(run_dir, num_processes), cwd=REPO_ROOT, env=hand_env(), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1, start_new_session=True)
    command = LiveCommand(process)
    command.start_reading()
    started = descendants(process.pid)
    try:
        yield command
    finally:
        started += descendants(process.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)  # torchrun passes it on to the ranks
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=60)
        kill_all([child for child in started if running(child)])
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.mark.slow
def test_hand_launched_two_rank_training_holds_the_run_dir_against_tokenmill_prepare(
        prepared: tuple[Path, Path], tmp_path: Path, cli_env: dict[str, str]) -> None:
    recipe, source = prepared
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    with hand_launched_training(run_dir, 2) as training:
        # Both ranks got past the lock and formed the process group: ranks of one launch never refuse each other.
        assert training.wait_for(lambda lines: any(STEP_2.search(line) for line in lines)), training.lines[-10:]
        assert any("on 2 process(es)" in line for line in training.lines), training.lines[-10:]
        holder = lock_holder_pid(run_dir)
        ranks = {process.pid: " ".join(process.cmdline()) for process in descendants(training.process.pid)
                 if "trainer.train" in " ".join(process.cmdline()) and "accelerate" not in " ".join(process.cmdline())}
        assert holder in ranks, f"the lock names pid {holder}, not one of the ranks {sorted(ranks)}"

        refused = tokenmill("prepare", recipe, "--run-dir", run_dir, env=cli_env, timeout=120)
        assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
        assert refused.stderr.splitlines() == [
            f"error: {run_dir}: {LOCK_MESSAGE.format(pid=holder)}{socket.gethostname()}; wait for it to finish or "
            "use another --run-dir."]
        assert training.process.poll() is None, "the refused prepare left the training alone"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["by-hand", "forged-parent", "two-ranks"])
def test_a_hand_started_trainer_is_refused_while_tokenmill_prepare_holds_the_run_dir(
        prepared: tuple[Path, Path], tmp_path: Path, cli_env: dict[str, str], how: str) -> None:
    recipe, source = prepared
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    before = (run_dir / "checkpoints").exists(), (run_dir / "metrics" / "train.jsonl").exists()
    holding = start_tokenmill("prepare", recipe, "--run-dir", run_dir, env=cli_env)
    try:
        wait_for_holder(run_dir, holding.process.pid, holding.process)
        os.kill(holding.process.pid, signal.SIGSTOP)  # holds the lock, deterministically, for as long as we need
        env = hand_env()
        if how == "forged-parent":  # naming the holder is not enough: only a process it launched shares its lock
            env[PARENT_PID_ENV] = str(holding.process.pid)
        argv = launch_command(run_dir, 2) if how == "two-ranks" else \
            [sys.executable, "-m", "trainer.train", "--run-dir", str(run_dir)]
        trainer = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            output, _ = trainer.communicate(timeout=180)
        finally:
            if trainer.poll() is None:
                kill_all(descendants(trainer.pid))
                os.killpg(trainer.pid, signal.SIGKILL)
                trainer.wait()
        message = f"error: {run_dir}: {LOCK_MESSAGE.format(pid=holding.process.pid)}"
        assert trainer.returncode != 0, output[-3000:]
        assert any(line.startswith(message) for line in output.splitlines()), output[-3000:]
        if how != "two-ranks":
            assert trainer.returncode == 2 and "Traceback" not in output, output[-3000:]
        # The launcher stopped the other rank: no process of the refused launch is left.
        leftovers = still_running_after(trainers_of(run_dir))
        kill_all(leftovers)
        assert leftovers == []
        assert ((run_dir / "checkpoints").exists(), (run_dir / "metrics" / "train.jsonl").exists()) == before
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(holding.process.pid, signal.SIGCONT)
    assert holding.finish() == 0, "\n".join(holding.lines[-20:])


@pytest.mark.slow
def test_flow_launched_two_rank_training_shares_the_flows_lock(tmp_path: Path, cli_env: dict[str, str]) -> None:
    recipe = write_chaos_recipe(tmp_path, build_chaos_corpus(tmp_path),
                                train={"max_steps": 4, "num_processes": 2, "checkpoint_every": 2, "eval_every": 2})
    run_dir = tmp_path / "run"
    run_data_stages(recipe, run_dir)
    result = tokenmill("train", recipe, "--run-dir", run_dir, env=cli_env, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "on 2 process(es)" in output and "run directory is in use" not in output
    assert [row["step"] for row in read_metric_rows(run_dir / "metrics" / "train.jsonl")] == [1, 2, 3, 4]
    assert (run_dir / "model" / "model.safetensors").is_file()


SHARE_PROBE = """
import sys
from core.errors import RunLockedError
from core.rundir import RunPaths
lock = RunPaths(sys.argv[1]).lock(launched_by=int(sys.argv[2]))
try:
    lock.acquire()
except RunLockedError as err:
    print("refused:", err)
else:
    print("shared" if lock.shared else "held")
"""


HOLD = """
import sys, time
from core.rundir import RunPaths
RunPaths(sys.argv[1]).lock().acquire()
print("holding", flush=True)
time.sleep(120)
"""


def probe_lock(run_dir: Path, launched_by: int, via_shell: bool = False) -> str:
    """What a process started by this one (or, ``via_shell``, by a child of it) gets from RunLock(launched_by=…)."""
    argv = [sys.executable, "-c", SHARE_PROBE, str(run_dir), str(launched_by)]
    if via_shell:  # one process more between the holder and the probe, as accelerate launch is for the trainer
        argv = ["/bin/sh", "-c", '"$@"; exit $?', "sh", *argv]
    return subprocess.run(argv, capture_output=True, text=True, check=True, cwd=REPO_ROOT).stdout.strip()


def test_a_launched_process_shares_its_launchers_lock_and_nobody_elses(tmp_path: Path) -> None:
    from core.rundir import RunPaths

    run_dir = tmp_path / "run"
    with RunPaths(run_dir).lock():
        assert probe_lock(run_dir, os.getpid()) == "shared"
        assert probe_lock(run_dir, os.getpid(), via_shell=True) == "shared"  # a grandchild too
        assert probe_lock(run_dir, os.getppid()).startswith("refused: ")  # an ancestor, but not the holder
    # Held by a sibling of the probe: naming it (a copied TOKENMILL_PARENT_PID) or naming a common ancestor
    # that holds nothing does not open the run dir.
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        assert probe_lock(run_dir, holder.pid).startswith(f"refused: {run_dir}: run directory is in use by pid "
                                                          f"{holder.pid} on host ")
        assert probe_lock(run_dir, os.getpid()).startswith("refused: ")
    finally:
        holder.kill()
        holder.wait()
    assert probe_lock(run_dir, os.getpid()) == "held"  # nobody holds it: the launched process takes it itself


# ---- the temporary Prefect server ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=["tokenmill's home", "the user's home"])
def own_server_env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``tokenmill`` with no server configured, so a temporary one starts.

    In tokenmill's own Prefect home (no PREFECT_HOME) tokenmill starts it before importing Prefect
    (flows.runtime.server.start_temporary_server); in a home of the user's, whose profile might name a server,
    Prefect starts it and tokenmill guards it (flows.runtime.server.guard_temporary_server).
    """
    unset = ("PREFECT_API_URL", "PREFECT_HOME", "TOKENMILL_PREFECT_HOME")
    env = {key: value for key, value in os.environ.items() if key not in unset} | {"PYTHONUNBUFFERED": "1"}
    home = str(tmp_path_factory.mktemp("prefect-home"))
    return env | ({"XDG_CACHE_HOME": home} if request.param == "tokenmill's home" else {"PREFECT_HOME": home})


def start_prepare_with_its_own_server(tmp_path: Path, env: dict[str, str]) -> tuple[LiveCommand, list[psutil.Process]]:
    """A ``tokenmill prepare`` in its own session, once its flow has begun; its temporary server's processes."""
    recipe = write_chaos_recipe(tmp_path, build_chaos_corpus(tmp_path))
    command = start_tokenmill("prepare", recipe, "--run-dir", tmp_path / "run", env=env)
    assert command.wait_for(lambda lines: any("Beginning flow run" in line for line in lines)), command.lines[-20:]
    servers = [process for process in command.descendants() if SERVER_MARK in " ".join(process.cmdline())]
    assert servers, f"no temporary server among {[' '.join(p.cmdline()) for p in command.descendants()]}"
    return command, servers


@pytest.mark.slow
def test_kill_9_of_tokenmill_leaves_no_temporary_server_running(tmp_path: Path,
                                                                own_server_env: dict[str, str]) -> None:
    command, servers = start_prepare_with_its_own_server(tmp_path, own_server_env)
    children = command.descendants()
    try:
        os.kill(command.process.pid, signal.SIGKILL)  # tokenmill only, as `kill -9 PID` or the OOM killer does
        assert command.finish() == -signal.SIGKILL
        assert still_running_after(servers) == [], "the temporary server outlived tokenmill"
        leftovers = still_running_after(children)
        assert leftovers == [], [" ".join(process.cmdline()) for process in leftovers if running(process)]
    finally:
        kill_all(children)


@pytest.mark.slow
@pytest.mark.parametrize("presses", [1, 2], ids=["ctrl-c", "ctrl-c twice"])
def test_ctrl_c_stops_tokenmill_with_exit_130_and_then_its_server(tmp_path: Path, own_server_env: dict[str, str],
                                                                   presses: int) -> None:
    """Exit 130 with one line saying what the run dir keeps and how to resume; Prefect's crash records and
    tracebacks stay off the console. A second Ctrl-C while the first is handled exits at once, the same way."""
    command, servers = start_prepare_with_its_own_server(tmp_path, own_server_env)
    children = command.descendants()
    try:
        for press in range(presses):
            if press:
                time.sleep(0.2)
            os.killpg(command.process.pid, signal.SIGINT)  # what Ctrl-C in the terminal does: the whole group
        try:
            returncode = command.finish(timeout_s=120)
        except subprocess.TimeoutExpired:
            pytest.fail("tokenmill still running 120 s after Ctrl-C; last lines: " + " | ".join(command.lines[-5:]))
        output = "\n".join(command.lines)
        assert returncode == 130, output[-3000:]
        for noise in ("ConnectError", "Traceback", "KeyboardInterrupt", "Crash detected", "aborted by an interrupt"):
            assert noise not in output, output[-3000:]
        assert command.lines[-1].startswith(f"interrupted: {tmp_path / 'run'} keeps "), output[-3000:]
        assert command.lines[-1].endswith("` to resume") and "tokenmill prepare " in command.lines[-1]
        assert still_running_after(servers) == []
        leftovers = still_running_after(children)
        assert leftovers == [], [" ".join(process.cmdline()) for process in leftovers if running(process)]
    finally:
        kill_all(children)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(command.process.pid, signal.SIGKILL)
