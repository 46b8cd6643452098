"""The run lock of a run dir in a bucket, on a real SeaweedFS: processes race for it as machines would."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 2.0
RACER = """
import sys, time
from pathlib import Path
from core.bucket.lock import BucketLock
from core.errors import RunLockedError
lock = BucketLock(sys.argv[1], "racer")
go = Path(sys.argv[2])
while not go.exists():  # imports done: every racer asks at once
    time.sleep(0.005)
try:
    lock.acquire()
except RunLockedError as err:
    print(f"refused: {err}", flush=True)
    sys.exit(3)
print("acquired", flush=True)
sys.stdin.read()  # hold it (heartbeats keep it fresh) until told to go
lock.release()
print("released", flush=True)
"""


def start_racer(url: str, go: Path, lease_s: float = LEASE_S) -> subprocess.Popen[str]:
    env = {**os.environ, "TOKENMILL_BUCKET_LOCK_LEASE_S": str(lease_s)}
    return subprocess.Popen([sys.executable, "-c", RACER, url, str(go)], cwd=REPO_ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def first_line(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    return process.stdout.readline().strip()


def test_racing_processes_one_proceeds_a_dead_holder_is_taken_over_after_the_lease(
        s3_prefix: str, tmp_path: Path) -> None:
    url = f"{s3_prefix}/runs/shared"
    go = tmp_path / "go"
    racers = [start_racer(url, go) for _ in range(3)]
    time.sleep(1.0)  # let the three import
    go.touch()
    lines = [first_line(racer) for racer in racers]
    assert sorted(line.split(":")[0] for line in lines) == ["acquired", "refused", "refused"], lines
    winner = racers[lines.index("acquired")]
    for racer, line in zip(racers, lines, strict=True):
        if racer is not winner:
            assert racer.wait(timeout=30) == 3
            age = line.split("written ")[1].split(" s ago")[0]
            assert line == (f"refused: {url}: run directory is in use by pid {winner.pid} on host "
                            f"{os.uname().nodename} (racer) (lock {url}/.lock, written {age} s ago); wait for it to "
                            "finish or use another --run-dir. A holder that died is taken over once its lock is "
                            f"{LEASE_S:.0f} s old (TOKENMILL_BUCKET_LOCK_LEASE_S).")

    # Alive past its lease, the holder's heartbeat keeps the lock: a newcomer is still refused.
    time.sleep(LEASE_S * 1.5)
    late = start_racer(url, go)
    assert first_line(late).startswith(f"refused: {url}: run directory is in use by pid {winner.pid}")
    assert late.wait(timeout=30) == 3

    # Killed (no release), its lock goes stale after the lease and the next process takes it over.
    winner.send_signal(signal.SIGKILL)
    winner.wait(timeout=30)
    time.sleep(LEASE_S + 0.5)
    heir = start_racer(url, go)
    assert first_line(heir).startswith(f"{url}: took over the lock of pid {winner.pid} on host ")
    assert first_line(heir) == "acquired"
    assert heir.communicate("", timeout=30)[0].strip().endswith("released")
    assert heir.returncode == 0

    # Released: the lock object is gone, the next one takes it at once.
    again = start_racer(url, go)
    assert first_line(again) == "acquired"
    again.communicate("", timeout=30)


def test_wrong_credentials_are_one_line_naming_the_lock(s3_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from core.bucket.lock import BucketLock
    from core.errors import ObjectStoreError

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ObjectStoreError, match=rf"^{s3_prefix}/runs/x/\.lock: access denied \(.*\); set "
                                               "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        BucketLock(f"{s3_prefix}/runs/x").acquire()


LONG_LEASE_S = 600.0
"""A lease no test waits out: a lock taken over under it was taken because its holder is known to be gone."""


def test_a_holder_killed_on_this_machine_is_taken_over_at_once(s3_prefix: str, tmp_path: Path) -> None:
    url = f"{s3_prefix}/runs/killed-here"
    go = tmp_path / "go"
    go.touch()
    holder = start_racer(url, go, LONG_LEASE_S)
    assert first_line(holder) == "acquired"
    holder.send_signal(signal.SIGKILL)  # kill -9: no release, the lock object stays, fresh
    holder.wait(timeout=30)
    heir = start_racer(url, go, LONG_LEASE_S)
    assert first_line(heir) == (f"{url}: took over the lock of pid {holder.pid} on host {socket.gethostname()} "
                                "(racer), a process of this machine that is gone")
    assert first_line(heir) == "acquired"
    assert heir.communicate("", timeout=30)[0].strip().endswith("released")


def hand_written_lock(url: str, **changes: object) -> dict[str, object]:
    """Put a lock object as a live holder of this process's machine would write it, with ``changes``; return it."""
    from core.bucket.lock import LOCK_KEY, s3_client, split_url, this_process

    bucket, prefix = split_url(url)
    record = {"owner": "someone", "host": socket.gethostname(), "pid": os.getpid(), "command": "tokenmill train",
              "lease_s": LONG_LEASE_S, "beat": 1, **this_process(), **changes}
    s3_client().put_object(Bucket=bucket, Key=f"{prefix}/{LOCK_KEY}", Body=json.dumps(record).encode())
    return record


@pytest.mark.parametrize("holder", ["pid reused", "alive here", "gone elsewhere", "no start time"])
def test_only_a_holder_known_dead_on_this_machine_is_taken_over_before_the_lease(s3_prefix: str,
                                                                                holder: str) -> None:
    from core.bucket.lock import BucketLock
    from core.errors import RunLockedError

    url = f"{s3_prefix}/runs/{holder.replace(' ', '-')}"
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        with open(f"/proc/{sleeper.pid}/stat") as stat:
            started = int(stat.read().rsplit(")", 1)[1].split()[19])
        if holder == "pid reused":  # the recorded pid runs, but it is another process than the one that locked
            hand_written_lock(url, pid=sleeper.pid, started=started + 1)
        elif holder == "alive here":
            hand_written_lock(url, pid=sleeper.pid, started=started)
        elif holder == "gone elsewhere":  # a pid that is gone here means nothing about another machine's
            hand_written_lock(url, host="elsewhere", boot_id="another-boot", pid=2**22 + 1)
        else:  # a lock from before start times were recorded: only the lease can tell
            hand_written_lock(url, pid=2**22 + 1, started=None)
        lock = BucketLock(url, "test", lease_s=LONG_LEASE_S)
        if holder == "pid reused":
            lock.acquire()  # at once, under a lease no test waits out
            lock.release()
        else:
            with pytest.raises(RunLockedError, match=rf"^{url}: run directory is in use by pid \d+ on host "):
                lock.acquire()
    finally:
        sleeper.kill()
        sleeper.wait()
