"""Benchmark: trained (loss-carrying) tokens/s of supervised fine-tuning, tokenmill's packed rows against padded
rows and against TRL ``SFTTrainer``'s padded, padding-free and packed (bfd) batches, side by side in one run.

Data: question/answer conversations made from the standard library's own docstrings (``What does json.dumps do?``
-> its docstring's first paragraph; every third one a two-turn conversation), rendered with a ChatML template
with ``{% generation %}`` markers over a local BPE (the tests' chat tokenizer), masked assistant-only. Model: one
tiny ``transformers`` Llama (random weights), the same initial weights for every variant. Each variant runs the
whole corpus once per round through forward + backward (no optimizer: the same for all), in batches of about
the same number of conversations: tokenmill's ``micro_batch_size`` rows of ``seq_len`` (packed by best-fit
decreasing, document masking through ``position_ids``; or one conversation per row, padded to ``seq_len``), TRL's
``per_device_train_batch_size`` of conversations (padded to the longest, or concatenated padding-free) or of
packed sequences of ``seq_len``, its loss through its own ``training_step``. Rounds alternate the variants, so a
shared machine's load hits all alike; the median round counts. Rates are per CPU second of this process (wall
time swings 2-5x with other processes' load) and per wall second. The last line is JSON: ours = tokenmill
packed, baseline = TRL's best setting, in trained tokens per CPU second.

    python -m benchmarks.sft_packing --quick      # seconds
    python -m benchmarks.sft_packing              # a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import ast
import copy
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.corpus import stdlib_texts
from benchmarks.result import print_result
from benchmarks.rounds import median_rates
from tokenization.chat.masks import MaskedConversation, mask_conversation
from tokenization.chat.pack import pack_conversations
from tokenization.chat.records import Conversation, parse_record
from tokenization.chat.template import ChatTemplate, load_chat_template
from trainer.loader.batches import Batch
from trainer.loader.sft_loss import num_loss_tokens, sft_batch, sft_loss
from trainer.model.spec import output_logits

TRL_VARIANTS = {"trl_padded": {}, "trl_padding_free": {"padding_free": True},
                "trl_packed_bfd": {"packing": True, "packing_strategy": "bfd"}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=None, help="default 300, quick 24")
    parser.add_argument("--seq-len", type=int, default=None, help="default 512, quick 256")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="rows of seq_len per batch (default 4, "
                        "quick 2)")
    parser.add_argument("--hidden-size", type=int, default=None, help="default 64, quick 32")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds per variant (default 3, quick 1)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    args = parser.parse_args(argv)
    defaults = {"conversations": (24, 300), "seq_len": (256, 512), "micro_batch_size": (2, 4),
                "hidden_size": (32, 64), "rounds": (1, 3)}
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def docstring_records(count: int) -> list[dict[str, Any]]:
    """Conversations from the standard library's top-level function and class docstrings, in path order."""
    answers = []
    for text in stdlib_texts(count * 40_000):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                doc = (ast.get_docstring(node, clean=True) or "").split("\n\n")[0].strip()
                if 40 <= len(doc) <= 800:
                    answers.append((f"What does {node.name} do?", doc))
        if len(answers) >= count * 2:
            break
    records = []
    while answers and len(records) < count:
        turns = answers[:2] if len(records) % 3 == 2 else answers[:1]
        del answers[:len(turns)]
        messages = [message for question, answer in turns for message in (
            {"role": "user", "content": question}, {"role": "assistant", "content": answer})]
        records.append({"messages": messages})
    return records


def masked_corpus(template: ChatTemplate, records: list[dict[str, Any]],
                  seq_len: int) -> tuple[list[dict[str, Any]], list[MaskedConversation]]:
    """The records tokenmill masks (the rest, e.g. too long, dropped on both sides), with their masks."""
    kept, masks = [], []
    for record in records:
        conversation = parse_record(record)
        result = mask_conversation(template, conversation, max_tokens=seq_len) \
            if isinstance(conversation, Conversation) else conversation
        if isinstance(result, MaskedConversation):
            kept.append(record)
            masks.append(result)
    return kept, masks


def tiny_llama(vocab_size: int, seq_len: int, hidden_size: int) -> nn.Module:
    from transformers import AutoConfig

    from trainer.model.hf_model import build_hf_model

    config = AutoConfig.for_model("llama", vocab_size=vocab_size, hidden_size=hidden_size,
                                  intermediate_size=hidden_size * 2, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len)
    return build_hf_model(config, seed=0)


