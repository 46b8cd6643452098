"""Callbacks: optional extras around the training loop's steps (profiling), kept out of the loop itself."""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from core.rundir import RunPaths


class Callback:
    """Hooks the loop calls around every optimizer step; ``step`` is the 1-based number of that step."""

    def on_step_begin(self, step: int) -> None:
        """Before the step's first micro-batch is loaded."""

    def on_step_end(self, step: int) -> None:
        """After the optimizer update (or its skip)."""


class ProfilerCallback(Callback):
    """Trace the chosen steps with torch.profiler into ``metrics/profile/step-NNNNNNN-rank-R.json`` (Chrome trace).

    Open a trace in https://ui.perfetto.dev or chrome://tracing; the step-time split in train_metrics says
    which phase to look at.
    """

    def __init__(self, steps: list[int], paths: RunPaths, rank: int, device: torch.device) -> None:
        self.steps, self.paths, self.rank = set(steps), paths, rank
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._active: Any = None

    def on_step_begin(self, step: int) -> None:
        if step in self.steps:
            self._active = profile(activities=self.activities, record_shapes=True)
            self._active.__enter__()

    def on_step_end(self, step: int) -> None:
        if self._active is None:
            return
        self._active.__exit__(None, None, None)
        with self.paths.atomic_write(self.paths.profile_trace(step, self.rank)) as tmp:
            self._active.export_chrome_trace(str(tmp))
        self._active = None
