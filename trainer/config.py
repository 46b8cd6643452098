"""Settings of the model and the training loop (the ``model`` and ``train`` sections of a recipe)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from core.config import FrozenConfig, Seed
from core.rundir import TASK_FILE_NAME

Precision = Literal["fp32", "bf16", "fp16"]


class ModelDims(FrozenConfig):
    hidden_size: int = Field(gt=0)
    """Width of the residual stream."""
    num_layers: int = Field(gt=0)
    """Decoder blocks."""
    num_heads: int = Field(gt=0)
    """Query heads."""
    num_kv_heads: int = Field(gt=0)
    """Key/value heads (grouped-query attention); must divide num_heads."""
    intermediate_size: int = Field(gt=0)
    """SwiGLU hidden width."""
    rope_theta: float = Field(default=10000.0, gt=0)
    """Rotary embedding base."""
    rms_norm_eps: float = Field(default=1e-5, gt=0)
    """RMSNorm epsilon."""
    tie_word_embeddings: bool = True
    """Share the input embedding with the output projection."""

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelDims:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be divisible by num_kv_heads {self.num_kv_heads}")
        return self


MODEL_PRESETS: dict[str, ModelDims] = {
    "tiny": ModelDims(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384),
    "125m": ModelDims(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12, intermediate_size=2048),
    "350m": ModelDims(hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=8, intermediate_size=2816),
    "1b": ModelDims(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=5632),
}


MODEL_SOURCE_KEYS = ("preset", "dims", "hf_config", "from_pretrained")
"""The ways to say which model to train; a recipe sets at most one (none: the ``tiny`` preset)."""


class ModelConfig(FrozenConfig):
    preset: Literal["tiny", "125m", "350m", "1b"] | None = None
    """A named size of the built-in Llama-style model (the default, ``tiny``, when no other key is set)."""
    dims: ModelDims | None = None
    """Explicit dimensions of the built-in model."""
    hf_config: str | None = None
    """A Hugging Face ``config.json`` (or a folder holding one) of any causal-LM architecture, built with random
    weights from ``train.seed``; relative to the recipe's folder."""
    from_pretrained: str | None = None
    """A local Hugging Face model folder (config.json + ``*.safetensors``): continued pretraining from its weights;
    relative to the recipe's folder. Nothing is ever downloaded."""
    trust_remote_code: bool = False
    """Allow a Hugging Face config whose architecture is defined by Python files in the model folder (``auto_map``)."""

    @model_validator(mode="after")
    def _one_model_source(self) -> ModelConfig:
        given = [key for key in MODEL_SOURCE_KEYS if getattr(self, key) is not None]
        if len(given) > 1:
            raise ValueError(f"set only one of model.{', model.'.join(MODEL_SOURCE_KEYS)}; the recipe sets "
                             f"{' and '.join('model.' + key for key in given)}")
        return self

    @property
    def is_hugging_face(self) -> bool:
        """True when the model is a Hugging Face architecture (``hf_config`` or ``from_pretrained``)."""
        return self.hf_config is not None or self.from_pretrained is not None

    @property
    def hugging_face_path(self) -> str | None:
        """The recipe's ``hf_config`` or ``from_pretrained`` path, as written."""
        return self.from_pretrained if self.from_pretrained is not None else self.hf_config

    def resolved_dims(self) -> ModelDims:
        """The built-in model's dimensions: ``dims`` if given, else the preset's (``tiny`` by default)."""
        if self.is_hugging_face:
            raise ValueError("model: a Hugging Face model has no built-in dims; read its config.json")
        return self.dims if self.dims is not None else MODEL_PRESETS[self.preset or "tiny"]


TrainMode = Literal["pretrain", "sft", "dpo"]


