"""The hand-written Prefect tasks left: training, evaluation and the report as those flows call it. The data
stages run through the one generic task (:mod:`flows.stage_task`); these go the same way as they become stages.

Each takes the run dir as the :class:`core.rundir.RunPaths` the flow resolved once (a frozen dataclass of one
path: Prefect hashes and Dask pickles it like the string it replaces).
"""

from __future__ import annotations

from prefect import task

from core.rundir import RunPaths
from flows.progress.bars import reports_progress, shows_bar
from flows.report.stage import write_report


@task(name="report")
@reports_progress("report", rates=False)
@shows_bar("report")
def report_task(paths: RunPaths) -> str:
    return str(write_report(paths))
