"""Re-deciding a threshold from stored attributes against the first ``prepare`` of the same corpus.

The corpus is real text in several languages, as a web crawl's: Debian's package documentation, English, German
and French manual pages and the standard library's docstrings, as jsonl files (several ingest parts). Filters:
language identification (en, de, fr at ``min_score`` 0.5) and Gopher's repetition and quality rules. The data
stages run as ``tokenmill prepare`` runs them, without Prefect (run.yaml, ingest, dedupe with near duplicates,
tokenizer, pack, index). Then ``filters.language.min_score`` goes to 0.8 and the stages run again: the parts are
re-decided from ``attributes/`` (the source files are replaced by same-size junk first, so a re-read would show),
dedupe and pack run again because the kept documents changed, the tokenizer is kept. A last run with a threshold
that changes no verdict shows every later stage skipped.

Run from the repo root: ``.venv/bin/python -m benchmarks.redecide``. The last line printed is JSON: ``ours`` is
the re-decided run's wall seconds, ``baseline`` the first run's.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.corpus import debian_doc_texts, man_page_texts, stdlib_docstring_texts
from benchmarks.result import print_result
from core.rundir import RunPaths
from flows.recipe import load_recipe, manifest_paths, record_recipe, tokenizer_file
from flows.run_sql import run_query
from pipeline.dedupe.summary import dedupe_stage
from pipeline.ingest.stage import ingest_part, plan_ingest
from pipeline.manifest import load_manifest
from tokenization.stage import pack_split_source, write_index
from tokenization.train_tokenizer import prepare_tokenizer

FILTERS = {"language": {"allowed": ["en", "de", "fr"], "min_score": 0.5}, "gopher_repetition": {},
           "gopher_quality": {}}


def write_corpus(root: Path, num_docs: int, max_chars: int) -> int:
    """jsonl files of about 1 MB each under ``root/corpus``; returns the bytes written."""
    texts = [text for _, text in debian_doc_texts(num_docs // 2)]
    for language in ("en", "de", "fr"):
        texts += [text for _, text in man_page_texts(language, num_docs // 8, min_words=50)]
    texts += stdlib_docstring_texts(num_docs * 2000, min_words=20)[:num_docs // 8]
    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    lines = [json.dumps({"text": text[:max_chars]}) for text in texts]
    per_file = max(1, len(lines) // max(1, sum(map(len, lines)) // 1_000_000))
    for start in range(0, len(lines), per_file):
        (corpus / f"crawl-{start // per_file:04d}.jsonl").write_text("\n".join(lines[start:start + per_file]) + "\n")
    return sum(path.stat().st_size for path in corpus.iterdir())


def write_recipe(root: Path, min_score: float) -> Path:
    (root / "crawl.yaml").write_text(yaml.safe_dump({
        "name": "crawl", "filters": {**FILTERS, "language": {**FILTERS["language"], "min_score": min_score}},
        "sources": [{"name": "crawl", "path": "corpus", "format": "jsonl", "glob": "*.jsonl"}]}))
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "redecide", "data": {"manifests": ["crawl.yaml"], "val_fraction": 0.05, "part_size_bytes": 1 << 20},
        "dedupe": {"near": {"enabled": True}}, "tokenizer": {"vocab_size": 2048}, "pack": {"seq_len": 256}}))
    return recipe


def prepare(recipe: Path, run_dir: Path) -> tuple[float, dict]:
    """Wall seconds of the data stages, as the prepare-data flow orders them, and what they reported."""
    started = time.perf_counter()
    loaded, base = load_recipe(recipe)
    paths = RunPaths(run_dir)
    with paths.lock():
        record_recipe(loaded, base, run_dir)
        manifests = manifest_paths(loaded, base)
        ingested = [ingest_part(part, loaded.data.val_fraction, paths)
                    for part in plan_ingest(manifests, paths, loaded.data.part_size_bytes)]
        deduped = dedupe_stage(paths, loaded.dedupe)
        tokenizer = prepare_tokenizer(paths, loaded.tokenizer, tokenizer_file(loaded, base))
        for split in ("train", "val"):
            for manifest in manifests:
                for source in load_manifest(manifest).sources:
                    pack_split_source(paths, split, source.name, loaded.pack)
        write_index(paths)
    return time.perf_counter() - started, {"parts": len(ingested), "dedupe_skipped": deduped["skipped"],
                                           "tokenizer_skipped": bool(tokenizer.get("skipped"))}


def scramble(corpus: Path) -> None:
    """Same size, same mtime, other bytes: planning sees no change, a re-read would."""
    for path in corpus.iterdir():
        stat = path.stat()
        path.write_bytes(b"#" * stat.st_size)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def kept(run_dir: Path) -> int:
    return int(run_query(run_dir, "SELECT count(*) AS n FROM documents").column("n")[0].as_py())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="160 documents of at most 4,000 characters (seconds)")
    parser.add_argument("--docs", type=int, default=None, help="documents, at most (default 2,400)")
    parser.add_argument("--max-chars", type=int, default=None, help="characters kept of each (default 20,000)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        num_bytes = write_corpus(root, args.docs or (160 if args.quick else 2400),
                                 args.max_chars or (4000 if args.quick else 20000))
        first_s, first = prepare(write_recipe(root, 0.5), root / "run")
        kept_first = kept(root / "run")
        scramble(root / "corpus")
        redecided_s, redecided = prepare(write_recipe(root, 0.8), root / "run")
        kept_redecided = kept(root / "run")
        unchanged_s, unchanged = prepare(write_recipe(root, 0.800001), root / "run")
    print(f"corpus {num_bytes / 1e6:.1f} MB of jsonl in {first['parts']} parts; language (en,de,fr) + Gopher filters")
    print(f"first prepare (data stages)                : {first_s:6.2f} s, {kept_first} documents kept")
    print(f"min_score 0.5 -> 0.8, re-decided           : {redecided_s:6.2f} s, {kept_redecided} kept "
          f"(dedupe skipped: {redecided['dedupe_skipped']}, tokenizer skipped: {redecided['tokenizer_skipped']})")
    print(f"0.8 -> 0.800001 (no verdict changes)       : {unchanged_s:6.2f} s "
          f"(dedupe skipped: {unchanged['dedupe_skipped']})")
    print_result("redecide_vs_first_prepare", redecided_s, first_s, "s")


if __name__ == "__main__":
    main()