class DpoConfig(FrozenConfig):
    """Preference tuning (``train.dpo``, with ``train.mode: dpo``): the loss over chosen/rejected pairs."""

    beta: float = Field(default=0.1, gt=0)
    """Strength of the KL penalty: rewards are beta * (policy - reference) summed log-probs (SimPO: beta * mean)."""
    label_smoothing: float = Field(default=0.0, ge=0, lt=0.5)
    """Probability that a pair's preference is flipped (conservative DPO); 0 = plain sigmoid DPO."""
    loss: Literal["sigmoid", "simpo"] = "sigmoid"
    """sigmoid: DPO against the reference model (the run's base model); simpo: SimPO, reference-free, on each side's
    mean log-prob per completion token."""
    simpo_gamma: float | None = Field(default=None, ge=0)
    """SimPO only: the target reward margin subtracted inside the sigmoid; None = 0.5 (TRL's CPOConfig default)."""
    precompute: bool | None = None
    """sigmoid only: read the reference log-probs the reference stage stored (reference/), never loading the
    reference model while training (None = true); false computes them every step (the policy with adapters off
    under LoRA)."""

    @model_validator(mode="after")
    def _settings_that_apply(self) -> DpoConfig:
        if self.loss == "simpo" and self.precompute is not None:
            raise ValueError("train.dpo.precompute has no effect with train.dpo.loss simpo (reference-free: there are "
                             "no reference log-probs to compute); remove precompute, or set loss: sigmoid")
        if self.loss == "sigmoid" and self.simpo_gamma is not None:
            raise ValueError("train.dpo.simpo_gamma has no effect with train.dpo.loss sigmoid; remove simpo_gamma, "
                             "or set loss: simpo")
        return self

    @property
    def gamma(self) -> float:
        """SimPO's target margin (``simpo_gamma``, 0.5 when unset)."""
        return 0.5 if self.simpo_gamma is None else self.simpo_gamma

    @property
    def uses_reference(self) -> bool:
        """Whether the loss reads a reference model's log-probs (sigmoid DPO; SimPO has none)."""
        return self.loss == "sigmoid"

    @property
    def stored_reference(self) -> bool:
        """Whether training reads the reference log-probs the reference stage stored (sigmoid, precompute not off)."""
        return self.uses_reference and self.precompute is not False


class LoraConfig(FrozenConfig):
    """Low-rank adapters through ``peft`` (``train.lora``): only the adapters train; the base weights stay frozen."""

    r: int = Field(default=8, ge=1)
    """Rank of each adapter (the inner width of B @ A)."""
    alpha: float = Field(default=16.0, gt=0)
    """Scaling numerator: the adapter's output is multiplied by alpha / r."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on each adapter's input while training (0 = none)."""
    target_modules: list[Annotated[str, Field(min_length=1)]] | Literal["all-linear"] = "all-linear"
    """Names (suffixes) of the linear layers to adapt, e.g. [q_proj, v_proj]; all-linear = every linear layer of the
    decoder blocks (peft's rule: not the output layer)."""
    export: Literal["merged", "adapter"] = "merged"
    """model/ as a plain model with the adapters merged into its weights, or as a peft adapter dir (adapter_config.json
    + adapter_model.safetensors) to load with PeftModel on the base model. Evaluation exports are always merged."""


