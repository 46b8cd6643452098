"""lm-eval's Hugging Face model with its progress bars off and the requests it scores counted for tokenmill.

``HFLM`` draws tqdm bars ("Tokenizing inputs", "Running loglikelihood requests") that it turns off only through
each request method's ``disable_tqdm`` argument, which ``lm_eval.simple_evaluate`` never passes: on a terminal
they scrolled above tokenmill's bars, and in a log they were ``\\r``-joined lines. This model passes it, and
counts each finished request through lm-eval's per-request hook (``cache_hook.add_partial``, what its request
cache records) to hand ``(scored, requests)`` to tokenmill's progress. The scores are HFLM's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lm_eval.api.model import CacheHook
from lm_eval.models.huggingface import HFLM

Progress = Callable[[int, int], None]


class CountingHook(CacheHook):
    """lm-eval calls ``add_partial`` once per finished request of a request method: count them."""

    def __init__(self, total: int, on_progress: Progress | None) -> None:
        super().__init__(None)
        self.done, self.total, self.on_progress = 0, total, on_progress

    def add_partial(self, attr: str, req: Any, res: Any) -> None:
        self.done += 1
        if self.on_progress is not None:
            self.on_progress(min(self.done, self.total), self.total)


class CountingHFLM(HFLM):
    """``HFLM`` without progress bars; ``on_progress(scored, requests)`` after each request it scores."""

    on_progress: Progress | None = None

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[Any]:
        self._count(requests)
        return super().loglikelihood(requests, disable_tqdm=True)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[Any]:
        self._count(requests)
        return super().loglikelihood_rolling(requests, disable_tqdm=True)

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[Any]:
        self._count(requests)
        return super().generate_until(requests, disable_tqdm=True)

    def _count(self, requests: list[Any]) -> None:
        """A request method starts: count its requests from 0 (a task may call several, one after the other)."""
        self.cache_hook = CountingHook(len(requests), self.on_progress)
        if self.on_progress is not None:
            self.on_progress(0, len(requests))
