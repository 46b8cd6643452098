"""The run dir's layout: the one module that spells a run's file and folder names (docs/architecture.md, "The run
directory").

Every other module asks :class:`RunLayout` (through :class:`core.rundir.RunPaths`, which adds the writes and the
lock) for a path, or :data:`RELATIVE` and :func:`run_key` for the same name relative to the run dir (a bucket key, a
file-stats entry); ``tests/test_run_dir_layout.py`` holds the rule with ``ast``. Reading only: nothing here
touches the disk, so the object-store side and the flows can use it without a local run dir.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# Names fixed by a file format, spelled here because the run dir holds folders of that format (tokenizer/,
# model/, base_model/, eval/models/step-N/, checkpoints/step-N/); the format modules import them from here.
HF_CONFIG_FILE = "config.json"
"""A Hugging Face model folder's config (``model/config.json`` is one of :attr:`RunLayout.run_dir_signs`)."""
TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""A model folder's chat template, where transformers reads it first (and the run's tokenizer folder's)."""
"""A Hugging Face ``tokenizers`` file: ``tokenizer/tokenizer.json`` and the one in every model folder."""
CHECKPOINT_MANIFEST = "manifest.json"
"""Written last into a checkpoint folder (trainer.checkpoint.layout): a folder without it is incomplete."""

# Names other modules (and tests) use on their own, beside the paths built from them.
DUPLICATES_FILE = "duplicates.parquet"
CONTAMINATED_FILE = "contaminated.parquet"
CLUSTERS_FILE = "clusters.parquet"
MINHASH_DIR = "minhash"
BANDS_DIR = "bands"
PACK_STATE_FILE = "state.json"
"""In each ``shards/split=<split>/source=<source>/``: the packed parts and shards of that (split, source)."""

SHARD_LAYOUT = "shards/split=<train|val>/source=<source name>/part-NNNNN.arrow"
"""Where shards live, as error messages show it (:meth:`RunLayout.shard` builds it)."""
SHARD_KEY = re.compile(r"shards/split=(train|val)/source=[A-Za-z0-9][A-Za-z0-9_.\-]*/part-[0-9]{5,}\.arrow")
"""The only relative paths (bucket keys) read as shards."""
SHARD_FILE_NAME = re.compile(r"part-[0-9]{5,}\.arrow")  # shard's {part:05d}: six digits past 99999
DOCS_PART_KEY = re.compile(r"docs/(part-[0-9]{5,})\.parquet")
"""A documents part's relative path (bucket key); group 1 is its unit (the ingest marker's name)."""
REJECTS_KEY = re.compile(r"rejects/[^/]+\.parquet")
"""A rejects file's relative path (bucket key): a part's or ``contaminated.parquet``."""
PART_FILES = "part-*.parquet"
"""Glob of a part's Parquet files in ``docs/``, ``attributes/``, ``rejects/``, ``dedupe/minhash|bands/``."""
REJECT_FILES = "*.parquet"
"""Glob of ``rejects/``' files (each part's, and ``contaminated.parquet``)."""
SHARD_FILES = "part-*.arrow"
"""Glob of the shards in a ``shards/split=<split>/source=<source>/`` folder."""
STEP_DIR_PATTERN = re.compile(r"^step-(\d{7})$")
"""A checkpoint folder's (or an eval result folder's) name: ``step-NNNNNNN``."""
CHECKPOINT_FOLDERS = "step-*"
EVAL_RESULT_FILES = "step-*/*.json"
PACK_STATE_FILES = f"split=*/source=*/{PACK_STATE_FILE}"
PREFERENCE_SCORES_FILE = "preference_logps.parquet"
"""In an eval result folder (``eval/results/step-N/``): a DPO run's per-pair scores under that checkpoint."""
REFERENCE_FILES = "split=*/source=*.parquet"
"""Glob under ``reference/`` of every (split, source)'s reference log-probs."""
"""Glob under ``shards/`` of every (split, source) folder's pack state."""

SYNC_STATE_SUFFIX = ".sync.json"
"""``<copy>.sync.json`` beside a bucket run's working copy (core.bucket.run_dir), never inside the run dir."""
MIRROR_STATE_SUFFIX = ".mirror.json"
"""``<mirror>.mirror.json`` beside a bucket run's read-only mirror (pipeline.sql.run_mirror): the longest suffix any
run dir's name gets (core.files.path_limits)."""
UNMIRRORED_FOLDERS = ("checkpoints/", "model/", "eval/models/")
"""Key prefixes of weights a mirror leaves out (their small JSON files are mirrored)."""
PUBLISH_TIERS = (("shards/index.parquet",), ("checkpoints/step-", f"/{CHECKPOINT_MANIFEST}"), ("checkpoints/latest",),
                 ("stages/",), ("stages/sealed/",))
