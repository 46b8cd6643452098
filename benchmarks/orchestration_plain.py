"""``tokenmill prepare`` without an orchestrator: the same stage calls as a plain Python script.

What a user would write instead of a flow: the same functions in the same order, ingest parts in the same
fork-server worker pool (started first, as the command starts it), packs in threads, then the report. No
Prefect, no server, no task runs, no progress bars; it skips nothing that the flow would do. Its wall time
from a fresh interpreter is the work itself, so ``tokenmill prepare`` less this is what orchestration costs
(benchmarks.orchestration). It covers a recipe without a base model or a given tokenizer, as that benchmark's.

    python -m benchmarks.orchestration_plain RECIPE RUN_DIR
"""

from __future__ import annotations

import os
import sys

from flows.runtime.stage_processes import run_stage_call, stage_processes, start_fork_server
from pipeline.ingest.worker_preload import INGEST_PRELOAD


def prepare(recipe: str, run_dir: str) -> None:
    workers = os.cpu_count() or 1
    if workers > 1:
        start_fork_server(INGEST_PRELOAD)
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from flows.recipe import record_run, resolve_run
    from flows.report.stage import write_report
    from pipeline.dedupe.decontaminate import decontaminate_documents
    from pipeline.dedupe.summary import dedupe_stage
    from pipeline.ingest.stage import by_path, ingest_part, largest_first, parts_to_ingest, plan_ingest
    from tokenization.stage import pack_split_source, write_index
    from tokenization.train_tokenizer import prepare_tokenizer
    from trainer.eval.tasks import prepare_eval_tasks

    run = resolve_run(recipe, run_dir)
    loaded, base, paths = run.recipe, run.base, run.paths
    with paths.lock():
        record_run(run)
        manifests = list(run.manifests)  # as the flow: loaded once by resolve_run, never read again
        parts = largest_first(plan_ingest(manifests, paths, loaded.data.part_size_bytes), by_path(manifests))
        pool_size = min(workers, len(parts_to_ingest(parts, loaded.data.val_fraction, paths, by_path(manifests))))
        with stage_processes(pool_size, preload=INGEST_PRELOAD), ThreadPoolExecutor(workers) as threads:
            list(threads.map(lambda part: run_stage_call(ingest_part, part, loaded.data.val_fraction, paths,
                                                         near=loaded.dedupe.near,
                                                         manifest=by_path(manifests)[part.manifest_path]), parts))
        dedupe_stage(paths, loaded.dedupe)
        tasks = prepare_eval_tasks(paths, loaded.eval, base)
        decontaminate_documents(paths, loaded.dedupe.decontaminate, base_dir=base,
                                eval_tasks={name: paths.eval_text(name) for name in tasks["tasks"]})
        prepare_tokenizer(paths, loaded.tokenizer, None)
        pairs = [(split, source.name) for split in ("train", "val") for item in manifests
                 for source in item.manifest.sources]
        with ThreadPoolExecutor(workers) as threads:
            list(threads.map(lambda pair: pack_split_source(paths, *pair, loaded.pack), pairs))
        write_index(paths)
        write_report(paths)
    print(Path(paths.root))


if __name__ == "__main__":
    prepare(*sys.argv[1:3])
