"""Orchestration: Prefect flows and tasks that wire the stages, deployments, and the ``tokenmill`` CLI.

The only package that imports Prefect. Nothing here holds stage logic: each task wraps one stage call.
"""