class TrainConfig(FrozenConfig):
    mode: TrainMode = "pretrain"
    """pretrain: every token of a token shard is a target; sft: supervised fine-tuning on chat shards, only the
    tokens their loss_mask marks are targets, and a step's loss is the mean over its trained tokens; dpo: preference
    tuning on preference shards (``train.dpo``), a step's loss is the mean over its pairs."""
    dpo: DpoConfig | None = None
    """The preference loss (``train.mode: dpo`` only; filled with its defaults when the mode is dpo)."""
    lora: LoraConfig | None = None
    """Train low-rank adapters of a Hugging Face model instead of all its weights (None: full training)."""
    max_steps: int = Field(default=200, ge=1)
    """Optimizer steps to train in total."""
    steps_per_refresh: int | None = Field(default=None, ge=1)
    """On an incremental refresh, train this many more steps (capped by max_steps); None = to max_steps."""
    micro_batch_size: int = Field(default=16, ge=1)
    """Rows per forward/backward pass per process."""
    grad_accum_steps: int = Field(default=1, ge=1)
    """Micro-batches accumulated per optimizer step."""
    lr: float = Field(default=3e-3, gt=0)
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    """Cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = Field(default=20, ge=0)
    """Linear warmup steps."""
    weight_decay: float = Field(default=0.1, ge=0)
    """AdamW weight decay (not applied to norms)."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this value."""
    precision: Precision = "fp32"
    """fp32 | bf16 (autocast, fp32 master weights) | fp16 (autocast + dynamic loss scaling)."""
    loss_scale_growth_interval: int = Field(default=2000, ge=1)
    """fp16 only: successful steps after which the loss scale doubles (it halves on every overflow)."""
    checkpoint_every: int = Field(default=50, ge=1)
    """Save a checkpoint every this many steps (and at the end)."""
    keep_last: int = Field(default=2, ge=1)
    """Checkpoints kept; older ones are deleted."""
    async_checkpoint: bool = False
    """Write checkpoints in a background thread from a CPU-memory copy of the state, so training does not wait for
    the disk (costs a second copy of weights + optimizer state in CPU RAM while a save is in flight); not with
    fsdp, deepspeed_config or tensor_parallel_size > 1."""
    eval_every: int = Field(default=50, ge=1)
    """Validation every this many steps (and at step 0 and the end)."""
    eval_batches: int = Field(default=8, ge=1)
    """Micro-batches of the fixed validation subset per in-loop evaluation (a subset: the ``eval`` section scores
    the whole split after training)."""
    num_processes: int = Field(default=1, ge=1)
    """Processes ``accelerate launch`` starts (GPUs, or CPU processes over gloo)."""
    seed: Seed = 0
    """Seeds model init and data order (0 to 2**63 - 1)."""
    log_every: int = Field(default=10, ge=1)
    """Write a train_metrics row every this many steps."""
    deadline_minutes: float | None = Field(default=None, gt=0)
    """Stop a training launch that runs longer than this (the flow's retry then resumes it); None = no limit."""
    max_nonfinite_steps: int = Field(default=5, ge=1)
    """Stop with an error after this many optimizer steps in a row with a NaN/inf loss or gradient norm."""
    spike_zscore: float | None = Field(default=None, gt=0)
    """Skip a step whose loss is more than this many standard deviations above the mean of the last spike_window
    applied steps' losses (as a non-finite step is skipped); None = off. 6.0 is OLMo-core's skip-step choice."""
    spike_window: int = Field(default=128, ge=2)
    """Applied steps whose losses the spike z-score is taken over; no step is judged before this many are known."""
    max_spikes_in_a_row: int = Field(default=3, ge=1)
    """After this many spike steps in a row, roll back to the newest checkpoint and skip the batches since it."""
    log_row_losses: bool = False
    """Also write each training row's mean loss per step (metrics/row_losses/, the ``row_losses`` view): which
    documents the model finds hard, per source, over time. From the step's own logits; training is unchanged."""
    document_masking: bool = False
    """Attend only within each document of a packed row (shards' doc_starts), positions restarting per document;
    built-in model and Hugging Face models whose attention reads packed position_ids (docs/training.md). On by
    default with mode sft (conversations packed into one row must not see each other)."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in backward (less memory, ~1/3 more compute)."""
    compile: bool = False
    """torch.compile each decoder block (inductor); the first step then takes minutes on a CPU."""
    fsdp: bool = False
    """Shard parameters, gradients and optimizer state across processes (FSDP2 = ZeRO-3, Accelerate's plugin)."""
    deepspeed_config: str | None = None
    """DeepSpeed JSON config (absolute, or relative to the run dir) handed to Accelerate; GPU only, not with fsdp."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """Processes that split every attention/MLP matmul (Megatron-style TP); must divide num_processes; 1 = off."""
    peak_tflops: float | None = Field(default=None, gt=0)
    """Peak TFLOP/s of one device for MFU; None = known-GPU table, else a matmul probe on CPU."""
    profile_steps: list[Annotated[int, Field(ge=1)]] = []
    """Optimizer steps to trace with torch.profiler into metrics/profile/ (Chrome trace JSON)."""
    trackers: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = ["tensorboard"]
    """Experiment trackers that also get every metric and the recipe as config (stored under metrics/ by default)."""
    tracker_project: str = Field(default="tokenmill", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """W&B / trackio project and MLflow experiment name; the tracker run is named after the run dir."""
    tensorboard: bool | None = None
    """Older switch, kept: true adds tensorboard to trackers, false removes it; None = as trackers says."""

    @model_validator(mode="before")
    @classmethod
    def _sft_masks_documents(cls, data: object) -> object:
        """SFT and DPO pack several conversations (pair sides) into a row: each must see only itself, so masking is
        on unless refused; a dpo run gets the ``dpo`` section's defaults."""
        if not isinstance(data, dict) or data.get("mode") not in ("sft", "dpo"):
            return data
        if data.get("document_masking") is None:
            data = {**data, "document_masking": True}
        if data["mode"] == "dpo" and data.get("dpo") is None:
            data = {**data, "dpo": {}}
        return data

    @field_validator("trackers")
    @classmethod
    def _unique_trackers(cls, names: list[str]) -> list[str]:
        return list(dict.fromkeys(names))

    @model_validator(mode="before")
    @classmethod
    def _tensorboard_into_trackers(cls, data: object) -> object:
        """Fold the older ``tensorboard: true/false`` into ``trackers`` so only ``trackers`` is ever read."""
        if not (isinstance(data, dict) and isinstance(data.get("tensorboard"), bool)
                and isinstance(data.get("trackers", []), list)):
            return data  # pydantic names the bad key
        trackers = [name for name in data.get("trackers", ["tensorboard"]) if name != "tensorboard"]
        if data["tensorboard"] is True:
            trackers.insert(0, "tensorboard")
        return {**data, "trackers": trackers, "tensorboard": None}

    @field_validator("profile_steps")
    @classmethod
    def _sorted_unique(cls, steps: list[int]) -> list[int]:
        return sorted(set(steps))

    @model_validator(mode="after")
    def _one_sharding_engine(self) -> TrainConfig:
        if self.fsdp and self.deepspeed_config is not None:
            raise ValueError("train.fsdp and train.deepspeed_config both shard the model; set only one of them")
        if self.tensor_parallel_size > 1:
            check_tensor_parallel_options(self)
        if self.lora is not None:
            check_lora_options(self)
        check_dpo_options(self)
        if self.async_checkpoint:
            for key, combined in sharding_engines(self).items():
                if combined:
                    raise ValueError(f"train.async_checkpoint cannot be combined with {key} (its checkpoints are "
                                     f"written by every rank together); set async_checkpoint: false")
        return self


