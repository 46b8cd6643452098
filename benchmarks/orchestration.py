"""What Prefect costs a command: ``tokenmill prepare`` with work, and fully skipped with and without its flow.

A re-run that finds every stage done does almost no stage work (listing the corpus, reading the stage
markers), so its wall time is the fixed cost of deciding that. Measured side by side on the same small run,
each command a new process, with the CPU seconds of the command and its children (the temporary server is one):

- ``sealed (no flow)``: the command's seal holds (flows.up_to_date): no Prefect import, no server, no flow;
- ``flow, temporary server``: the seal removed first, so the flow runs and each stage skips, with no
  ``PREFECT_API_URL`` (tokenmill's temporary server boots in parallel with the imports), as before seals;
- ``flow, running server``: the same with ``prefect server start`` running (its own Prefect home, a free
  port) and ``PREFECT_API_URL`` naming it: what ``tokenmill serve`` or a team's Prefect server gives.

A prepare that does the work is measured once each way (temporary server, running server; a fresh run dir
each): its wall time less the union of its stages' spans (``metrics/stage_times.jsonl``) is what a command with
work pays around its stages (interpreter start, imports, server, flow and task runs, report, summary).

    python -m benchmarks.orchestration --quick

The JSON line: ours = median seconds of the sealed skipped prepare, baseline = the same through the flow with
the temporary server (what a skipped re-run cost before seals).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
    parser.add_argument("--repeats", type=int, help="skipped re-runs per way")
    parser.add_argument("--mb", type=float, default=1.0, help="corpus size (default 1 MB)")
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 5)
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-orchestration-") as tmp:
        folder = Path(tmp)
        recipe = write_recipe(folder, args.mb)
        command = [TOKENMILL, "-q", "prepare", str(recipe), "--run-dir", str(folder / "run")]
        own = {key: value for key, value in os.environ.items() if key not in ("PREFECT_API_URL", "PREFECT_HOME")}
        own["XDG_CACHE_HOME"] = str(folder / "cache")  # tokenmill's Prefect home (and its database) starts empty
        first = timed(command, own)
        stages = stage_seconds(folder / "run" / "metrics" / "stage_times.jsonl")
        seal = folder / "run" / "stages" / "sealed" / "prepare.json"
        server, url = start_server(folder / "prefect-home")
        try:
            ways = {"sealed (no flow)": own, "flow, temporary server": own,
                    "flow, running server": {**own, "PREFECT_API_URL": url}}
            if repeats > 1:  # the running server's first flow runs register the flows there: not counted
                seal.unlink()
                timed(command, ways["flow, running server"])
            fresh = [*command[:-1], str(folder / "run-on-the-running-server")]
            working = timed(fresh, ways["flow, running server"])
            working_stages = stage_seconds(folder / "run-on-the-running-server" / "metrics" / "stage_times.jsonl")
            runs = {}
            for name, env in ways.items():
                runs[name] = []
                for _ in range(repeats):
                    if name.startswith("flow"):
                        seal.unlink()  # each flow run writes it again
                    runs[name].append(timed(command, env))
        finally:
            server.terminate()
            server.wait(timeout=60)
    for name, (wall, cpu), spans in (("temporary server", first, stages), ("running server", working, working_stages)):
        print(f"prepare with work ({name}): {wall:.2f} s wall, {cpu:.2f} CPU-s; its stages {spans:.2f} s, "
              f"around them {wall - spans:.2f} s")
    print(f"{'fully skipped prepare':<24} {'median s':>9} {'min s':>7} {'CPU-s':>7}   ({repeats} runs each)")
    for name, timings in runs.items():
        walls = [wall for wall, _ in timings]
        print(f"{name:<24} {statistics.median(walls):>9.2f} {min(walls):>7.2f} "
              f"{statistics.median(cpu for _, cpu in timings):>7.2f}")
    medians = {name: statistics.median(wall for wall, _ in timings) for name, timings in runs.items()}
    return print_result("orchestration_skipped_prepare", medians["sealed (no flow)"],
                        medians["flow, temporary server"], "s")


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
