"""The run report (``report/``) and the Prefect UI's artifacts: data, headline, plots."""
