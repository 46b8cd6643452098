"""Preference tuning (DPO): masked pair rows -> summed log-probs of each side, the DPO loss and its reward metrics.

``pair_batch`` lays masked pairs out as padded or packed rows and sums each side's log-probs under a model;
``dpo_loss`` turns those into the loss (sigmoid DPO with cDPO label smoothing, and SimPO without a reference) and
its reward metrics; ``reference`` computes the reference model's log-probs once and ``reference_store`` keeps
them per pair (Parquet, torch-free), so training can use them without loading the reference model.
``reference_stage`` is the stage that computes them for each (split, preference source) of the shard index;
``objective`` is the training step's loss (stored or on-the-fly reference, or SimPO) and ``evaluate`` the in-loop
evaluation of the val pairs.
"""
