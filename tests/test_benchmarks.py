"""Every benchmark in ``benchmarks/`` runs: ``--quick`` at a tiny size prints its JSON result line last.

Benchmarks are found by listing the folder: a module with a top-level ``main`` is one (helpers such as
``corpus.py`` and ``result.py`` have none), so a new benchmark is covered without touching this file, and a
signature change in the code a benchmark calls fails here instead of the next time someone runs it. Each
runs as ``python -m benchmarks.NAME`` in a subprocess, as a user runs it (some rewrite ``sys.path``).
Nothing here checks a speed: only that the figures are there, finite and positive.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO_ROOT / "benchmarks"
TINY_ARGS = {
    "cli_latency": ["--mb", "0.5", "--repeats", "1"],
    "checkpoint_stall": ["--every", "1", "--saves", "1", "--seq-len", "16"],
    "consumed": ["--steps", "40"],
    "dedupe": ["--mb", "1", "--families", "10", "--repeats", "1"],
    "eval_split": ["--rows", "16", "--rounds", "1"],
    "ingest_filters": ["--docs", "32"],
    "ingest_memory": ["--mb", "2"],
    "loader": ["--rows", "512", "--rounds", "1", "--batches-per-round", "5"],
    "minhash_impls": ["--mb", "0.5"],
    "object_storage": ["--mb", "0.3", "--rows", "256", "--batches-per-round", "10"],
    "orchestration": ["--mb", "0.1", "--repeats", "1", "--with-work-only"],
    "peers": ["--mb", "1"],
    "redecide": ["--docs", "60", "--max-chars", "2000"],
    "tokenize": ["--max-mb", "1", "--rounds", "1"],
    "train_hf_trainer": ["--steps", "3", "--warmup", "1", "--repeats", "1"],
    "train_step": ["--rounds", "1", "--steps-per-round", "1"],
    "web_filters": ["--docs", "40"],
}
"""Options, after ``--quick``, that make a benchmark tiny; a benchmark not listed runs with ``--quick`` alone."""
RESULT_KEYS = {"name", "ours", "baseline", "unit", "ratio"}
TIMEOUT_S = 600


def benchmark_names() -> list[str]:
    """Modules of ``benchmarks/`` that define a top-level ``main`` (read, not imported: a peer may be missing)."""
    names = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            names.append(path.stem)
    return names


def run_benchmark(name: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(tmp_path),
                   "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", f"benchmarks.{name}", "--quick", *TINY_ARGS.get(name, [])]
    return subprocess.run(command, cwd=REPO_ROOT, env=environment, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)


def test_benchmarks_are_found() -> None:
    names = benchmark_names()
    assert {"dedupe", "peers", "tokenize"} <= set(names)
    assert not {"corpus", "result", "peers_sides", "peers_agreement"} & set(names)


@pytest.mark.slow
@pytest.mark.parametrize("name", benchmark_names())
def test_benchmark_quick_prints_its_result_last(name: str, tmp_path: Path) -> None:
    if name == "peers" and importlib.util.find_spec("datatrove") is None:
        test_peers_without_datatrove_names_the_extra(tmp_path)
        return
    done = run_benchmark(name, tmp_path)
    assert done.returncode == 0, f"benchmarks.{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result) == RESULT_KEYS
    assert isinstance(result["name"], str) and result["name"]
    assert isinstance(result["unit"], str) and result["unit"]
    for key in ("ours", "baseline", "ratio"):
        assert isinstance(result[key], int | float) and math.isfinite(result[key]) and result[key] > 0, result


def test_peers_without_datatrove_names_the_extra(tmp_path: Path) -> None:
    """Without datatrove, peers.py stops at once with one line naming the ``peers`` extra."""
    if importlib.util.find_spec("datatrove") is not None:
        hidden = tmp_path / "hide"
        hidden.mkdir()
        # None in sys.modules: importlib.util.find_spec says "not installed", as on a machine without the extra
        (hidden / "sitecustomize.py").write_text("import sys\nsys.modules['datatrove'] = None\n", encoding="utf-8")
        environment = {**os.environ, "PYTHONPATH": f"{hidden}{os.pathsep}{REPO_ROOT}"}
    else:
        environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.peers", "--quick"], cwd=REPO_ROOT, env=environment,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "`peers`" in lines[0] and "datatrove" in lines[0], done.stderr
