"""trainer/checkpoint/dcp_metadata.py: a DCP index unpickles only with the globals torch.distributed.checkpoint
writes."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainer.checkpoint.dcp_metadata import unsafe_metadata


class _WritesAFileWhenUnpickled:
    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[object, tuple[str, int]]:
        return os.open, (str(self.target), os.O_CREAT | os.O_WRONLY)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # dcp.save in one process
def test_a_real_index_passes_and_a_planted_payload_is_refused_without_running(tmp_path: Path) -> None:
    state = {"model": {"weight": torch.randn(3, 4), "bias": torch.zeros(2, dtype=torch.bfloat16)},
             "optimizer": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["weight"]}]}}
    dcp.save(state, checkpoint_id=tmp_path / "checkpoint")
    assert unsafe_metadata(tmp_path / "checkpoint" / ".metadata") is None

    planted = tmp_path / "planted.metadata"
    marker = tmp_path / "payload-ran"
    planted.write_bytes(pickle.dumps(_WritesAFileWhenUnpickled(marker)))
    problem = unsafe_metadata(planted)
    assert problem is not None and "refers to posix.open" in problem
    assert not marker.exists()

    not_an_index = tmp_path / "list.metadata"
    not_an_index.write_bytes(pickle.dumps([1, 2, 3]))
    assert "holds a list, not a torch.distributed.checkpoint Metadata" in str(unsafe_metadata(not_an_index))
    cut = tmp_path / "cut.metadata"
    cut.write_bytes((tmp_path / "checkpoint" / ".metadata").read_bytes()[:40])
    assert "is not a torch.distributed.checkpoint index" in str(unsafe_metadata(cut))
