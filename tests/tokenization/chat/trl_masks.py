"""TRL as the independent checker: the labels ``SFTTrainer`` 1.16 builds for the same records and tokenizer.

``SFTTrainer._prepare_dataset`` tokenizes conversations with ``apply_chat_template`` and sets the labels of tokens
outside ``assistant_masks`` (``assistant_only_loss``) or before the completion (``completion_only_loss``) to -100.
The trainer is built around a one-layer Llama with random weights (nothing trains); its ``train_dataset`` holds
those labels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from datasets import Dataset
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from trl import SFTConfig, SFTTrainer

IGNORE_INDEX = -100


def trl_masks(model_dir: Path, records: list[dict[str, Any]], output_dir: Path,
              **loss_settings: bool) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) per record as SFTTrainer prepares it; ``loss_settings`` go to ``SFTConfig``
    (``assistant_only_loss=True`` or ``completion_only_loss=True``)."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=8, intermediate_size=16,
                                         num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1))
    args = SFTConfig(output_dir=str(output_dir), report_to="none", max_length=None, use_cpu=True, bf16=False,
                     disable_tqdm=True, **loss_settings)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(records), processing_class=tokenizer)
    return [(list(row["input_ids"]), [int(label != IGNORE_INDEX) for label in row["labels"]])
            for row in trainer.train_dataset]