"""Keys a bucket run uploads after every other output, in this order (a checkpoint manifest: prefix and suffix)."""


def part_file_name(part_id: int) -> str:
    """``part-NNNNN.parquet``: the name of a part's documents, rejects, attributes and dedupe cache files."""
    return f"part-{part_id:05d}.parquet"


def part_unit(part_id: int) -> str:
    """The part's unit name in the skip-if-done markers: ``part-NNNNN``, the stem of its Parquet files."""
    return f"part-{part_id:05d}"


def pack_unit(split: str, source: str) -> str:
    """The (split, source) unit of the pack stage's markers: ``stages/pack/split=<split>/source=<source>.json``."""
    return f"split={split}/source={source}"


def pack_unit_pair(unit: str) -> tuple[str, str]:
    """``(split, source)`` of a :func:`pack_unit` name."""
    split, source = unit.split("/", 1)
    return split.removeprefix("split="), source.removeprefix("source=")


def shard_part_number(shard: Path) -> int | None:
    """The part number of a shard matched by :data:`SHARD_FILES` (``part-00012.arrow``: 12); None if not a number."""
    number = shard.stem.removeprefix("part-")
    return int(number) if number.isdigit() else None


def checkpoint_step(folder: Path) -> int | None:
    """The step of a folder matched by :data:`CHECKPOINT_FOLDERS` (``step-0000040``: 40); None if not a number."""
    number = folder.name.removeprefix("step-")
    return int(number) if number.isdigit() else None


def step_dir_name(step: int) -> str:
    """``step-NNNNNNN`` (7 digits, so names sort by step): a checkpoint's, an eval result's, an eval export's."""
    return f"step-{step:07d}"


TASK_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
"""An evaluation task's name as a file name: letters, digits, ``_``, ``.``, ``-`` (no ``/``, no leading dot)."""


def task_file_name(task: str) -> str:
    """``task`` itself; ValueError when it could leave its folder (``../x``, ``a/b``) or is no plain name."""
    if not TASK_FILE_NAME.match(task):
        raise ValueError(f"evaluation task name {task!r}: use letters, digits, '_', '.' and '-' only")
    return task


