"""Parallelism: the Accelerator (DDP, FSDP2, TP, DeepSpeed) and launching 1..N trainer processes."""
