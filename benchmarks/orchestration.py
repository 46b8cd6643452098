"""What Prefect costs a command: ``tokenmill prepare`` with work against a plain script, and fully skipped.

A prepare with work is measured three ways, taking turns, each on a fresh run dir of the same small corpus
(each a new process; wall and the CPU seconds of the command and its children, the temporary server one):

- ``plain script (no Prefect)``: benchmarks.orchestration_plain, the same stage calls as a plain Python
  script (same worker pool, same report): the work itself. Every way must write the same shard index;
- ``flow, running server``: ``tokenmill prepare`` with ``prefect server start`` running (its own Prefect home,
  a free port) and ``PREFECT_API_URL`` naming it: what ``prefect server start`` in a terminal gives;
- ``flow, temporary server``: ``tokenmill prepare`` with no ``PREFECT_API_URL``: tokenmill's temporary server
  boots beside the imports (and the ingest workers' fork server beside both).

A flow's wall less the plain script's is what orchestration costs a command with work (imports of Prefect,
the server, flow and task runs, their end). The wall less the union of its stages' spans
(``metrics/stage_times.jsonl``) is printed too: it also counts imports and the report, which a script pays.

A re-run that finds every stage done does almost no stage work, so its wall time is the fixed cost of
deciding that: ``sealed (no flow)`` (the seal holds, flows.up_to_date: no Prefect import, no server, no flow)
against the same through the flow (seal removed) with the temporary and with the running server.

    python -m benchmarks.orchestration --quick

The JSON line: ours = median seconds of the prepare with work through the flow on a running server,
baseline = the plain script's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.result import print_result

TOKENMILL = str(Path(sys.executable).parent / "tokenmill")
PREFECT = str(Path(sys.executable).parent / "prefect")
RECIPE = """name: orchestration
data: {manifests: [corpus/corpus.yaml], val_fraction: 0.05}
tokenizer: {vocab_size: 512, sample_bytes: 500000}
pack: {seq_len: 128, rows_per_shard: 1024}
model: {preset: tiny}
eval: {tasks: []}
"""


def write_recipe(folder: Path, megabytes: float) -> Path:
    """A recipe over a generated corpus of ``megabytes`` (the stdlib-derived corpus of benchmarks.ingest_memory)."""
    from benchmarks.ingest_memory import generate_corpus

    generate_corpus(folder / "corpus", int(megabytes * 1_000_000), shard_bytes=1 << 20)  # corpus/corpus.yaml
    (folder / "recipe.yaml").write_text(RECIPE, encoding="utf-8")
    return folder / "recipe.yaml"


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds (the command and its waited-for children) of one run; a failure stops the benchmark."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{argv[:3]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(home: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``prefect server start`` on a free loopback port with its own home; returns it and its API URL once healthy."""
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_UI_ENABLED": "0",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                if answer.status == 200:
                    return server, url
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit("prefect server start did not answer within 180 s")


