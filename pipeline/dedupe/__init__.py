"""Dedupe stage (exact, then MinHash + LSH near-dedupe) and decontamination against the eval tasks."""
