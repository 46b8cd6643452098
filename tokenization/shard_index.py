"""Shard-index stage: every (split, source) ``state.json`` -> ``shards/index.parquet`` (what training reads): the
pack stage's token shards, the SFT data stage's chat shards and the preference data stage's preference shards alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.layout import PACK_STATE_FILES
from core.rundir import file_stats
from core.stage import Inputs, Progress, Stage
from tokenization.stage import write_index


class ShardIndexStage(Stage):
    """The pack states -> the shard index; its inputs are the states themselves (by content)."""

    name = "shard-index"
    reads = ("pack", "sft_data", "preference_data")

    def inputs(self, unit: str | None) -> Inputs:
        states = sorted(self.paths.shards.glob(PACK_STATE_FILES))
        return Inputs(files={name: identity for state in states
                             for name, _, identity in file_stats(self.paths.root, state)})

    def outputs(self, unit: str | None) -> list[Path]:
        return [self.paths.shard_index]

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        shards = write_index(self.paths)
        return {"num_shards": len(shards), "num_rows": sum(info.num_rows for info in shards),
                "num_tokens": sum(info.num_tokens for info in shards)}