def tokenmill_epoch(masks: list[MaskedConversation], seq_len: int, micro_batch_size: int,
                    packed: bool) -> list[Batch]:
    chat = pack_conversations(list(enumerate(masks)), seq_len=seq_len, pad_id=0, dtype=np.uint16, packed=packed)
    starts = [np.array(row) for row in chat.rows.doc_starts]
    return [sft_batch(chat.rows.input_ids[i:i + micro_batch_size], chat.loss_mask[i:i + micro_batch_size],
                      starts[i:i + micro_batch_size] if packed else None)
            for i in range(0, len(chat), micro_batch_size)]


def tokenmill_runner(model: nn.Module, batches: list[Batch]) -> Callable[[], int]:
    """One pass over ``batches``: forward, the SFT loss, backward; returns the trained tokens."""
    device = torch.device("cpu")

    def run() -> int:
        model.train()
        for batch in batches:
            logits = output_logits(model(**batch.model_kwargs(device)))
            sft_loss(logits, batch.labels, num_loss_tokens([batch])).backward()
            model.zero_grad(set_to_none=True)
        return num_loss_tokens(batches)
    return run


def trl_runner(model: nn.Module, template: ChatTemplate, records: list[dict[str, Any]], batch_size: int,
               seq_len: int, scratch: Path, **collation: Any) -> Callable[[], int]:
    """One pass over TRL's own batches of ``records`` through its ``training_step``; returns the trained tokens."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(scratch), report_to="none", use_cpu=True, bf16=False, disable_tqdm=True,
                     assistant_only_loss=True, per_device_train_batch_size=batch_size,
                     max_length=seq_len if collation.get("packing") else None, **collation)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(records),
                         processing_class=template.tokenizer)
    batches = list(trainer.get_train_dataloader())
    counts = [trainer.get_batch_samples(iter([batch]), 1, torch.device("cpu"))[1] for batch in batches]

    def run() -> int:
        for batch, count in zip(batches, counts, strict=True):
            trainer.training_step(trainer.model, dict(batch), count)
            trainer.model.zero_grad(set_to_none=True)
        return int(sum(int(count) for count in counts))
    return run


def build_runners(args: argparse.Namespace, model_dir: Path, scratch: Path) -> tuple[dict[str, Any], str]:
    template = load_chat_template(model_dir)
    records, masks = masked_corpus(template, docstring_records(args.conversations), args.seq_len)
    model = tiny_llama(len(template.tokenizer), args.seq_len, args.hidden_size)
    packed = tokenmill_epoch(masks, args.seq_len, args.micro_batch_size, packed=True)
    per_batch = max(1, round(len(masks) / len(packed)))  # conversations per packed batch: the same for all
    runners = {"tokenmill_packed": tokenmill_runner(copy.deepcopy(model), packed),
               "tokenmill_padded": tokenmill_runner(copy.deepcopy(model), tokenmill_epoch(
                   masks, args.seq_len, per_batch, packed=False))}
    for name, collation in TRL_VARIANTS.items():
        size = args.micro_batch_size if collation.get("packing") else per_batch
        runners[name] = trl_runner(copy.deepcopy(model), template, records, size, args.seq_len, scratch / name,
                                   **collation)
    lengths = [len(mask.input_ids) for mask in masks]
    summary = (f"{len(masks)} conversations (mean {np.mean(lengths):.0f} tokens, "
               f"{np.mean([m.num_loss_tokens for m in masks]):.0f} trained), seq_len={args.seq_len}, "
               f"{per_batch} conversations or {args.micro_batch_size} packed rows per batch, "
               f"hidden={args.hidden_size}, threads={torch.get_num_threads()}, rounds={args.rounds}")
    return runners, summary


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    from tests.tokenization.chat import chat_tokenizers as ct  # the tests' local ChatML tokenizer (no download)

    with tempfile.TemporaryDirectory(prefix="tm-bench-") as scratch:
        model_dir = ct.save_model_dir(Path(scratch) / "chatml", ct.CHATML_FAMILY, ct.CHATML_MARKED)
        runners, summary = build_runners(args, model_dir, Path(scratch))
        rate = median_rates(runners, args.rounds)
    print(summary)
    ours = rate[("tokenmill_packed", "cpu")]
    for name in runners:
        print(f"{name:18} {rate[(name, 'wall')]:10,.0f} trained tokens/s  {rate[(name, 'cpu')]:10,.0f} "
              f"trained tokens/CPU-s  tokenmill_packed / this {ours / rate[(name, 'cpu')]:.2f}")
    best_trl = max(TRL_VARIANTS, key=lambda name: rate[(name, "cpu")])
    print(f"TRL's best setting here: {best_trl}")
    return print_result("sft_packing", rate[("tokenmill_packed", "cpu")], rate[(best_trl, "cpu")],
                        "trained tokens/CPU-s")


if __name__ == "__main__":
    main()
