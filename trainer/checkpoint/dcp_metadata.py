"""A pickle allowlist for FSDP checkpoints' ``.metadata`` files, read before torch.distributed.checkpoint reads them.

FSDP weights and AdamW state are torch.distributed.checkpoint folders (Accelerate writes and reads them).
Their tensors are raw bytes, but the index, ``.metadata``, is a pickle that DCP's ``FileSystemReader``
loads with plain ``pickle.load``: a file swapped in by someone else could run code on resume. So before any
FSDP checkpoint is loaded, its ``.metadata`` is unpickled here with an allowlist of the globals DCP writes
(its metadata dataclasses, ``torch.Size``, dtypes, layouts, a path); anything else makes the checkpoint
invalid, and nothing outside the allowlist is ever imported or called.
"""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata

_ALLOWED_CLASSES = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # layout from its name, e.g. "torch.strided"
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath"),  # Python 3.13 moved it
    ("collections", "OrderedDict"),
}
_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata",)  # Metadata, TensorStorageMetadata, ... and enums


class _AllowlistUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if (module, name) in _ALLOWED_CLASSES:
            return super().find_class(module, name)
        if module in _ALLOWED_MODULES:
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and found.__module__ == module:  # a class defined there, not an import
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a DCP index never holds")


def unsafe_metadata(path: Path) -> str | None:
    """None when ``path`` unpickles with only the globals DCP writes; otherwise why it does not."""
    try:
        with open(path, "rb") as handle:
            loaded = _AllowlistUnpickler(handle).load()
    except Exception as err:  # a damaged pickle raises almost anything; each means "invalid"
        return f"{path.name} is not a torch.distributed.checkpoint index ({err})"
    if not isinstance(loaded, Metadata):
        return f"{path.name} holds a {type(loaded).__name__}, not a torch.distributed.checkpoint Metadata"
    return None
