"""Tokenize stage: train or load a byte-level BPE, encode documents, pack them into fixed-length rows.

Input: ``documents`` of a run (``docs/`` minus ``dedupe/``). Output: ``tokenizer/tokenizer.json`` and the
Arrow token shards + ``shards/index.parquet`` (written through ``core.shards.store``).
Named ``tokenization`` because a top-level ``tokenize`` package would shadow Python's standard library.
"""
