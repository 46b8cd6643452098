"""The one Prefect task that runs any stage, and the loop that submits a flow's stage list.

Each unit of each stage is one task run named after it (``dedupe``, ``pack train-stdlib``); it waits for
every unit of the stages it :attr:`~core.stage.Stage.reads`, so Prefect's graph has an edge from each stage
whose outputs it reads, derived from the declarations, never wired by hand.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture, wait
from prefect.runtime import task_run
from prefect.states import State

from core.stage import Stage, StageResult, run_stage
from flows.progress.bars import describe_rates, stage_logger, stage_meter
from flows.runtime.settings import QUIET_ENV, retry_unless_user_error
from flows.runtime.stage_processes import run_stage_call
from flows.stage_times import record_stage_time


def _task_run_name() -> str:
    parameters = task_run.parameters
    return parameters["stage"].label(parameters.get("unit"))


@task(name="stage", task_run_name=_task_run_name, cache_policy=NO_CACHE, retry_condition_fn=retry_unless_user_error)
def stage_task(stage: Stage, unit: str | None = None) -> StageResult:
    """:func:`core.stage.run_stage` with a bar, one log line, and the span in ``metrics/stage_times.jsonl``."""
    started, started_unix_s = time.perf_counter(), time.time()
    with stage_meter(stage.bar(unit), stage.progress_unit) as meter:
        counted: dict[str, int] = {}

        def on_progress(done: int, total: int | None, counts: Mapping[str, int] | None = None) -> None:
            meter.update(completed=done, total=total)
            if counts:  # running totals: the bar shows the new ones' rates
                meter.advance(0, **{name: value - counted.get(name, 0) for name, value in counts.items()})
                counted.update(counts)

        if stage.in_worker_process:
            result = run_stage_call(run_stage, stage, unit, on_progress=on_progress)
        else:
            result = run_stage(stage, unit, on_progress=on_progress)
    if not os.environ.get(QUIET_ENV):
        stage_logger().info(describe_rates(stage.label(unit), result.as_summary(), time.perf_counter() - started))
    record_stage_time(stage.paths, stage.name, started_unix_s, time.time())
    return result


Submitted = PrefectFuture | State
"""A unit's task run: a future (submitted to the flow's thread pool) or the final state of one run in place."""


def submit_stage(stage: Stage, upstream: Sequence[Submitted] = ()) -> list[Submitted]:
    """Run every unit of ``stage`` after ``upstream`` finished (a stage's units may depend on its inputs).

    A stage of several units (ingest parts, pack pairs) is submitted to the flow's task runner, which runs them in
    parallel (threads, or a Dask cluster). A one-unit stage runs in the flow's own thread: DuckDB, tokenizers and
    torch keep native per-thread state, and running every stage on the pool's fresh threads each flow run grew a
    long-lived process (tokenmill serve; tests/chaos/test_soak.py: +58 MiB over 15 refresh cycles, against +16 MiB
    this way). Either way each unit is one task run with its upstream edges.
    """
    wait([item for item in upstream if isinstance(item, PrefectFuture)])
    named = stage_task.with_options(name=stage.name, retries=stage.retries, retry_delay_seconds=1)
    units = stage.units()
    if stage.in_worker_process or len(units) > 1:
        return [named.submit(stage, unit, wait_for=list(upstream)) for unit in units]
    return [named(stage, unit, wait_for=list(upstream), return_state=True) for unit in units]


def run_stages(stages: Sequence[Stage]) -> dict[str, list[StageResult]]:
    """Run the stages in list order, each after the stages it reads; ``{stage: its units' results}``.

    The first failed unit raises (its stage's other units finish first; later stages never start).
    """
    return stage_results(submit_stages(stages))


def submit_stages(stages: Sequence[Stage], submitted: Mapping[str, list[Submitted]] | None = None,
                  ) -> dict[str, list[Submitted]]:
    """Submit the stages in list order, each unit waiting for every unit of the stages it reads, among these and
    those ``submitted`` before (a flow that runs its first stages in a block of their own: ingest's processes)."""
    futures = dict(submitted or {})
    for stage in stages:
        upstream = [future for name in stage.reads for future in futures.get(name, [])]
        futures[stage.name] = submit_stage(stage, upstream)
    return futures


def stage_results(futures: Mapping[str, list[Submitted]]) -> dict[str, list[StageResult]]:
    """Each stage's units' results, in submit order; the first failed unit raises."""
    return {name: [future.result() for future in submitted] for name, submitted in futures.items()}


def summaries(results: Sequence[StageResult]) -> list[dict[str, Any]]:
    return [result.as_summary() for result in results]
