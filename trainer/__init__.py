"""Train stage: Arrow token shards -> a trained Llama-style model, checkpoints, eval metrics, HF export.

``python -m trainer.train --run-dir RUN`` is what ``accelerate launch`` starts. Reads only the shards
(through ``core.shards.store``) and ``run.yaml``; writes ``checkpoints/``, ``metrics/`` and ``model/``.
"""
