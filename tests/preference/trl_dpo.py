"""TRL as the independent checker: what DPOTrainer 1.16 tokenizes and computes for the same records and models.

``DPOTrainer._prepare_dataset`` renders ``prompt`` (with the generation prompt), ``prompt + chosen`` and ``prompt +
rejected`` with ``apply_chat_template`` and splits each side where its tokens diverge from the prompt's; its
``compute_loss`` runs the policy and the reference on the collated batch (chosen rows, then rejected rows) and
logs ``rewards/*`` in ``_metrics``. The models are tiny Llamas built from a config (``AutoConfig.for_model``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from trl import DPOConfig, DPOTrainer


def tiny_llama(vocab_size: int, seed: int) -> PreTrainedModel:
    """A 2-layer Llama with random weights from ``seed`` (float32, no dropout)."""
    config = AutoConfig.for_model("llama", vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                  max_position_embeddings=256)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def dpo_trainer(model_dir: Path, records: list[dict[str, Any]], output_dir: Path, policy: PreTrainedModel | None = None,
                reference: PreTrainedModel | None = None, **settings: Any) -> DPOTrainer:
    """A DPOTrainer over ``records`` (conversational) with the tokenizer of ``model_dir``; ``settings`` go to
    ``DPOConfig`` (``beta``, ``loss_type``, ``label_smoothing``). Nothing trains."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    policy = policy if policy is not None else tiny_llama(len(tokenizer), seed=0)
    reference = reference if reference is not None else tiny_llama(len(tokenizer), seed=1)
    args = DPOConfig(output_dir=str(output_dir), report_to="none", max_length=None, use_cpu=True, bf16=False,
                     disable_tqdm=True, **settings)
    return DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(records),
                      processing_class=tokenizer)


def trl_sides(trainer: DPOTrainer) -> list[dict[str, tuple[list[int], list[int]]]]:
    """Per record, {side: (input_ids, completion mask)} as the collator builds them from the prepared dataset."""
    return [{side: (row["prompt_ids"] + row[f"{side}_ids"],
                    [0] * len(row["prompt_ids"]) + [1] * len(row[f"{side}_ids"]))
             for side in ("chosen", "rejected")} for row in trainer.train_dataset]


def trl_loss(trainer: DPOTrainer, indices: list[int]) -> tuple[float, dict[str, float]]:
    """DPOTrainer's loss on the batch of records ``indices`` and the reward metrics it logs for it."""
    batch = trainer.data_collator([trainer.train_dataset[index] for index in indices])
    loss = trainer.compute_loss(trainer.model, batch)
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items() if name.startswith("rewards/")}
    return loss.item(), metrics
