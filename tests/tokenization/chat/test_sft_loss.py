"""trainer/loader/sft_loss.py: the SFT loss of tokenmill's packed rows equals TRL 1.16 ``SFTTrainer``'s on the same
model, records and batch, to 1e-5 in fp32; TRL's loss is its own ``compute_loss`` on its own collated batch (padded or
packed), with the ``num_items_in_batch`` its ``get_batch_samples`` counts, as its training step passes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from datasets import Dataset
from torch import nn
from trl import SFTConfig, SFTTrainer

from tests.tokenization.chat.sft_data import RECORDS, masked_records, tiny_hf_llama
from tokenization.chat.pack import pack_conversations
from tokenization.chat.template import ChatTemplate, load_chat_template
from trainer.loader.batches import Batch
from trainer.loader.sft_loss import num_loss_tokens, sft_batch, sft_loss
from trainer.model.spec import output_logits

SEQ_LEN = 256
CPU = torch.device("cpu")
TRL_COLLATION = {"padded": {}, "packed": {"packing": True, "max_length": SEQ_LEN}}
"""TRL's default (rows padded to the longest) and its best-fit-decreasing packing (padding-free, position ids)."""


def tokenmill_batches(template: ChatTemplate, rows_per_batch: int) -> list[Batch]:
    """The records masked, packed into rows and cut into micro-batches, as the trainer would load them."""
    chat = pack_conversations(list(enumerate(masked_records(template))), seq_len=SEQ_LEN, pad_id=0, dtype=np.uint16)
    doc_starts = [np.array(starts) for starts in chat.rows.doc_starts]
    return [sft_batch(chat.rows.input_ids[start:start + rows_per_batch], chat.loss_mask[start:start + rows_per_batch],
                      doc_starts[start:start + rows_per_batch])
            for start in range(0, len(chat), rows_per_batch)]


def tokenmill_step_loss(model: nn.Module, batches: list[Batch]) -> float:
    step_tokens = num_loss_tokens(batches)
    with torch.no_grad():
        return sum(float(sft_loss(output_logits(model(**batch.model_kwargs(CPU))), batch.labels, step_tokens))
                   for batch in batches)


def trl_step_loss(model: nn.Module, model_dir: Path, output_dir: Path, micro_batch_size: int,
                  grad_accum_steps: int, **collation: Any) -> float:
    """One optimizer step's loss as SFTTrainer computes it: every record once, in its micro-batches."""
    template = load_chat_template(model_dir)
    args = SFTConfig(output_dir=str(output_dir), report_to="none", use_cpu=True, bf16=False, disable_tqdm=True,
                     assistant_only_loss=True, per_device_train_batch_size=micro_batch_size,
                     gradient_accumulation_steps=grad_accum_steps, **{"max_length": None, **collation})
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(RECORDS),
                         processing_class=template.tokenizer)
    micro_batches, num_items = trainer.get_batch_samples(iter(trainer.get_train_dataloader()), grad_accum_steps, CPU)
    with torch.no_grad():
        return sum(float(trainer.compute_loss(trainer.model, batch, num_items_in_batch=num_items))
                   for batch in micro_batches)


@pytest.mark.parametrize("collation", sorted(TRL_COLLATION))
@pytest.mark.parametrize(("ours", "trls"), [("chatml_marked", "chatml_marked"), ("llama3", "llama3_marked"),
                                            ("gemma", "gemma_marked")])
def test_the_loss_of_a_batch_equals_trls(ours: str, trls: str, collation: str, model_dirs: dict[str, Path],
                                         tmp_path: Path) -> None:
    """Our mask from generation markers (ChatML) or the prefix diff (the stock Llama-3 and Gemma templates); TRL's
    from the marked twin, which renders the same tokens."""
    template = load_chat_template(model_dirs[ours])
    model = tiny_hf_llama(len(template.tokenizer), SEQ_LEN)
    batches = tokenmill_batches(template, rows_per_batch=len(RECORDS))
    assert len(batches) == 1 and batches[0].input_ids.shape[0] < len(RECORDS)  # one batch of packed rows
    expected = trl_step_loss(model, model_dirs[trls], tmp_path, len(RECORDS), 1, **TRL_COLLATION[collation])
    assert tokenmill_step_loss(model, batches) == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_a_steps_loss_over_micro_batches_is_the_mean_over_all_its_trained_tokens_as_in_trl(
        model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Gradient accumulation: each micro-batch's summed loss divided by the whole step's trained tokens (TRL's
    ``num_items_in_batch``), not a mean of micro-batch means; the micro-batches hold different records on each
    side (TRL shuffles), the step's loss is the same."""
    template = load_chat_template(model_dirs["chatml_marked"])
    model = tiny_hf_llama(len(template.tokenizer), SEQ_LEN)
    batches = tokenmill_batches(template, rows_per_batch=2)
    assert len(batches) == 2
    expected = trl_step_loss(model, model_dirs["chatml_marked"], tmp_path, len(RECORDS) // 2, 2)
    assert tokenmill_step_loss(model, batches) == pytest.approx(expected, rel=1e-5, abs=1e-5)
