"""Read-only SQL over a run: DuckDB views on its files, on disk or in a bucket (through a local mirror)."""
