"""Benchmark against a peer: tokenmill's dedupe and pack vs datatrove's MinHash pipeline and ``DocumentTokenizer``.

Same corpus for both (this environment's site-packages ``.py`` files as JSONL: real code, with the vendored
and generated copies real corpora have), same tokenizer (a byte-level BPE that tokenmill trains on the
corpus's first 4 MB, handed to datatrove as a local ``tokenizer.json``). Two phases, each side's phase in a
fresh process whose process tree is polled for its peak memory: PSS (a page shared by several processes of
the tree counts once, in shares), and the sum of RSS beside it (which counts a shared page in every process):

- dedupe: tokenmill's ingest (JSONL -> docs parts, signatures made from each row group) + ``dedupe_documents``
  (exact + near); datatrove's four MinHash stages (signatures, buckets, cluster, filter writing the kept
  documents), as in its ``examples/minhash_deduplication.py`` (14 buckets x 8 hashes, 64-bit hashes).
  ``--workers N`` runs both sides' parallel parts on N processes: tokenmill's ingest parts through
  ``flows.runtime.stage_processes`` as ``tokenmill prepare`` does (one per core there), datatrove's stages as
  ``LocalPipelineExecutor(tasks=N, workers=N)`` (its buckets stage: 14 tasks on N workers).
  Words for datatrove's shingles come from splitting on whitespace (its default English word tokenizer
  needs NLTK data downloaded at run time; tokenmill splits on ASCII whitespace too).
- pack: tokenmill's ``pack_split_source`` (encode, pack into 1024-token rows, write shards) over the kept
  documents; datatrove's ``DocumentTokenizer`` (encode, write the token file, no shuffling) over its kept ones.

Each phase runs ``--repeats`` times per side (3), and the least of each figure counts (noise on a shared
machine only ever adds). Agreement of the removed sets: their Jaccard, and how many of each side's removals
have a partner in the corpus at exact shingle Jaccard >= 0.8 (tokenmill's word 5-gram shingles; candidates
from a generous 32x4 LSH over 128-permutation signatures, then each pair checked exactly).

Needs the optional ``peers`` extra (``pip install -e '.[peers]'``); without datatrove it exits with a one-line
message saying so. The last line printed is JSON: tokenmill's dedupe peak RSS against datatrove's.

    python -m benchmarks.peers --quick      # from the repo root; ~4 MB, under a minute
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.result import print_result

SIDES = ("tokenmill", "datatrove")
PHASES = ("dedupe", "pack")
THRESHOLD = 0.8
POLL_S = 0.01
MISSING_PEERS = ("benchmarks.peers needs datatrove, which is not installed: pip install -e '.[peers]' "
                 "(the optional `peers` extra)")


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 MB of text, one run per side and phase")
    parser.add_argument("--mb", type=float, default=None, help="MB of site-packages .py text (default 300, quick 4)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per side and phase (default 3, quick 1)")
    parser.add_argument("--workers", type=int, default=1, help="processes for each side's parallel parts (default 1)")
    parser.add_argument("--child", nargs=4, metavar=("SIDE", "PHASE", "WORK_DIR", "WORKERS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_child(*args.child)
        return {}
    if importlib.util.find_spec("datatrove") is None:
        raise SystemExit(MISSING_PEERS)
    num_bytes = int((args.mb or (4 if args.quick else 300)) * 1_000_000)
    repeats = args.repeats or (1 if args.quick else 3)
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-peers-") as tmp:
        work = Path(tmp)
        names = prepare(work, num_bytes)
        figures = {(side, phase): best_of(repeats, side, phase, work, args.workers)
                   for phase in PHASES for side in SIDES}
        from benchmarks.peers_agreement import agreement

        agreed = agreement(work / "corpus", *(removed_ids(work, side) for side in SIDES), THRESHOLD)
    report(names, figures, agreed, args.workers)
    ours, theirs = figures["tokenmill", "dedupe"]["peak_mb"], figures["datatrove", "dedupe"]["peak_mb"]
    return print_result("peers_dedupe_peak_pss", ours, theirs, "MB")


def prepare(work: Path, num_bytes: int) -> list[str]:
    """The corpus as ``corpus/NNNN.jsonl`` (+ a tokenmill manifest) and ``tokenizer.json``; returns the ids."""
    from benchmarks.corpus import site_packages_texts
    from benchmarks.peers_sides import write_corpus
    from tokenization.train_tokenizer import train_tokenizer

    documents = site_packages_texts(num_bytes)
    write_corpus(work, documents)
    sample, total = [], 0
    for _, text in documents:
        sample.append(text)
        total += len(text)
        if total >= 4_000_000:
            break
    train_tokenizer(sample, vocab_size=8192).save(str(work / "tokenizer.json"))
    return [name for name, _ in documents]


def best_of(repeats: int, side: str, phase: str, work: Path, workers: int) -> dict[str, float]:
    """The least wall, CPU and peak memory of ``repeats`` fresh-process runs of one side's phase."""
    runs = [measure_child(side, phase, work, workers) for _ in range(repeats)]
    return {key: min(run[key] for run in runs) for key in runs[0]}


