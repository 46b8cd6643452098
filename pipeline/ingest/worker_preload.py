"""The modules an ingest worker pool's fork server imports (and warms) before forking its workers.

A module of its own, importing nothing: ``tokenmill run``/``prepare`` name it to start that fork server before
they import anything heavy (flows.runtime.stage_processes.start_fork_server).
"""

INGEST_PRELOAD = ("pipeline.ingest.preload",)
