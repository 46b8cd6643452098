"""Training loop: loader batches -> optimizer steps on Accelerate, with evaluation, metrics and checkpoints on schedule.

``TrainingLoop`` only composes collaborators built elsewhere from the configs (model, AdamW, warmup +
cosine LambdaLR, TrainLoader, MixedPrecision, NonFiniteGuard, Evaluator, Checkpointer, MetricsSink,
Telemetry, callbacks). One step = load the step's micro-batches (``data_wait_s``), forward/backward
each under autocast with gradients synced on the last (``fwd_bwd_s``), then unscale, clip and apply
or skip the update (``optimizer_s``): skipped when non-finite (NonFiniteGuard) or a loss spike (SpikeGuard,
whose streaks roll the weights back to the newest checkpoint).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn

from core.errors import CheckpointError
from trainer.callbacks import Callback
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.config import TrainConfig
from trainer.eval.evaluate import Evaluator
from trainer.guard import NonFiniteGuard, state_counts
from trainer.loader.batches import Batch, TrainLoader
from trainer.loader.pair_rows import PairMicroBatch
from trainer.loader.sft_loss import sft_loss
from trainer.metrics.segments import RowLossLog, row_mean_losses
from trainer.metrics.sink import MetricsSink
from trainer.metrics.telemetry import PhaseTimer, Telemetry
from trainer.model.llama import next_token_loss
from trainer.model.spec import ModelSpec, output_logits
from trainer.parallel.accelerator import sync_data_parallel_gradients
from trainer.precision import MixedPrecision
from trainer.preference.objective import PreferenceObjective, reward_metrics, reward_sums
from trainer.spike_guard import SpikeGuard


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch and ask torch for deterministic kernels (warn where none exists)."""
    set_seed(seed)
    # cuBLAS is deterministic only with a fixed workspace; read when its first handle is created.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


@dataclass
class LoopCounters:
    """Optimizer steps taken, tokens processed (all ranks, padding included), SFT's trained tokens and DPO's pairs
    (all ranks), skipped updates, the spike guard's state (:mod:`trainer.spike_guard`: spikes counted, the current
    streak, rollbacks, the recent losses)."""

    step: int = 0
    tokens_seen: int = 0
    loss_tokens_seen: int = 0
    pairs_seen: int = 0
    skipped_steps: int = 0
    nonfinite_in_a_row: int = 0
    spike_steps: int = 0
    spikes_in_a_row: int = 0
    rollbacks: int = 0
    recent_losses: list[float] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "tokens_seen": self.tokens_seen, "loss_tokens_seen": self.loss_tokens_seen,
                 "skipped_steps": self.skipped_steps,
                 "nonfinite_in_a_row": self.nonfinite_in_a_row, "spike_steps": self.spike_steps,
                 "spikes_in_a_row": self.spikes_in_a_row, "rollbacks": self.rollbacks,
                 "recent_losses": list(self.recent_losses)}
        if self.pairs_seen:  # dpo runs only: the other modes' checkpoints keep their layout
            state["pairs_seen"] = self.pairs_seen
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.loss_tokens_seen = int(state.get("loss_tokens_seen", 0))  # absent before SFT existed
        self.pairs_seen = int(state.get("pairs_seen", 0))  # absent before DPO existed
        self.skipped_steps, self.nonfinite_in_a_row = state_counts(state)
        # Checkpoints older than the spike guard have none of its keys: a fresh guard.
        self.spike_steps, self.spikes_in_a_row = int(state.get("spike_steps", 0)), int(state.get("spikes_in_a_row", 0))
        self.rollbacks = int(state.get("rollbacks", 0))
        self.recent_losses = [float(loss) for loss in state.get("recent_losses", [])]


@dataclass(frozen=True)
class ModelSignature:
    """Stateful guard: a checkpoint only resumes into the same model (its spec's signature)."""

    signature: dict[str, Any]

    def state_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.signature, sort_keys=True, default=str))  # as trainer_state.json holds it

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state != self.state_dict():
            raise CheckpointError(f"the checkpoint's model ({state}) differs from the recipe's "
                                  f"({self.state_dict()}); restore the recipe's model section, or delete "
                                  "checkpoints/ to train the new model from scratch.")


