"""Ingest stage: source files -> parts (plan, streams, readers, part files, worker preload, re-decide)."""
