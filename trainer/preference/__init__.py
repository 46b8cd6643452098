"""Preference tuning (DPO): masked pair rows -> summed log-probs of each side, the DPO loss and its reward metrics.

``dpo_loss`` turns a model's logits and each side's loss mask into summed log-probs and those into the loss
(sigmoid DPO, and SimPO without a reference); ``reference`` computes the reference model's log-probs once and
stores them per pair (Arrow), so training can use them without loading the reference model. Pure functions; the
stages and the training loop are wired around them.
"""
