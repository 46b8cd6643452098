"""Progress on a terminal and in the Prefect UI: stage bars and training progress."""
