"""Data library: raw corpus files -> ingested, filtered, deduplicated documents -> Arrow token shards.

Input: corpus manifests (``data_manifests/*.yaml``). Output: ``docs/``, ``rejects/``, ``dedupe/`` and
``shards/`` under one run directory. Plain functions; no Prefect here (``flows/`` wires the stages).
"""
