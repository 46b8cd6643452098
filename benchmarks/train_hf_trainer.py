"""Benchmark: the real training path (``tokenmill train``) against Hugging Face ``Trainer``, same rows, same dims.

``ours`` is what a user runs: ``tokenmill train RECIPE`` as a subprocess, so Prefect (a temporary server and
the flow), ``accelerate launch`` and the launched trainer with its thread settings all count. ``baseline`` is
what the same user would otherwise pick: ``transformers.Trainer`` on ``LlamaForCausalLM`` with the built-in
model's dims (``trainer.model.export.hf_llama_config``), on the very rows the run packed (its train shards), with
the same micro-batch, steps, learning rate, warm-up, weight decay, clipping and precision (fp32), also as a
subprocess of its own. The ratio is steady-state tokens/s (the median step time over the steps after the
first ``--warmup`` of each side: ours from ``train_metrics``, the Trainer's from a step callback); each side's
whole command wall time is printed too (start-up included: Prefect's server on ours, importing transformers
on the Trainer's). Both sides pad-count the same: every position of a row is a token.

The data preparation (``tokenmill prepare``) is done once and not timed. ``--num-processes 2`` runs ours on
two ranks (gloo) and the Trainer under ``accelerate launch`` on two ranks as well.

    python -m benchmarks.train_hf_trainer --quick      # from the repo root; ~3 minutes on 2 cores
    python -m benchmarks.train_hf_trainer --steps 200   # the figure in the issue note
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.result import print_result

STDLIB_PACKAGES = ("json", "email", "asyncio", "unittest", "xml", "http", "logging", "importlib")
QUICK_PACKAGES = ("json", "email")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps on each side (default 120, quick 30)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="first steps of each side left out of the rate (default 10, quick 5)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per side; the fastest counts")
    parser.add_argument("--quick", action="store_true", help="a small corpus and 30 steps (sets what is not given)")
    parser.add_argument("--work-dir", type=Path,
                        help="a new folder to keep the corpus, run dir and results in (default: a temp dir)")
    parser.add_argument("--hf-side", type=Path, help=argparse.SUPPRESS)  # internal: run the Trainer on RUN_DIR
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    if args.hf_side is not None:
        return _hf_trainer_side(args.hf_side, args)
    args.steps = args.steps or (30 if args.quick else 120)
    args.warmup = args.warmup if args.warmup is not None else (5 if args.quick else 10)
    with tempfile.TemporaryDirectory(prefix="tm-bench-train-") as tmp:
        work = args.work_dir or Path(tmp)
        recipe = write_recipe(work, args, QUICK_PACKAGES if args.quick else STDLIB_PACKAGES)
        _run([_tokenmill(), "--quiet", "prepare", str(recipe)])
        rates: dict[str, list[float]] = {"ours": [], "hf": []}
        walls: dict[str, list[float]] = {"ours": [], "hf": []}
        for repeat in range(args.repeats):  # alternating, so machine noise hits both sides alike
            run_dir = work / f"run-{repeat}"
            shutil.copytree(work / "run", run_dir)  # the prepared run, trained afresh each time
            walls["ours"].append(_timed([_tokenmill(), "--quiet", "train", str(recipe), "--run-dir", str(run_dir)]))
            rates["ours"].append(steady_tokens_per_s(run_dir, args.warmup))
            result_file = work / f"hf-{repeat}.json"
            walls["hf"].append(_timed(_hf_command(work / "run", args, result_file)))
            rates["hf"].append(json.loads(result_file.read_text())["tokens_per_s"])
    ours_rate, hf_rate, ours_wall, hf_wall = max(rates["ours"]), max(rates["hf"]), min(walls["ours"]), min(walls["hf"])
    print(f"preset={args.preset} seq_len={args.seq_len} micro_batch={args.micro_batch_size} steps={args.steps} "
          f"processes={args.num_processes} fp32, rate over steps {args.warmup + 1}..{args.steps}")
    print(f"{'side':44} {'tokens/s':>10} {'command wall s':>15}")
    print(f"{'tokenmill train (Prefect + accelerate launch)':44} {ours_rate:10,.0f} {ours_wall:15.1f}")
    print(f"{'transformers Trainer, LlamaForCausalLM':44} {hf_rate:10,.0f} {hf_wall:15.1f}")
    return print_result("train_hf_trainer", ours_rate, hf_rate, "tokens/s")


def write_recipe(root: Path, args: argparse.Namespace, packages: tuple[str, ...]) -> Path:
    """A recipe over some standard-library packages; evaluation and mid-run checkpoints off (not timed here)."""
    import sysconfig

    corpus = root / "corpus"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for package in packages:
        shutil.copytree(stdlib / package, corpus / package, ignore=shutil.ignore_patterns("__pycache__", "test*"))
    (root / "manifest.yaml").write_text(yaml.safe_dump({
        "name": "stdlib-bench",
        "sources": [{"name": "stdlib", "path": str(corpus), "format": "text", "glob": "**/*.py"}],
    }))
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "bench", "run_dir": str(root / "run"),
        "data": {"manifests": ["manifest.yaml"], "val_fraction": 0.05},
        "tokenizer": {"vocab_size": 4096},
        "pack": {"seq_len": args.seq_len, "rows_per_shard": 4096},
        "model": {"preset": args.preset},
        "train": {"max_steps": args.steps, "micro_batch_size": args.micro_batch_size, "grad_accum_steps": 1,
                  "lr": 0.003, "warmup_steps": 5, "precision": "fp32", "checkpoint_every": args.steps,
                  "eval_every": 10 * args.steps, "log_every": 5, "num_processes": args.num_processes},
        "eval": {"enabled": False},
    }))
    return recipe


def steady_tokens_per_s(run_dir: Path, warmup: int) -> float:
    """Tokens/s in ``metrics/train.jsonl`` after step ``warmup``: the median logged window (log_every is 5)."""
    rows = [json.loads(line) for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    rows = [row for row in rows if row.get("step", 0) > warmup and row.get("step_time_s")]
    if not rows:
        raise SystemExit(f"{run_dir}: no train metrics after step {warmup}; the training did not run")
    tokens_per_step = rows[0]["tokens_per_s"] * rows[0]["step_time_s"]
    return tokens_per_step / statistics.median(row["step_time_s"] for row in rows)


def _hf_command(run_dir: Path, args: argparse.Namespace, result_file: Path) -> list[str]:
    side = ["-m", "benchmarks.train_hf_trainer", "--hf-side", str(run_dir), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--micro-batch-size", str(args.micro_batch_size)]
    os.environ["TM_BENCH_HF_RESULT"] = str(result_file)
    if args.num_processes == 1:
        return [sys.executable, *side]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
            str(args.num_processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            *side]


def _hf_trainer_side(run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``LlamaForCausalLM`` with ``transformers.Trainer`` on the run's train rows; write tokens/s."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from core.shards.store import ShardTokens, read_shard_index
    from trainer.config import MODEL_PRESETS
    from trainer.model.export import hf_llama_config
    from trainer.model.llama import ModelShape

    infos = [info for info in read_shard_index(run_dir) if info.split == "train"]
    shards = [ShardTokens(run_dir / info.path) for info in infos]
    rows = np.concatenate([shard.tokens for shard in shards]).astype(np.int64)
    seq_len, vocab_size = rows.shape[1], int(shards[0].metadata["vocab_size"])
    shape = ModelShape(MODEL_PRESETS[args.preset], vocab_size, seq_len)
    model = LlamaForCausalLM(LlamaConfig.from_dict(hf_llama_config(shape)))

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            ids = torch.from_numpy(rows[index])
            return {"input_ids": ids, "labels": ids.masked_fill(ids == 1, -100)}  # pad id 1: not scored

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.times.append(time.perf_counter() - self.start)

    with tempfile.TemporaryDirectory(prefix="tm-bench-hf-") as out:
        training = TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.micro_batch_size,
            learning_rate=0.003, warmup_steps=5, weight_decay=0.1, max_grad_norm=1.0, lr_scheduler_type="cosine",
            adam_beta1=0.9, adam_beta2=0.95, use_cpu=True, report_to=[], save_strategy="no", logging_steps=50,
            dataloader_num_workers=0, seed=0, disable_tqdm=True)
        timer = StepTimes()
        trainer = Trainer(model=model, args=training, train_dataset=Rows(), callbacks=[timer])
        trainer.train()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    steady = timer.times[args.warmup:]
    result = {"tokens_per_s": args.micro_batch_size * seq_len * world / statistics.median(steady),
              "threads": torch.get_num_threads()}
    if int(os.environ.get("RANK", "0")) == 0:
        Path(os.environ["TM_BENCH_HF_RESULT"]).write_text(json.dumps(result))
    return result


def _tokenmill() -> str:
    return str(Path(sys.executable).with_name("tokenmill"))


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def _timed(command: list[str]) -> float:
    start = time.perf_counter()
    _run(command)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