def measure_child(side: str, phase: str, work: Path, workers: int) -> dict[str, float]:
    """Run one side's phase in a fresh process; wall s, CPU s (the tree's user + system), peak tree PSS and RSS (MB)."""
    import psutil

    command = [sys.executable, "-m", "benchmarks.peers", "--child", side, phase, str(work), str(workers)]
    log = work / f"{side}-{phase}.log"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with open(log, "wb") as output:
        child = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[1])
        peak_pss, peak_rss = tree_peak_memory(psutil.Process(child.pid))
        code = child.wait()
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code:
        raise RuntimeError(f"{side} {phase} failed with exit code {code}:\n{log.read_text()[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "peak_mb": peak_pss / 2**20, "peak_rss_sum_mb": peak_rss / 2**20}


def tree_peak_memory(process) -> tuple[int, int]:
    """The most bytes at once in ``process`` and its descendants, as PSS and as a sum of RSS, polled every POLL_S."""
    import psutil

    peak_pss = peak_rss = 0
    while process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
        pss = rss = 0
        try:
            for member in [process, *process.children(recursive=True)]:
                info = member.memory_full_info()  # reads /proc/PID/smaps_rollup
                pss, rss = pss + info.pss, rss + info.rss
        except psutil.NoSuchProcess:
            pass  # a member ended between listing and reading: the next poll sees the rest
        peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
        time.sleep(POLL_S)
    return peak_pss, peak_rss


def run_child(side: str, phase: str, work: str, workers: str) -> None:
    """One side's phase, from a clean output folder (the child process of :func:`measure_child`)."""
    from benchmarks import peers_sides

    folder = Path(work) / side
    if phase == "dedupe":
        shutil.rmtree(folder, ignore_errors=True)
    runner = getattr(peers_sides, f"{side}_{phase}")
    runner(Path(work), int(workers))


def removed_ids(work: Path, side: str) -> set[str]:
    """The ids of the documents a side's dedupe removed (read from its outputs)."""
    from benchmarks import peers_sides

    return getattr(peers_sides, f"{side}_removed")(work)


def report(names: list[str], figures: dict[tuple[str, str], dict[str, float]], agreed: dict[str, float],
           workers: int) -> None:
    from benchmarks.peers_sides import datatrove_hash_function

    print(f"corpus: {len(names)} site-packages .py files; {workers} worker process(es) per side; each figure the "
          f"least of its runs; datatrove hashes shingles with {datatrove_hash_function()}")
    print(f"{'phase':<8}{'side':<11}{'wall s':>9}{'CPU s':>9}{'PSS MB':>9}{'RSS sum':>9}")
    for (side, phase), row in figures.items():
        print(f"{phase:<8}{side:<11}{row['wall_s']:>9.2f}{row['cpu_s']:>9.2f}{row['peak_mb']:>9.0f}"
              f"{row['peak_rss_sum_mb']:>9.0f}")
    for phase in PHASES:
        ours, theirs = figures["tokenmill", phase], figures["datatrove", phase]
        print(f"{phase} ratios tokenmill/datatrove: wall {ours['wall_s'] / theirs['wall_s']:.2f}, "
              f"CPU {ours['cpu_s'] / theirs['cpu_s']:.2f}, peak PSS {ours['peak_mb'] / theirs['peak_mb']:.2f}, "
              f"peak RSS sum {ours['peak_rss_sum_mb'] / theirs['peak_rss_sum_mb']:.2f}")
    print("removed sets: " + ", ".join(f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"
                                       for key, value in agreed.items()))


if __name__ == "__main__":
    main()