def main() -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 runs per way (default 5)")
    parser.add_argument("--repeats", type=int, help="runs per way")
    parser.add_argument("--mb", type=float, default=1.0, help="corpus size (default 1 MB)")
    parser.add_argument("--with-work-only", action="store_true", help="leave out the fully skipped re-runs")
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 5)
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-orchestration-") as tmp:
        folder = Path(tmp)
        recipe = write_recipe(folder, args.mb)
        own = {key: value for key, value in os.environ.items() if key not in ("PREFECT_API_URL", "PREFECT_HOME")}
        own["XDG_CACHE_HOME"] = str(folder / "cache")  # tokenmill's Prefect home (and its database) starts empty

        def prepare(run_dir: Path) -> list[str]:
            return [TOKENMILL, "-q", "prepare", str(recipe), "--run-dir", str(run_dir)]

        timed(prepare(folder / "first"), own)  # tokenmill's Prefect home: its database is created once, not counted
        # The running server gets a copy of that database, already migrated (a fresh one takes ~15 s to migrate).
        shutil.copytree(folder / "cache" / "tokenmill" / "prefect", folder / "prefect-home")
        server, url = start_server(folder / "prefect-home")
        try:
            running = {**own, "PREFECT_API_URL": url}
            if repeats > 1:  # the running server's first flow run registers the flow there: not counted
                timed(prepare(folder / "first-on-the-running-server"), running)
            plain = [sys.executable, "-m", "benchmarks.orchestration_plain", str(recipe)]
            working = {"plain script (no Prefect)": lambda run_dir: timed([*plain, str(run_dir)], own),
                       "flow, running server": lambda run_dir: timed(prepare(run_dir), running),
                       "flow, temporary server": lambda run_dir: timed(prepare(run_dir), own)}
            with_work: dict[str, list[tuple[float, float, float]]] = {name: [] for name in working}
            for repeat in range(repeats):  # the ways take turns, so a change in the machine's load hits each alike
                for index, (name, run) in enumerate(working.items()):
                    run_dir = folder / f"work-{index}-{repeat}"
                    wall, cpu = run(run_dir)
                    stage_times = run_dir / "metrics" / "stage_times.jsonl"  # the flow's; the script records none
                    with_work[name].append((wall, cpu, stage_seconds(stage_times) if stage_times.exists() else 0.0))
            same_shards(folder, repeats, len(working))
            command = prepare(folder / "first")
            seal = folder / "first" / "stages" / "sealed" / "prepare.json"
            skipped_ways = {} if args.with_work_only else {"sealed (no flow)": own, "flow, temporary server": own,
                                                              "flow, running server": running}
            skipped: dict[str, list[tuple[float, float]]] = {}
            for name, env in skipped_ways.items():
                skipped[name] = []
                for _ in range(repeats):
                    if name.startswith("flow"):
                        seal.unlink()  # each flow run writes it again
                    skipped[name].append(timed(command, env))
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(f"{'prepare with work':<28} {'median s':>9} {'min s':>7} {'CPU-s':>7} {'in stages':>10}   ({repeats} runs)")
    for name, timings in with_work.items():
        walls = [wall for wall, _, _ in timings]
        print(f"{name:<28} {statistics.median(walls):>9.2f} {min(walls):>7.2f} "
              f"{statistics.median(cpu for _, cpu, _ in timings):>7.2f} "
              f"{statistics.median(spans for _, _, spans in timings):>10.2f}")
    medians = {name: statistics.median(wall for wall, _, _ in timings) for name, timings in with_work.items()}
    plain_s = medians.pop("plain script (no Prefect)")
    for name, median in medians.items():
        print(f"orchestration ({name}): {median - plain_s:.2f} s more than the plain script")
    if skipped:
        print(f"{'fully skipped prepare':<28} {'median s':>9} {'min s':>7} {'CPU-s':>7}")
    for name, timings in skipped.items():
        walls = [wall for wall, _ in timings]
        print(f"{name:<28} {statistics.median(walls):>9.2f} {min(walls):>7.2f} "
              f"{statistics.median(cpu for _, cpu in timings):>7.2f}")
    return print_result("orchestration_prepare_running_server", medians["flow, running server"], plain_s, "s")


def same_shards(folder: Path, repeats: int, ways: int) -> None:
    """Every way's run wrote the same shard index: the plain script did the flow's work, no less."""
    indexes = {(folder / f"work-{index}-{repeat}" / "shards" / "index.parquet").read_bytes()
               for index in range(ways) for repeat in range(repeats)}
    if len(indexes) != 1:
        raise SystemExit("the plain script and the flow wrote different shard indexes: they did not do the same work")


def stage_seconds(stage_times: Path) -> float:
    """Seconds in which at least one stage ran: the union of the spans in ``metrics/stage_times.jsonl``."""
    spans = sorted((row["start_unix_s"], row["end_unix_s"])
                   for row in map(json.loads, stage_times.read_text(encoding="utf-8").splitlines()))
    total, reached = 0.0, float("-inf")
    for start, end in spans:
        total += max(0.0, end - max(start, reached))
        reached = max(reached, end)
    return total


if __name__ == "__main__":
    main()
