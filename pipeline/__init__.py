"""Data stages: raw corpus files -> ingested, filtered, deduplicated, decontaminated documents.

Input: corpus manifests (``data_manifests/*.yaml``). Output: ``docs/``, ``rejects/`` and ``dedupe/`` under one
run directory, plus the DuckDB views over a run. Stands on ``core`` (formats, run dir, errors); plain
functions, no Prefect here (``flows/`` wires the stages).
"""

INGEST_PRELOAD = ("pipeline.ingest_preload",)
"""What a pool of ingest worker processes imports (and warms) once, before forking its workers. Here, not in
``pipeline.ingest``: a command starts that pool's fork server before it imports anything heavy."""