@dataclass(frozen=True)
class RunLayout:
    """Where each file of the run dir ``root`` lives; paths only (see :class:`core.rundir.RunPaths` for writes)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))  # a str from the CLI or a flow parameter

    def key(self, path: Path) -> str:
        """``path`` relative to the run dir, ``/``-separated: its key under a bucket run's prefix."""
        return Path(path).relative_to(self.root).as_posix()

    @property
    def run_dir_signs(self) -> tuple[Path, ...]:
        """What only a run dir holds (with ``docs/part-*.parquet``): a folder with none of them is no run."""
        return (self.recipe, self.stages, self.shard_index, self.model_config, self.latest_checkpoint,
                self.train_metrics)

    @property
    def recipe(self) -> Path:
        return self.root / "run.yaml"

    @property
    def lock_file(self) -> Path:
        """``.lock``: see :meth:`core.rundir.RunPaths.lock` (and, in a bucket, core.bucket.lock's key)."""
        return self.root / ".lock"

    # ---- data: ingest, filters, dedupe ---------------------------------------------------------------------

    @property
    def docs(self) -> Path:
        return self.root / "docs"

    @property
    def ingest_plan(self) -> Path:
        """``docs/plan.json``: which source files go in which ingest part (ingest's stage state)."""
        return self.docs / "plan.json"

    def document_part(self, part_id: int) -> Path:
        """``docs/part-NNNNN.parquet``: one ingest part's kept documents."""
        return self.docs / part_file_name(part_id)

    @property
    def rejects(self) -> Path:
        return self.root / "rejects"

    def rejects_part(self, part_id: int) -> Path:
        """``rejects/part-NNNNN.parquet``: one ingest part's rejected records."""
        return self.rejects / part_file_name(part_id)

    @property
    def contaminated(self) -> Path:
        """``rejects/contaminated.parquet``: the documents decontamination removed (rows of REJECTS_SCHEMA)."""
        return self.rejects / CONTAMINATED_FILE

    @property
    def attributes(self) -> Path:
        """``attributes/part-NNNNN.parquet``: what the quality filters measured for every parsed document."""
        return self.root / "attributes"

    def attributes_part(self, part_id: int) -> Path:
        """``attributes/part-NNNNN.parquet``: one ingest part's measurements."""
        return self.attributes / part_file_name(part_id)

    def attributes_of(self, document_part: Path | str) -> Path:
        """The attributes file beside a ``docs/part-NNNNN.parquet`` (same name in ``attributes/``)."""
        return self.attributes / Path(document_part).name

    @property
    def dedupe(self) -> Path:
        return self.root / "dedupe"

    @property
    def duplicates(self) -> Path:
        """``dedupe/duplicates.parquet``: the documents dedupe removed."""
        return self.dedupe / DUPLICATES_FILE

    @property
    def clusters(self) -> Path:
        """``dedupe/clusters.parquet``: near-duplicate clusters, for inspection."""
        return self.dedupe / CLUSTERS_FILE

    @property
    def dedupe_state(self) -> Path:
        """``dedupe/state.json``: the parts dedupe has seen (and, before ``stages/``, its marker)."""
        return self.dedupe / "state.json"

    @property
    def decontaminate_state(self) -> Path:
        """``dedupe/decontaminate.json``: decontamination's state (and, before ``stages/``, its marker)."""
        return self.dedupe / "decontaminate.json"

    @property
    def minhash(self) -> Path:
        """``dedupe/minhash/part-NNNNN.parquet``: each part's MinHash signatures (a cache)."""
        return self.dedupe / MINHASH_DIR

    @property
    def bands(self) -> Path:
        """``dedupe/bands/part-NNNNN.parquet``: each part's LSH band keys (a cache)."""
        return self.dedupe / BANDS_DIR

    def near_caches(self, part_name: str) -> tuple[Path, Path]:
        """A docs part's signature and band-key caches (``part_name``: ``part-NNNNN.parquet``)."""
        return self.minhash / part_name, self.bands / part_name

    # ---- tokenizer, base model, shards ------------------------------------------------------------------

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"

    @property
    def tokenizer(self) -> Path:
        return self.tokenizer_dir / TOKENIZER_FILE

    @property
    def tokenizer_chat_template(self) -> Path:
        """``tokenizer/chat_template.jinja``: a chat template put beside the run's tokenizer (the export's fallback)."""
        return self.tokenizer_dir / CHAT_TEMPLATE_FILE

    @property
    def special_tokens(self) -> Path:
        """``tokenizer/special_tokens.json``: eos/pad/bos ids of a model's own tokenizer (see tokenization)."""
        return self.tokenizer_dir / "special_tokens.json"

    @property
    def base_model(self) -> Path:
        """``base_model/``: the Hugging Face config (and weights, for continued pretraining) the run starts from,
        hard-linked or copied in by the model stage, so the run dir needs nothing outside itself."""
        return self.root / "base_model"

    @property
    def base_model_config(self) -> Path:
        """``base_model/config.json``: the config the run starts from (its ``auto_map`` names model code)."""
        return self.base_model / HF_CONFIG_FILE

    @property
    def base_model_tokenizer(self) -> Path:
        """``base_model/tokenizer.json``: the model's own tokenizer, when it has one."""
        return self.base_model / TOKENIZER_FILE

    @property
    def shards(self) -> Path:
        return self.root / "shards"

    @property
    def shard_index(self) -> Path:
        return self.shards / "index.parquet"

    def shard_folder(self, split: str, source: str) -> Path:
        """``shards/split=<split>/source=<source>/``."""
        return self.shards / f"split={split}" / f"source={source}"

    def shard(self, split: str, source: str, part: int) -> Path:
        """``shards/split=<split>/source=<source>/part-NNNNN.arrow`` (:data:`SHARD_LAYOUT`)."""
        return self.shard_folder(split, source) / f"part-{part:05d}.arrow"

    def pack_state(self, split: str, source: str) -> Path:
        """``shards/split=<split>/source=<source>/state.json``: the packed parts and shards of (split, source)."""
        return self.shard_folder(split, source) / PACK_STATE_FILE

    # ---- supervised fine-tuning data ---------------------------------------------------------------------------

    def sft_rejects(self, split: str, source: str) -> Path:
        """``rejects/sft-<split>-<source>.parquet``: the conversations of a chat source's split that the SFT data
        stage could not render and mask (rows of REJECTS_SCHEMA; its shards are at :meth:`shard_folder`)."""
        return self.rejects / f"sft-{split}-{source}.parquet"

    # ---- preference tuning ----------------------------------------------------------------------------------

    def preference_rejects(self, split: str, source: str) -> Path:
        """``rejects/preference-<split>-<source>.parquet``: the pairs of a preference source's split that the
        preference data stage could not render, mask or fit in a row (rows of REJECTS_SCHEMA)."""
        return self.rejects / f"preference-{split}-{source}.parquet"

    @property
    def reference(self) -> Path:
        """``reference/``: the reference model's log-probs of every pair, one file per (split, source)."""
        return self.root / "reference"

    def reference_logps(self, split: str, source: str) -> Path:
        """``reference/split=<split>/source=<source>.parquet``: the reference model's summed log-probs of each pair
        of that split's preference shards of that source (trainer.preference.reference_store's schema)."""
        return self.reference / f"split={split}" / f"source={source}.parquet"

    # ---- training -------------------------------------------------------------------------------------------

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        """``checkpoints/step-NNNNNNN/``."""
        return self.checkpoints / step_dir_name(step)

    @property
    def latest_checkpoint(self) -> Path:
        """``checkpoints/latest``: ``{"step", "path"}`` of the newest complete checkpoint."""
        return self.checkpoints / "latest"

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def model_config(self) -> Path:
        """``model/config.json``: the exported model's Hugging Face config."""
        return self.model / HF_CONFIG_FILE

    @property
    def report(self) -> Path:
        return self.root / "report"

    @property
    def report_page(self) -> Path:
        """``report/index.html``."""
        return self.report / "index.html"

    @property
    def report_markdown(self) -> Path:
        """``report/report.md``."""
        return self.report / "report.md"

    def report_plot(self, name: str) -> Path:
        """``report/<plot>.png``."""
        return self.report / f"{name}.png"

    # ---- metrics ---------------------------------------------------------------------------------------------

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    @property
    def train_metrics(self) -> Path:
        """``metrics/train.jsonl``: one row per logged training step."""
        return self.metrics / "train.jsonl"

    @property
    def eval_metrics(self) -> Path:
        """``metrics/eval.jsonl``: one row per in-loop evaluation."""
        return self.metrics / "eval.jsonl"

    @property
    def train_segments(self) -> Path:
        """``metrics/train_segments.jsonl``: which rows each training segment (launch) consumed."""
        return self.metrics / "train_segments.jsonl"

    @property
    def row_losses(self) -> Path:
        """``metrics/row_losses/``: see :meth:`row_losses_file`."""
        return self.metrics / "row_losses"

    def row_losses_file(self, segment: int, rank: int) -> Path:
        """``metrics/row_losses/segment-NNNNN-rank-NNNNN.jsonl``: one rank's per-row losses in one segment."""
        return self.row_losses / f"segment-{segment:05d}-rank-{rank:05d}.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.metrics / "tensorboard"

    @property
    def wandb(self) -> Path:
        """``metrics/wandb/``: W&B's ``dir`` (offline runs in ``wandb/offline-run-*``) unless WANDB_DIR is set."""
        return self.metrics / "wandb"

    @property
    def mlflow(self) -> Path:
        """``metrics/mlflow/``: MLflow's SQLite ``mlflow.db`` and ``artifacts/`` (unless MLFLOW_TRACKING_URI is set)."""
        return self.metrics / "mlflow"

    @property
    def mlflow_store(self) -> Path:
        """``metrics/mlflow/mlflow.db``: MLflow's SQLite store."""
        return self.mlflow / "mlflow.db"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.mlflow / "artifacts"

    @property
    def trackio(self) -> Path:
        """``metrics/trackio/``: trackio's local store (``<project>.db``) unless TRACKIO_DIR is set."""
        return self.metrics / "trackio"

    @property
    def tracker_ids(self) -> Path:
        """``metrics/trackers.json``: the W&B and MLflow run ids a resumed launch continues."""
        return self.metrics / "trackers.json"

    @property
    def profile(self) -> Path:
        """``metrics/profile/``: the torch profiler's traces (``train.profile_steps``)."""
        return self.metrics / "profile"

    def profile_trace(self, step: int, rank: int) -> Path:
        """``metrics/profile/step-NNNNNNN-rank-<rank>.json``: one rank's trace of one step (Chrome trace format)."""
        return self.profile / f"{step_dir_name(step)}-rank-{rank}.json"

    @property
    def device_peak(self) -> Path:
        """``metrics/device_peak.json``: the cached matmul probe, so every resume of a run divides MFU by one peak."""
        return self.metrics / "device_peak.json"

    @property
    def stage_times(self) -> Path:
        """``metrics/stage_times.jsonl``: one row per finished stage call (its wall-clock span), for the report."""
        return self.metrics / "stage_times.jsonl"

    @property
    def versions(self) -> Path:
        """``metrics/versions.json``: tokenmill's, Python's and the key packages' versions the last stage ran with."""
        return self.metrics / "versions.json"

    @property
    def sample_generation(self) -> Path:
        """``metrics/sample_generation.json``: a sample from the exported model, made once per export (the report's)."""
        return self.metrics / "sample_generation.json"

    # ---- evaluation ------------------------------------------------------------------------------------------

    @property
    def eval(self) -> Path:
        """``eval/``: the full evaluation's task files, results and per-checkpoint exports (trainer.eval_*)."""
        return self.root / "eval"

    @property
    def eval_tasks(self) -> Path:
        """``eval/tasks/``: the built-in task as plain lm-eval YAML + JSONL (``lm_eval --include_path`` runs it)."""
        return self.eval / "tasks"

    @property
    def eval_texts(self) -> Path:
        """``eval/texts/``: every configured task's documents, one JSON text per line (decontamination reads them)."""
        return self.eval / "texts"

    def eval_text(self, task: str) -> Path:
        """``eval/texts/<task>.jsonl``: see :attr:`eval_texts`."""
        return self.eval_texts / f"{task_file_name(task)}.jsonl"

    @property
    def eval_results(self) -> Path:
        """``eval/results/``: see :meth:`eval_result`."""
        return self.eval / "results"

    def preference_scores(self, step: int) -> Path:
        """``eval/results/step-NNNNNNN/preference_logps.parquet``: the checkpoint's own summed log-probs of each
        pair (a DPO run's per-checkpoint scores; the ``preference_pairs`` view joins them to the reference's)."""
        return self.eval_results / step_dir_name(step) / PREFERENCE_SCORES_FILE

    def eval_result(self, step: int, task: str) -> Path:
        """``eval/results/step-NNNNNNN/<task>.json``: one (checkpoint, task) result, keyed by both fingerprints."""
        return self.eval_results / step_dir_name(step) / f"{task_file_name(task)}.json"

    def eval_model(self, step: int) -> Path:
        """``eval/models/step-NNNNNNN/``: a checkpoint exported as a Hugging Face folder for downstream tasks."""
        return self.eval / "models" / step_dir_name(step)

    # ---- stage markers and command seals ---------------------------------------------------------------------

    @property
    def stages(self) -> Path:
        """Stage completion markers (``<stage>.json``, ``<stage>/<unit>.json``): see :meth:`stage_marker`."""
        return self.root / "stages"

    def stage_marker(self, stage: str, unit: str | None = None) -> Path:
        """``stages/<stage>.json``, or ``stages/<stage>/<unit>.json`` for one unit of the stage."""
        return self.stages / f"{stage}.json" if unit is None else self.stages / stage / f"{unit}.json"

    @property
    def seals(self) -> Path:
        """``stages/sealed/``: what a finished command recorded to skip its flow next time (flows.up_to_date)."""
        return self.stages / "sealed"

    @property
    def launch_config(self) -> Path:
        """``stages/launch.json``: the resolved configuration (``model``, ``train``, the mixture) a launched trainer
        or evaluator reads, written by the flow before it launches one (:mod:`trainer.run_config`)."""
        return self.stages / "launch.json"

    def command_seal(self, command: str) -> Path:
        return self.seals / f"{command}.json"


RELATIVE = RunLayout(Path())
"""The layout relative to the run dir: ``run_key(RELATIVE.shard_index)`` is ``"shards/index.parquet"``, a bucket key."""


def run_key(path: Path) -> str:
    """A path of :data:`RELATIVE` as a ``/``-separated key (a bucket key, a marker's key prefix)."""
    return RELATIVE.key(path)
