"""The dedupe stage as the flow runs it: the skip-if-done result of :func:`pipeline.dedupe.dedupe_documents`."""

from __future__ import annotations

from typing import Any

from core.rundir import RunPaths
from pipeline.config import DedupeConfig
from pipeline.dedupe import dedupe_documents, dedupe_fingerprint, finished_parts


def dedupe_stage(paths: RunPaths, config: DedupeConfig) -> dict[str, Any]:
    """Run exact + near dedupe unless it already ran over exactly these parts with these settings.

    One fingerprint decides (:func:`pipeline.dedupe.dedupe_fingerprint`, recorded in ``stages/dedupe.json``);
    the summary says whether the work was ``skipped``.
    """
    done = paths.done_summary("dedupe", dedupe_fingerprint(finished_parts(paths), config))
    skipped = done is not None and paths.duplicates.is_file()
    return {**dedupe_documents(paths, config), "skipped": skipped}
