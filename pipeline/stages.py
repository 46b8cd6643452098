"""Skip-if-done wrappers for the whole-run data stages: each records a fingerprint of its inputs + settings."""

from __future__ import annotations

import hashlib
from typing import Any

from core.documents import document_part_files
from core.rundir import RunPaths, fingerprint, mark_stage_done, stage_done, stage_summary
from pipeline.config import DedupeConfig
from pipeline.dedupe import dedupe_documents


def documents_fingerprint(paths: RunPaths) -> list[str]:
    """Digest of every finished docs part (its marker holds the part's own input fingerprint)."""
    return [hashlib.sha256(part.with_suffix(".json").read_bytes()).hexdigest() for part in document_part_files(paths)]


def dedupe_stage(paths: RunPaths, config: DedupeConfig) -> dict[str, Any]:
    """Run exact + near dedupe unless it already ran over exactly these parts with these settings."""
    stage_fingerprint = fingerprint("dedupe", config.model_dump(mode="json"), documents_fingerprint(paths))
    if stage_done(paths, "dedupe", stage_fingerprint):
        return {**(stage_summary(paths, "dedupe") or {}), "skipped": True}
    summary = dedupe_documents(paths, config)
    mark_stage_done(paths, "dedupe", stage_fingerprint, summary)
    return {**summary, "skipped": False}
