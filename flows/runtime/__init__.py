"""What a flow runs in: the temporary Prefect server, offline settings, worker and child processes."""
