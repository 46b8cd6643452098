"""The two sides of :mod:`benchmarks.peers`, one function per side and phase, each run in its own process.

``WORK`` holds ``corpus/*.jsonl`` (``id``, ``text``), ``corpus.yaml`` (tokenmill's manifest of it) and
``tokenizer.json``; tokenmill writes under ``WORK/tokenmill/``, datatrove under ``WORK/datatrove/``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

NGRAM = 5
NUM_PERM = 128
THRESHOLD = 0.8
DOCS_PER_FILE = 2000
SEQ_LEN_TOKENS = 1024
EOS = "<|endoftext|>"
PERMISSIVE_FILTERS = {"max_chars": 10**9, "max_control_char_fraction": 1.0, "min_mean_word_length": 0.0,
                      "max_mean_word_length": 10**9, "max_symbol_ratio": 10**9, "max_duplicate_line_fraction": 1.0}
"""Quality filters that reject nothing, so both sides dedupe the same documents."""


def write_corpus(work: Path, documents: list[tuple[str, str]]) -> None:
    """``(id, text)`` pairs as ``corpus/NNNN.jsonl`` files and a manifest of them."""
    import yaml

    corpus = work / "corpus"
    corpus.mkdir(parents=True)
    for number, start in enumerate(range(0, len(documents), DOCS_PER_FILE)):
        with open(corpus / f"{number:04d}.jsonl", "w", encoding="utf-8") as handle:
            for name, text in documents[start : start + DOCS_PER_FILE]:
                handle.write(json.dumps({"id": name, "text": text}) + "\n")
    manifest = {"name": "peers", "filters": PERMISSIVE_FILTERS,
                "sources": [{"name": "peers", "path": "corpus", "format": "jsonl", "id_field": "id"}]}
    (work / "corpus.yaml").write_text(yaml.safe_dump(manifest), encoding="utf-8")


# ---- tokenmill ----------------------------------------------------------------------------------


def tokenmill_dedupe(work: Path, workers: int) -> None:
    """Ingest (making the near signatures from each row group, as the flow does) then dedupe.

    With several workers, the parts go to ``flows.runtime.stage_processes``'s workers as ``tokenmill prepare`` sends
    them.
    """
    from concurrent.futures import ThreadPoolExecutor

    from core.rundir import RunPaths
    from flows.runtime.stage_processes import run_stage_call, stage_processes
    from pipeline.config import DedupeConfig, NearDedupeConfig
    from pipeline.dedupe.stage import dedupe_documents
    from pipeline.ingest.stage import ingest_part, plan_ingest
    from pipeline.ingest.worker_preload import INGEST_PRELOAD

    paths = RunPaths(work / "tokenmill")
    near = NearDedupeConfig(threshold=THRESHOLD, num_perm=NUM_PERM, ngram=NGRAM)
    parts = plan_ingest([work / "corpus.yaml"], paths, 32 << 20)
    with stage_processes(workers, preload=INGEST_PRELOAD), ThreadPoolExecutor(workers) as threads:
        list(threads.map(lambda part: run_stage_call(ingest_part, part, 0.0, paths, near=near), parts))
    print(json.dumps(dedupe_documents(paths, DedupeConfig(near=near))))


def tokenmill_pack(work: Path, workers: int) -> None:
    """Encode and pack the kept documents into shards of 1024-token rows."""
    from core.rundir import RunPaths
    from tokenization.config import PackConfig
    from tokenization.stage import pack_split_source

    paths = RunPaths(work / "tokenmill")
    shutil.rmtree(paths.shards, ignore_errors=True)
    paths.tokenizer.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(work / "tokenizer.json", paths.tokenizer)
    infos = pack_split_source(paths, "train", "peers", PackConfig(seq_len=SEQ_LEN_TOKENS))
    print(json.dumps({"num_tokens": sum(info.num_tokens for info in infos)}))


def tokenmill_removed(work: Path) -> set[str]:
    import pyarrow.parquet as pq

    from core.documents import DUPLICATES_FILE
    from core.rundir import RunPaths

    table = pq.read_table(RunPaths(work / "tokenmill").dedupe / DUPLICATES_FILE, columns=["source_id"])
    return set(table.column("source_id").to_pylist())


# ---- datatrove ----------------------------------------------------------------------------------


def _whitespace_words():
    """A datatrove word tokenizer that splits on whitespace (its English default loads NLTK data at run time)."""
    from datatrove.utils.word_tokenizers import WordTokenizer

    class WhitespaceWords(WordTokenizer):
        def word_tokenize(self, text: str) -> list[str]:
            return text.split()

        def sent_tokenize(self, text: str) -> list[str]:
            return re.split(r"\n\s*\n", text)

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            return [match.span() for match in re.finditer(r"\S+", text)]

    return WhitespaceWords()


def datatrove_hash_function() -> str:
    """``xxhash``, datatrove's default, where xxhash < 4 is installed (its ``processing`` extra pins that: xxhash 4
    refuses the ``str`` datatrove hashes), else ``sha1``, its other choice (slower)."""
    from importlib.metadata import version

    return "xxhash" if int(version("xxhash").split(".")[0]) < 4 else "sha1"


def datatrove_dedupe(work: Path, workers: int) -> None:
    """datatrove's four MinHash stages, as in its example (local folders); ``workers`` tasks and processes."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.hashing import HashConfig

    base = work / "datatrove"
    config = MinhashConfig(n_grams=NGRAM, num_buckets=14, hashes_per_bucket=8,
                           hash_config=HashConfig(precision=64, hash_fc=datatrove_hash_function()))
    words = _whitespace_words()

    def reader():
        return JsonlReader(str(work / "corpus"), id_key="id")

    stages = [
        [reader(), MinhashDedupSignature(output_folder=str(base / "signatures"), config=config, language=words)],
        [MinhashDedupBuckets(input_folder=str(base / "signatures"), output_folder=str(base / "buckets"),
                             config=config)],
        [MinhashDedupCluster(input_folder=str(base / "buckets"), output_folder=str(base / "remove_ids"),
                             config=config)],
        [reader(), MinhashDedupFilter(input_folder=str(base / "remove_ids"),
                                      exclusion_writer=JsonlWriter(str(base / "removed"), compression=None)),
         JsonlWriter(str(base / "deduped"), compression=None)],
    ]
    for number, pipeline in enumerate(stages):
        tasks = {1: config.num_buckets, 2: 1}.get(number, workers)  # buckets: one task each; cluster: one
        LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=min(workers, tasks),
                              logging_dir=str(base / "logs" / f"stage{number + 1}")).run()


def datatrove_pack(work: Path, workers: int) -> None:
    """``DocumentTokenizer`` over the kept documents: encode with the local tokenizer.json, write tokens."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer

    base = work / "datatrove"
    shutil.rmtree(base / "tokens", ignore_errors=True)
    shutil.rmtree(base / "logs" / "tokenize", ignore_errors=True)
    LocalPipelineExecutor(pipeline=[
        JsonlReader(str(base / "deduped")),
        DocumentTokenizer(output_folder=str(base / "tokens"), tokenizer_name_or_path=str(work / "tokenizer.json"),
                          eos_token=EOS, shuffle_documents=False),
    ], tasks=1, workers=1, logging_dir=str(base / "logs" / "tokenize")).run()


def datatrove_removed(work: Path) -> set[str]:
    removed = set()
    for path in sorted((work / "datatrove" / "removed").glob("*.jsonl")):
        with open(path, encoding="utf-8") as handle:
            removed.update(json.loads(line)["id"] for line in handle)
    return removed