ROLLBACK_COLUMNS = ("rolled_back_to_step", "samples_skipped_from", "samples_skipped_to")
"""Train-row columns of a rollback (:meth:`TrainingLoop.roll_back`); null in the other rows of a guarded run, but
present: the train_metrics view takes its columns from the first row's keys."""


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step measured: loss averaged over all ranks, global grad norm, phase seconds."""

    loss: float
    grad_norm: float | None
    lr: float
    phase_seconds: dict[str, float]
    applied: bool
    spike_z_score: float | None = None
    """Set when the loss was a spike (its z-score over the recent losses): the update was skipped."""
    loss_tokens: int | None = None
    """SFT: the tokens the step trained on, over all ranks (its loss is their mean); None when pretraining."""
    pairs: int | None = None
    """DPO: the pairs the step trained on, over all ranks (its loss is their mean); None otherwise."""
    rewards: dict[str, float] | None = None
    """DPO: the step's ``rewards/*`` metrics over its pairs on all ranks."""


def as_float(value: Any) -> float | None:
    """A Python float from a norm that may be a tensor, a DTensor (FSDP) or None (DeepSpeed before its step)."""
    if value is None:
        return None
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


@dataclass
class TrainingLoop:
    """Runs optimizer steps to a target, evaluating, logging and checkpointing on the recipe's schedule."""

    accelerator: Accelerator
    model: nn.Module
    optimizer: Any
    scheduler: Any
    loader: TrainLoader
    evaluator: Evaluator
    checkpointer: Checkpointer
    metrics: MetricsSink
    train: TrainConfig
    counters: LoopCounters
    precision: MixedPrecision | None = None
    telemetry: Telemetry | None = None
    callbacks: list[Callback] = field(default_factory=list)
    spec: ModelSpec | None = None
    """The model's spec: what the export asks (config.json, tied weights)."""
    row_losses: RowLossLog | None = None
    """Where this rank writes its rows' losses (``train.log_row_losses``); None = not recorded."""
    chat_template_file: str | None = None
    """The chat template the run's conversations were rendered with, for the exports (see
    :func:`trainer.train.run_chat_template`); None: the run's ``tokenizer/chat_template.jinja``, if any."""
    preference: PreferenceObjective | None = None
    """A dpo run's loss (``train.dpo``); None for pretrain and sft."""
    _window: list[StepResult] = field(default_factory=list)
    _step_row_losses: list[torch.Tensor] = field(default_factory=list)
    _step_rewards: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.precision is None:
            self.precision = MixedPrecision(self.train.precision, self.accelerator.device.type,
                                            self.train.loss_scale_growth_interval)
        self.guard = NonFiniteGuard(self.train.max_nonfinite_steps, self.counters)
        self.spikes = SpikeGuard(self.train.spike_zscore, self.train.spike_window, self.train.max_spikes_in_a_row,
                                 self.counters)

    @property
    def tokens_per_step(self) -> int:
        return self.loader.layout.global_batch_size * self.loader.rows.seq_len

    def train_step(self) -> StepResult:
        """One optimizer step over ``grad_accum_steps`` micro-batches; the update is skipped when non-finite."""
        step = self.counters.step + 1
        for callback in self.callbacks:
            callback.on_step_begin(step)
        timer = PhaseTimer(self.accelerator.device)
        lr = float(self.optimizer.param_groups[0]["lr"])
        layout = self.loader.layout
        first_sample = self.loader.samples_consumed + layout.rank * layout.micro_batch_size * layout.grad_accum_steps
        with timer.phase("data_wait_s"):
            batches = self.loader.next_step()
        loss_tokens, pairs = self.loader.step_loss_tokens, self.loader.step_pairs
        with timer.phase("fwd_bwd_s"):
            if self.preference is not None:
                local_loss = self.forward_backward_pairs(batches, pairs)
            else:
                local_loss = self.forward_backward(batches, loss_tokens)
        with timer.phase("optimizer_s"):
            loss, grad_norm, applied, spike_z_score = self.optimizer_step(local_loss)
            rewards = None if self.preference is None else self.step_rewards()
        self.counters.step = step
        self.counters.tokens_seen += self.tokens_per_step
        self.counters.loss_tokens_seen += loss_tokens or 0
        self.counters.pairs_seen += pairs or 0
        if self.row_losses is not None:
            self.row_losses.write(step, first_sample, self._step_row_losses)
        for callback in self.callbacks:
            callback.on_step_end(step)
        return StepResult(loss, grad_norm, lr, timer.seconds, applied, spike_z_score, loss_tokens,
                          pairs if self.preference is not None else None, rewards)

    def forward_backward_pairs(self, batches: list[PairMicroBatch], step_pairs: int) -> torch.Tensor:
        """This rank's share of a dpo step's loss: every pair of the step weighs the same, however micro-batches and
        ranks share them (``step_pairs``: the step's pairs over all ranks, as SFT's trained tokens; each
        micro-batch's loss is multiplied by the replicas and the accumulation steps, which DDP's gradient mean and
        Accelerate's backward divide by again). Keeps the summed rewards for :meth:`step_rewards`."""
        device = self.accelerator.device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        rewards = torch.zeros(5, dtype=torch.float64, device=device)
        replicas = self.loader.layout.world_size
        for micro in batches:
            with self.accelerator.accumulate(self.model):
                with self.precision.autocast():
                    result = self.preference.loss(self.model, micro.to(device), step_pairs)
                    loss = result.loss * replicas
                self.accelerator.backward(self.precision.scale(loss * self.accelerator.gradient_accumulation_steps))
                loss_sum += loss.detach().double()
                rewards += reward_sums(result)
        assert self.accelerator.sync_gradients, "the last micro-batch of a step must sync gradients"
        sync_data_parallel_gradients(self.model, self.accelerator)
        self._step_rewards = rewards
        return loss_sum

    def step_rewards(self) -> dict[str, float]:
        """The last step's ``rewards/*`` over its pairs on all ranks (collective: one all-reduce of five sums)."""
        assert self._step_rewards is not None, "no dpo step taken"
        return reward_metrics(self.accelerator.reduce(self._step_rewards, reduction="sum").tolist())

    def forward_backward(self, batches: list[Batch], step_loss_tokens: int | None = None) -> torch.Tensor:
        """This rank's share of the step's loss (the mean over ranks is the step's loss); gradients accumulate,
        synced across replicas on the last micro-batch.

        Pretraining: the mean of the micro-batches' mean losses. SFT (``step_loss_tokens``: the step's trained tokens
        over all ranks): every trained token weighs the same, however the micro-batches and ranks share them
        (:mod:`trainer.loader.sft_loss`); each micro-batch's summed loss over that count is multiplied by the
        data-parallel replicas and by the accumulation steps, which DDP's gradient mean and Accelerate's backward
        divide by again. DDP syncs inside the last backward; a tensor-parallel run averages its replicas' gradients
        after it.
        """
        device = self.accelerator.device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._step_row_losses = []
        replicas = self.loader.layout.world_size
        for batch in batches:
            with self.accelerator.accumulate(self.model):
                with self.precision.autocast():
                    logits = output_logits(self.model(**batch.model_kwargs(device)))
                    labels = batch.labels.to(device)
                    if step_loss_tokens is None:
                        loss = next_token_loss(logits, labels)
                    else:
                        loss = sft_loss(logits, labels, step_loss_tokens) * replicas
                if self.row_losses is not None:
                    self._step_row_losses.append(row_mean_losses(logits, labels))
                accumulated = loss if step_loss_tokens is None else loss * self.accelerator.gradient_accumulation_steps
                self.accelerator.backward(self.precision.scale(accumulated))
                loss_sum += loss.detach().double()
        assert self.accelerator.sync_gradients, "the last micro-batch of a step must sync gradients"
        sync_data_parallel_gradients(self.model, self.accelerator)
        return loss_sum / len(batches) if step_loss_tokens is None else loss_sum

    def optimizer_step(self, local_loss: torch.Tensor) -> tuple[float, float | None, bool, float | None]:
        """Unscale, clip, then apply the update unless the loss/grad norm is non-finite, the loss is a spike, or
        fp16 overflowed.

        Returns (loss averaged over ranks, global gradient norm before clipping, whether the update was applied,
        the loss's z-score when it was a spike else None).
        """
        # Collective: all ranks decide alike. The ranks of a TP group hold the same loss, so the mean over
        # all ranks is the mean over the data-parallel replicas.
        loss = float(self.accelerator.reduce(local_loss, reduction="mean"))
        self.precision.unscale_(self.optimizer)
        grad_norm = as_float(self.accelerator.clip_grad_norm_(self.model.parameters(), self.train.grad_clip))
        finite = self.guard.is_finite(loss, grad_norm, loss_scaled=self.precision.scaler is not None)
        spike = finite and self.spikes.is_spike(loss)
        spike_z_score = self.spikes.z_score(loss) if spike else None
        applied = self.precision.step(self.optimizer, allowed=finite and not spike)
        self.optimizer.zero_grad(set_to_none=True)
        if applied:  # the schedule counts applied updates, as Accelerate's own fp16 skipping does
            self.scheduler.step()
        self.guard.record(finite, applied)
        self.spikes.record(loss, spike, applied)
        return loss, grad_norm, applied, spike_z_score

    def run(self, target_step: int) -> None:
        """Train until ``counters.step == target_step``; evaluates at step 0, on schedule and at the end.

        Raises TrainingDivergedError after ``train.max_nonfinite_steps`` non-finite steps in a row. A loss spike
        gets a train row of its own (``spike_z_score``); a streak of them rolls back (:meth:`roll_back`).
        """
        if self.counters.step == 0:
            self.evaluate()
        while self.counters.step < target_step:
            if not self._window and self.telemetry is not None:
                self.telemetry.start_window()
            result = self.train_step()
            self._window.append(result)
            step = self.counters.step
            if result.spike_z_score is not None:
                self.accelerator.print(f"step {step}: loss {result.loss:.4f} is a spike ({result.spike_z_score:.1f} "
                                       f"standard deviations above the last {self.train.spike_window} steps' mean); "
                                       "update skipped", flush=True)
            rollback = self.roll_back(step) if self.spikes.should_roll_back else None
            if (step % self.train.log_every == 0 or step in (1, target_step) or self.guard.should_stop
                    or result.spike_z_score is not None):
                self.log_window(target_step, rollback)
            if self.guard.should_stop:
                raise self.guard.stop_error(step, self.checkpointer.latest_name())
            if step % self.train.eval_every == 0 or step == target_step:
                self.evaluate()
            if step % self.train.checkpoint_every == 0 or step == target_step:
                self.save_checkpoint(step, final=step == target_step)
        self.checkpointer.wait_for_pending()  # the last checkpoint is on disk before anything reads it
        self.report_spikes()

    def save_checkpoint(self, step: int, final: bool) -> None:
        """Checkpoint ``step``, except on schedule during a non-finite or spike streak (keep the last good one
        newest)."""
        if (self.guard.in_streak or self.spikes.in_streak) and not final:
            streak = (f"{self.counters.nonfinite_in_a_row} non-finite step(s)" if self.guard.in_streak
                      else f"{self.counters.spikes_in_a_row} loss spike(s)")
            self.accelerator.print(f"checkpoint at step {step} skipped: {streak} in a row", flush=True)
            return
        self.checkpointer.save(step)

    def roll_back(self, step: int) -> dict[str, Any]:
        """After ``max_spikes_in_a_row`` spikes: restore the newest checkpoint's weights, optimizer, schedule and RNG,
        keep the step count and the data position, so the batches since that checkpoint are skipped.

        Returns the train-row columns that record it: ``rolled_back_to_step`` (None without a checkpoint: the
        weights are then kept, the spikes' updates were skipped anyway), ``samples_skipped_from`` and
        ``samples_skipped_to`` (the loader's global sample numbers, half-open: the batches not trained on).
        """
        num_spikes = self.counters.spikes_in_a_row
        restored = self.checkpointer.restore_weights_of_latest(keep=("loop", "loader", "signature"))
        self.spikes.rolled_back()
        skipped_to = self.loader.samples_consumed
        to_step, where = None, "no checkpoint yet: weights kept"
        skipped_from = skipped_to - num_spikes * self.loader.layout.global_batch_size
        if restored is not None:
            to_step, loader_state = restored
            skipped_from, where = int(loader_state["samples_consumed"]), f"rolled back to step {to_step}"
        self.accelerator.print(f"step {step}: {num_spikes} loss spikes in a row (since step {step - num_spikes + 1}); "
                               f"{where}, samples {skipped_from}-{skipped_to - 1} skipped", flush=True)
        return {"rolled_back_to_step": to_step, "samples_skipped_from": skipped_from,
                "samples_skipped_to": skipped_to}

    def report_spikes(self) -> None:
        """One line at the end of a run that skipped spikes: how many, and how to list them."""
        if self.counters.spike_steps:
            self.accelerator.print(f"skipped {self.counters.spike_steps} loss-spike step(s), {self.counters.rollbacks} "
                                   "rollback(s): SELECT step, loss, spike_z_score, rolled_back_to_step, "
                                   "samples_skipped_from, samples_skipped_to FROM train_metrics WHERE spike_z_score "
                                   "IS NOT NULL", flush=True)

    def log_window(self, target_step: int, rollback: dict[str, Any] | None = None) -> None:
        """Write one train row (and a progress line) for the steps since the last row; ``rollback``: its columns."""
        last, window = self._window[-1], self._window
        row = {"step": self.counters.step, "loss": last.loss, "lr": last.lr, "grad_norm": last.grad_norm,
               "tokens_seen": self.counters.tokens_seen, "epoch": self.loader.epoch,
               "skipped_steps": self.counters.skipped_steps, "loss_scale": self.precision.loss_scale}
        if last.loss_tokens is not None:  # SFT: the tokens the logged step trained on, and all so far
            row.update(loss_tokens=last.loss_tokens, loss_tokens_seen=self.counters.loss_tokens_seen)
        if last.pairs is not None:  # DPO: the logged step's pairs and rewards, and the pairs so far
            row.update(pairs=last.pairs, pairs_seen=self.counters.pairs_seen, **(last.rewards or {}))
        if (mix := self.loader.pop_mix_counts()) is not None:  # [{stage, source, samples}] since the last row
            row["mix"] = mix
        if self.spikes.zscore is not None:  # the guard's columns, in every row of a guarded run
            row.update(spike_steps=self.counters.spike_steps, spike_z_score=last.spike_z_score,
                       **(rollback or dict.fromkeys(ROLLBACK_COLUMNS)))
        tokens = self.tokens_per_step * len(window)
        if self.telemetry is not None:
            row.update(self.telemetry.window_columns([result.phase_seconds for result in window], tokens))
        else:
            seconds = sum(sum(result.phase_seconds.values()) for result in window)
            row.update(tokens_per_s=tokens / max(seconds, 1e-9), step_time_s=seconds / len(window))
        if last.loss_tokens is not None:  # SFT throughput that counts: trained tokens per second, same clock
            row["loss_tokens_per_s"] = row["tokens_per_s"] * sum(result.loss_tokens or 0 for result in window) / tokens
        if last.pairs is not None:  # DPO throughput: pairs per second, same clock
            row["pairs_per_s"] = row["tokens_per_s"] * sum(result.pairs or 0 for result in window) / tokens
        self._window = []
        self.metrics.log_train(row)
        mfu = f" | mfu {row['mfu']:.1%}" if math.isfinite(row.get("mfu") or math.nan) else ""
        grad_norm = math.nan if last.grad_norm is None else last.grad_norm
        self.accelerator.print(f"step {row['step']}/{target_step} | loss {last.loss:.4f} | lr {last.lr:.2e} | "
                               f"grad_norm {grad_norm:.3f} | {row['tokens_per_s']:,.0f} tokens/s{mfu}", flush=True)

    def evaluate(self) -> dict[str, float] | None:
        """Validation on the fixed subset; writes an eval row and prints it."""
        result = self.evaluator.evaluate(self.model)
        if result is None:
            self.accelerator.print("eval skipped: no split=val shards in the index", flush=True)
            return None
        row = {"step": self.counters.step, "tokens_seen": self.counters.tokens_seen, **result}
        self.metrics.log_eval(row)
        scores = (f"val_ppl {row['val_ppl']:.2f}" if "val_ppl" in row
                  else f"rewards/accuracy {row['rewards/accuracy']:.3f}")  # dpo: no perplexity
        self.accelerator.print(f"eval step {row['step']} | val_loss {row['val_loss']:.4f} | {scores}", flush=True)
        return row
