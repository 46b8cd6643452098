"""Data stages: raw corpus files -> ingested, filtered, deduplicated, decontaminated documents.

Input: corpus manifests (``data_manifests/*.yaml``). Output: ``docs/``, ``rejects/`` and ``dedupe/`` under one
run directory, plus the DuckDB views over a run. Stands on ``core`` (formats, run dir, errors); plain
functions, no Prefect here (``flows/`` wires the stages).
"""
