"""The ``tokenmill`` command line (the typer app) and its output: tables, sampled rows, one-line failures."""
