"""Prefect tasks: each wraps one stage call (retries only on I/O-bound work).

Each takes the run dir as the :class:`core.rundir.RunPaths` the flow resolved once (a frozen dataclass of one
path: Prefect hashes and Dask pickles it like the string it replaces).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task

from core.rundir import RunPaths
from core.shards import ShardInfo
from flows.progress import open_shared_bar, reports_progress, shows_bar, stage_meter
from flows.report import write_report
from flows.settings import retry_unless_user_error
from flows.stage_processes import run_stage_call
from flows.stage_times import times_stage
from pipeline.config import DecontaminateConfig, DedupeConfig, NearDedupeConfig
from pipeline.decontaminate import decontaminate_documents
from pipeline.ingest import IngestPart, by_path, ingest_part, largest_first, plan_ingest
from pipeline.manifest import CorpusManifest, ManifestFile
from pipeline.stages import dedupe_stage
from tokenization.config import PackConfig, TokenizerConfig
from tokenization.stage import pack_split_source, packed_shards, write_index
from tokenization.train_tokenizer import prepare_tokenizer
from trainer.config import EvalConfig, ModelConfig
from trainer.eval_tasks import prepare_eval_tasks


@task(name="plan-ingest")
@times_stage("ingest")
@reports_progress("plan-ingest")
def plan_ingest_task(manifests: list[ManifestFile], paths: RunPaths, part_size_bytes: int) -> list[dict[str, Any]]:
    parts = largest_first(plan_ingest(manifests, paths, part_size_bytes), by_path(manifests))
    open_shared_bar("ingest", "bytes", total=sum(part.num_bytes for part in parts), num_calls=len(parts))
    return [part.to_dict() for part in parts]


@task(name="ingest-part", retries=2, retry_delay_seconds=1, retry_condition_fn=retry_unless_user_error,
      task_run_name="ingest-part-{part[part_id]}")
@times_stage("ingest")
@reports_progress("ingest-part")
def ingest_part_task(part: dict[str, Any], val_fraction: float, paths: RunPaths,
                     near: NearDedupeConfig | None = None,
                     manifests: dict[str, CorpusManifest] | None = None) -> dict[str, Any]:
    """``manifests``: the run's, as its command loaded them (:func:`pipeline.ingest.by_path`): not read again."""
    with stage_meter("ingest", "bytes", total=part.get("num_bytes")) as meter:
        return run_stage_call(ingest_part, IngestPart.from_dict(part), val_fraction, paths,
                              on_progress=lambda num_records, num_bytes: meter.advance(num_bytes,
                                                                                       records=num_records),
                              near=near, manifest=(manifests or {}).get(part["manifest_path"]))


@task(name="dedupe")
@times_stage("dedupe")
@reports_progress("dedupe")
@shows_bar("dedupe")
def dedupe_task(paths: RunPaths, config: DedupeConfig) -> dict[str, Any]:
    return dedupe_stage(paths, config)


@task(name="decontaminate")
@times_stage("decontaminate")
@reports_progress("decontaminate")
@shows_bar("decontaminate")
def decontaminate_task(paths: RunPaths, config: DecontaminateConfig, recipe_dir: str,
                       eval_tasks: list[str] = ()) -> dict[str, Any]:
    return decontaminate_documents(paths, config, base_dir=Path(recipe_dir),
                                   eval_tasks={name: paths.eval_text(name) for name in eval_tasks})


@task(name="eval-tasks")
@times_stage("eval-tasks")
@reports_progress("eval-tasks", rates=False)
def eval_tasks_task(paths: RunPaths, config: EvalConfig, recipe_dir: str, trusted: list[str] = ()) -> dict[str, Any]:
    return prepare_eval_tasks(paths, config, Path(recipe_dir), trusted=[Path(folder) for folder in trusted])


@task(name="base-model")
@times_stage("base-model")
@reports_progress("base-model", rates=False)
def base_model_task(paths: RunPaths, config: ModelConfig, source: str,
                    trust_remote_code: bool = False) -> dict[str, Any]:
    from trainer.base_model import import_base_model  # imports torch: the flows' process needs it only here

    return import_base_model(paths, Path(source), config.model_copy(update={"trust_remote_code": trust_remote_code}))


@task(name="tokenizer")
@times_stage("tokenizer")
@reports_progress("tokenizer")
def tokenizer_task(paths: RunPaths, config: TokenizerConfig | None, given_path: str | None,
                   hugging_face_model: bool = False) -> dict[str, Any]:
    with stage_meter("tokenizer", "bytes") as meter:
        return prepare_tokenizer(paths, config, Path(given_path) if given_path else None,
                                 on_progress=lambda fed, total: meter.update(completed=fed, total=total),
                                 model_folder=paths.base_model if hugging_face_model else None)


@task(name="pack", retries=2, retry_delay_seconds=1, retry_condition_fn=retry_unless_user_error,
      task_run_name="pack-{split}-{source}")
@times_stage("pack")
@reports_progress("pack")
def pack_task(paths: RunPaths, split: str, source: str, config: PackConfig) -> dict[str, Any]:
    packed = packed_shards(paths, split, source, config)
    if packed is not None:
        return {**shards_summary(packed), "skipped": True}
    with stage_meter(f"pack {split}/{source}", "tokens") as meter:
        return shards_summary(pack_split_source(paths, split, source, config, on_progress=meter.advance))


def shards_summary(shards: list[ShardInfo]) -> dict[str, Any]:
    return {"num_shards": len(shards), "num_rows": sum(info.num_rows for info in shards),
            "num_tokens": sum(info.num_tokens for info in shards)}


@task(name="shard-index")
@times_stage("shard-index")
@reports_progress("shard-index", rates=False)
def shard_index_task(paths: RunPaths) -> list[ShardInfo]:
    return write_index(paths)


@task(name="report")
@reports_progress("report", rates=False)
@shows_bar("report")
def report_task(paths: RunPaths) -> str:
    return str(write_report(paths))
