"""Checkpoints: folder names, writing (also in the background), resuming, FSDP and TP formats."""