def sharding_engines(train: TrainConfig) -> dict[str, bool]:
    """Each setting that shards the model across ranks, by its recipe key, and whether the recipe turns it on."""
    return {"train.fsdp": train.fsdp, "train.deepspeed_config": train.deepspeed_config is not None,
            "train.tensor_parallel_size > 1": train.tensor_parallel_size > 1}


def check_lora_options(train: TrainConfig) -> None:
    """ValueError naming ``train.lora`` when it is combined with a sharding engine it does not work with."""
    for key, combined in sharding_engines(train).items():
        if combined:
            raise ValueError(f"train.lora cannot be combined with {key} (tokenmill's LoRA trains whole, data-parallel "
                             f"models only); remove {key.split(' ')[0]}, or remove train.lora for full training")


def check_dpo_options(train: TrainConfig) -> None:
    """ValueError naming the key when ``train.dpo`` / ``train.mode: dpo`` is combined with what it cannot run with."""
    if train.mode != "dpo":
        if train.dpo is not None:
            raise ValueError(f"train.dpo is set but train.mode is {train.mode}; set train.mode: dpo, or remove "
                             "train.dpo")
        return
    if not train.document_masking:
        raise ValueError("train.mode dpo needs train.document_masking (a row holds both sides of its pairs, which "
                         "must not see each other); remove document_masking: false")
    if train.tensor_parallel_size > 1:
        raise ValueError("train.mode dpo cannot be combined with train.tensor_parallel_size > 1 (not supported by "
                         "tokenmill's preference loss); set tensor_parallel_size: 1 (use train.fsdp to shard)")
    if train.log_row_losses:
        raise ValueError("train.log_row_losses has no rows to log with train.mode dpo (its loss is per pair: the "
                         "per-pair rewards are in train_metrics); remove log_row_losses")
    assert train.dpo is not None  # filled in by _sft_masks_documents
    if train.dpo.uses_reference and not train.dpo.stored_reference and train.lora is None:
        for key, combined in sharding_engines(train).items():
            if combined:
                raise ValueError(f"train.dpo.precompute false cannot be combined with {key} (the on-the-fly reference "
                                 "is a whole second model in every process); set train.dpo.precompute: true")


