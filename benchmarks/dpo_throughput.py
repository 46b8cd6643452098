"""Benchmark: preference pairs/s of DPO training steps, tokenmill's packed pairs (reference log-probs stored, or
computed every step) against TRL ``DPOTrainer`` (``precompute_ref_log_probs`` True and False), side by side.

Data: the worked example's pairs (``pipeline/stdlib_preference.py``: questions about the standard library from the
committed chat corpus, the right answer chosen, a corrupted one rejected), every k-th of them, rendered with the
SFT example's template (``configs/sft-chat.jinja``) over a byte-level BPE tokenmill trains on the standard library's
source. Pairs longer than ``seq_len`` (both sides) are left out on both sides. Model: the built-in Llama exported as
a ``transformers`` Llama (the SFT example's kind of model: the ``tiny`` preset by default), one set of initial
weights for every variant; the reference is a copy of it.

Each variant trains one epoch over the pairs per round: forward + DPO loss (sigmoid, beta 0.1) + backward + AdamW
step, in batches of about the same number of pairs. tokenmill: pairs packed whole into ``micro_batch_size`` rows of
``seq_len`` (``tokenization.preference.pack.pack_pairs``), read back as the trainer reads shard rows
(``trainer.preference.shard_rows.rows_pair_batch``), summed log-probs by ``pair_logps``, ``dpo_loss`` against the
stored reference values (looked up by each pair's doc id) or against the reference copy's, run under no_grad each
step. TRL: its own collated batches (each side padded to the longest in the batch) through its ``training_step``
(which reads the precomputed values from the batch, or runs its reference model), then its optimizer's step.

The precompute is timed on its own, as a reference pass over the epoch's pairs: tokenmill's ``pair_logps`` under
no_grad over the packed rows, TRL's ``compute_ref_log_probs`` over its batches (what its precompute runs; the
write of its cache file is left out). The rates are given without it and with one pass per epoch trained (a
one-epoch run, the case where the precompute weighs most; a run of E epochs pays 1/E of it per epoch).

Rounds alternate the variants, so a shared machine's load hits all alike; the median round counts. Rates are per
CPU second of this process (wall time swings with other processes' load) and per wall second, on one torch thread
by default (``--threads``): with more threads than free cores, threads that wait for one spin and count as work.
The last two lines are JSON: tokenmill (stored reference, one precompute pass included) against TRL computing the
reference every step, then against TRL with its precompute (its pass included); pairs per CPU second.

    python -m benchmarks.dpo_throughput --quick      # seconds
    python -m benchmarks.dpo_throughput              # a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
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
from core.rundir import RunPaths
from pipeline.stdlib_preference import preference_records, read_chat_records
from tokenization.chat.template import ChatTemplate, load_chat_template
from tokenization.preference.masks import MaskedPair, mask_pair
from tokenization.preference.pack import pack_pairs, pair_length
from tokenization.preference.records import PreferencePair, parse_pair
from tokenization.train_tokenizer import train_tokenizer
from trainer.config import MODEL_PRESETS, ModelDims
from trainer.model.export import export_model, hf_llama_config
from trainer.model.llama import ModelShape, build_model
from trainer.preference.dpo_loss import PairLogps, dpo_loss
from trainer.preference.pair_batch import PairBatch, pair_logps
from trainer.preference.shard_rows import rows_pair_batch

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "configs" / "sft-chat.jinja"
BETA, LR = 0.1, 1e-4
QUICK_DIMS = ModelDims(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
TRAINING = ("tokenmill_stored", "tokenmill_every_step", "trl_precompute", "trl_every_step")
PASSES = {"tokenmill_stored": "tokenmill_reference_pass", "trl_precompute": "trl_reference_pass"}
"""A variant that reads stored reference values -> the reference pass that stored them."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=None, help="pairs of the example's corpus (default 160, quick 16)")
    parser.add_argument("--seq-len", type=int, default=256, help="row length; a pair (both sides) must fit")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="packed rows per batch (default 4, quick 2)")
    parser.add_argument("--vocab-size", type=int, default=None, help="default 4096 (the quick start's), quick 512")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds per variant (default 3, quick 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: CPU seconds then count "
                        "work, not the spinning of threads waiting for a core on a loaded machine)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    args = parser.parse_args(argv)
    defaults = {"pairs": (16, 160), "micro_batch_size": (2, 4), "vocab_size": (512, 4096), "rounds": (1, 3)}
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.dims = QUICK_DIMS if args.quick else MODEL_PRESETS["tiny"]
    return args


def example_model(folder: Path, vocab_size: int, dims: ModelDims, seq_len: int) -> Path:
    """A model folder like the quick start's export: a BPE trained on standard-library source, the built-in Llama
    (seed 0) written by the trainer's own export."""
    tokenizer = train_tokenizer(stdlib_texts(2_000_000 if vocab_size > 1000 else 300_000), vocab_size=vocab_size)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    shape = ModelShape(dims, tokenizer.get_vocab_size(), seq_len)
    return export_model(build_model(shape, seed=0).state_dict(), hf_llama_config(shape), RunPaths(folder),
                        folder / "tokenizer.json")


def example_pairs(template: ChatTemplate, count: int, seq_len: int) -> tuple[list[PreferencePair], list[MaskedPair]]:
    """Every k-th pair of the example's corpus (k: a third of the corpus over ``count``) that fits a row, masked
    as the preference stage masks them."""
    records = preference_records(read_chat_records())
    kept, masked = [], []
    for record in records[::max(1, len(records) // (3 * count))]:
        pair = parse_pair(record)
        result = mask_pair(template, pair, max_tokens=seq_len) if isinstance(pair, PreferencePair) else pair
        if isinstance(result, MaskedPair) and pair_length(result) <= seq_len:
            kept.append(pair)
            masked.append(result)
        if len(masked) == count:
            break
    return kept, masked


def packed_batches(masked: list[MaskedPair], seq_len: int, rows: int) -> list[tuple[PairBatch, list[int]]]:
    """The pairs packed into shard rows (doc id = pair number), read back ``rows`` at a time as the trainer does."""
    chat = pack_pairs(list(enumerate(masked)), seq_len=seq_len, pad_id=1, dtype=np.uint16)
    shard = chat.rows
    return [rows_pair_batch(shard.input_ids[i:i + rows], chat.loss_mask[i:i + rows], shard.doc_ids[i:i + rows],
                            shard.doc_starts[i:i + rows], shard.num_tokens[i:i + rows])
            for i in range(0, len(chat), rows)]


def reference_pass(reference: nn.Module, batches: list[tuple[PairBatch, list[int]]], num_pairs: int,
                   store: PairLogps | None = None) -> Callable[[], int]:
    """tokenmill's precompute: each pair's reference log-probs by doc id (into ``store`` when given)."""
    def run() -> int:
        reference.eval()
        with torch.no_grad():
            for batch, doc_ids in batches:
                values = pair_logps(reference, batch)
                if store is not None:
                    store.chosen[doc_ids] = values.chosen
                    store.rejected[doc_ids] = values.rejected
        return num_pairs
    return run


def tokenmill_runner(policy: nn.Module, batches: list[tuple[PairBatch, list[int]]], num_pairs: int,
                     stored: PairLogps | None, reference: nn.Module | None) -> Callable[[], int]:
    """One epoch of DPO steps: the stored reference values, or ``reference`` run under no_grad in eval mode every
    step (as trainer.preference.objective's StoredReference and ModelReference give them)."""
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR, weight_decay=0.0)
    if reference is not None:
        reference.eval().requires_grad_(False)

    def run() -> int:
        policy.train()
        for batch, doc_ids in batches:
            if stored is not None:
                ref = PairLogps(stored.chosen[doc_ids], stored.rejected[doc_ids])
            else:
                with torch.no_grad():
                    ref = pair_logps(reference, batch)
            result = dpo_loss(pair_logps(policy, batch), ref, beta=BETA)
            result.loss.backward()
            result.metrics()  # logged every step, as TRL logs its own
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return num_pairs
    return run


def trl_trainer(model: nn.Module, template: ChatTemplate, pairs: list[PreferencePair], batch_size: int,
                scratch: Path, precompute: bool) -> Any:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    records = [{side: [message.as_template_input() for message in messages] for side, messages in
                (("prompt", pair.prompt), ("chosen", pair.chosen), ("rejected", pair.rejected))} for pair in pairs]
    args = DPOConfig(output_dir=str(scratch), report_to="none", use_cpu=True, bf16=False, disable_tqdm=True,
                     per_device_train_batch_size=batch_size, learning_rate=LR, weight_decay=0.0, beta=BETA,
                     max_length=None, precompute_ref_log_probs=precompute, seed=0)
    return DPOTrainer(model=model, ref_model=None if precompute else copy.deepcopy(model), args=args,
                      train_dataset=Dataset.from_list(records), processing_class=template.tokenizer)


def trl_runner(trainer: Any, num_pairs: int) -> Callable[[], int]:
    """One epoch of TRL's own batches through its ``training_step``, then its optimizer's step."""
    batches = list(trainer.get_train_dataloader())
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer.train sets before its first step

    def run() -> int:
        for batch in batches:
            trainer.training_step(trainer.model, dict(batch))
            trainer.optimizer.step()
            trainer.model.zero_grad(set_to_none=True)
        return num_pairs
    return run


def trl_reference_pass(trainer: Any, num_pairs: int) -> Callable[[], int]:
    """What TRL's precompute runs on each batch (``compute_ref_log_probs``), over the epoch's batches."""
    batches = list(trainer.get_train_dataloader())

    def run() -> int:
        for batch in batches:
            trainer.compute_ref_log_probs(trainer.ref_model, dict(batch))
        return num_pairs
    return run


def build_runners(args: argparse.Namespace, scratch: Path) -> tuple[dict[str, Callable[[], int]], str]:
    from transformers import AutoModelForCausalLM

    folder = example_model(scratch / "example", args.vocab_size, args.dims, args.seq_len)
    template = load_chat_template(folder, TEMPLATE)
    pairs, masked = example_pairs(template, args.pairs, args.seq_len)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    batches = packed_batches(masked, args.seq_len, args.micro_batch_size)
    n = len(masked)
    per_batch = max(1, round(n / len(batches)))  # pairs per packed batch: TRL's batch size, the same pairs a step
    stored = PairLogps(torch.zeros(n), torch.zeros(n))
    reference_pass(copy.deepcopy(model), batches, n, stored)()
    trl_stored = trl_trainer(copy.deepcopy(model), template, pairs, per_batch, scratch / "trl-pre", precompute=True)
    trl_live = trl_trainer(copy.deepcopy(model), template, pairs, per_batch, scratch / "trl-live", precompute=False)
    runners = {
        "tokenmill_stored": tokenmill_runner(copy.deepcopy(model), batches, n, stored, None),
        "tokenmill_every_step": tokenmill_runner(copy.deepcopy(model), batches, n, None, copy.deepcopy(model)),
        "trl_precompute": trl_runner(trl_stored, n),
        "trl_every_step": trl_runner(trl_live, n),
        "tokenmill_reference_pass": reference_pass(copy.deepcopy(model), batches, n),
        "trl_reference_pass": trl_reference_pass(trl_live, n),
    }
    lengths = [pair_length(pair) for pair in masked]
    summary = (f"{n} pairs (mean {np.mean(lengths):.0f} tokens both sides), seq_len={args.seq_len}, "
               f"{args.micro_batch_size} packed rows (~{per_batch} pairs) or {per_batch} padded pairs per step, "
               f"model {args.dims.hidden_size}x{args.dims.num_layers} vocab={len(template.tokenizer)}, "
               f"threads={torch.get_num_threads()}, rounds={args.rounds}")
    return runners, summary


def with_precompute(rate: dict[tuple[str, str], float], name: str, clock: str) -> float:
    """Pairs/s of a one-epoch run that also pays its reference pass: 1 / (1/train + 1/pass)."""
    if name not in PASSES:
        return rate[(name, clock)]
    return 1.0 / (1.0 / rate[(name, clock)] + 1.0 / rate[(PASSES[name], clock)])


def report(rate: dict[tuple[str, str], float]) -> None:
    for name in (*TRAINING, *PASSES.values()):
        print(f"{name:26} {rate[(name, 'wall')]:9,.1f} pairs/s {rate[(name, 'cpu')]:9,.1f} pairs/CPU-s")
    print("with one reference pass per epoch (a one-epoch run):")
    for name in PASSES:
        print(f"{name:26} {with_precompute(rate, name, 'wall'):9,.1f} pairs/s "
              f"{with_precompute(rate, name, 'cpu'):9,.1f} pairs/CPU-s")
    ours = rate[("tokenmill_stored", "cpu")]
    print("ratios, pairs/CPU-s: tokenmill stored / TRL precompute, steps only "
          f"{ours / rate[('trl_precompute', 'cpu')]:.2f}x, one pass each included "
          f"{with_precompute(rate, 'tokenmill_stored', 'cpu') / with_precompute(rate, 'trl_precompute', 'cpu'):.2f}x;"
          f" tokenmill stored / TRL every step {ours / rate[('trl_every_step', 'cpu')]:.2f}x (pass included "
          f"{with_precompute(rate, 'tokenmill_stored', 'cpu') / rate[('trl_every_step', 'cpu')]:.2f}x); "
          f"tokenmill every step / TRL every step "
          f"{rate[('tokenmill_every_step', 'cpu')] / rate[('trl_every_step', 'cpu')]:.2f}x")


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="tm-bench-") as scratch:
        runners, summary = build_runners(args, Path(scratch))
        rate = median_rates(runners, args.rounds)
    print(summary)
    report(rate)
    ours = with_precompute(rate, "tokenmill_stored", "cpu")
    unit = "pairs/CPU-s (tokenmill stored reference, its precompute included)"
    print_result("dpo_throughput_vs_trl_every_step", ours, rate[("trl_every_step", "cpu")], unit)
    return print_result("dpo_throughput", ours, with_precompute(rate, "trl_precompute", "cpu"), unit)


if __name__ == "__main__":
    main()