def check_tensor_parallel_options(train: TrainConfig) -> None:
    """ValueError naming ``train.tensor_parallel_size`` when it cannot run with the other train settings."""
    tp = train.tensor_parallel_size
    if train.num_processes % tp:
        raise ValueError(f"train.tensor_parallel_size {tp} must divide train.num_processes {train.num_processes} "
                         f"(data-parallel replicas = num_processes / tensor_parallel_size); set num_processes to a "
                         f"multiple of {tp}")
    refusals = {"train.fsdp": (train.fsdp, "remove train.fsdp"),
                "train.deepspeed_config": (train.deepspeed_config is not None, "remove train.deepspeed_config"),
                "train.precision fp16": (train.precision == "fp16", "use train.precision: bf16 or fp32")}
    for key, (combined, fix) in refusals.items():
        if combined:
            raise ValueError(f"train.tensor_parallel_size {tp} cannot be combined with {key} (not supported by "
                             f"tokenmill's tensor parallelism); set tensor_parallel_size: 1 or {fix}")


def check_tensor_parallel_dims(dims: ModelDims, tensor_parallel_size: int) -> None:
    """ValueError naming ``train.tensor_parallel_size`` unless it divides the heads and the MLP width."""
    sizes = {"model num_heads": dims.num_heads, "model num_kv_heads": dims.num_kv_heads,
             "model intermediate_size": dims.intermediate_size}
    for name, size in sizes.items():
        if size % tensor_parallel_size:
            raise ValueError(f"train.tensor_parallel_size {tensor_parallel_size} must divide the {name} ({size}): "
                             "each process holds whole heads and an equal slice of the MLP; choose a divisor "
                             f"of {dims.num_heads}, {dims.num_kv_heads} and {dims.intermediate_size}")


TASK_NAME_PATTERN = TASK_FILE_NAME.pattern  # a task name becomes a file name in eval/


class EvalConfig(FrozenConfig):
    """The full evaluation after training (``eval`` section; ``tokenmill eval RUN_DIR`` runs it on demand)."""

    enabled: bool = True
    """Evaluate after training: the whole val split, per source, and ``tasks``; each result cached by fingerprint."""
    checkpoints: Literal["last", "all"] = "last"
    """Which kept checkpoints to evaluate: the newest, or every one in ``checkpoints/``."""
    tasks: list[Annotated[str, Field(pattern=TASK_NAME_PATTERN)]] = []
    """lm-evaluation-harness task names (local data only), and/or ``tokenmill_next_line``, the built-in task."""
    include: list[str] = []
    """Folders of local lm-eval task YAMLs (``--include_path``), relative to the recipe's folder."""
    next_line_items: int = Field(default=200, ge=4)
    """Items of the built-in ``tokenmill_next_line`` task, drawn from the run's validation documents."""
    next_line_choices: int = Field(default=4, ge=2, le=10)
    """Choices per built-in item (one true next line): chance accuracy is 1 / this."""
    batch_size: int = Field(default=8, ge=1)
    """lm-eval's batch size for downstream tasks."""
    limit: int | None = Field(default=None, ge=1)
    """Evaluate at most this many documents per downstream task (None: all)."""
