"""Typed, frozen settings for the data stages (the ``data`` and ``dedupe`` sections of a recipe)."""

from __future__ import annotations

from pydantic import Field

from core.config import FrozenConfig


class DataConfig(FrozenConfig):
    manifests: list[str] = Field(min_length=1)
    """Corpus manifest paths, relative to the recipe's folder (or absolute)."""
    val_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    """Share of documents (by content hash) that go to the validation split."""
    part_size_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    """Small input files are grouped into ingest parts of about this many bytes (one task each)."""


class NearDedupeConfig(FrozenConfig):
    enabled: bool = True
    """Remove near-duplicates (MinHash + LSH) after exact dedupe."""
    threshold: float = Field(default=0.8, gt=0.0, le=1.0)
    """Estimated Jaccard similarity of shingle sets at or above which two documents are duplicates."""
    num_perm: int = Field(default=128, ge=16, le=1024)
    """MinHash permutations (signature length)."""
    ngram: int = Field(default=5, ge=1, le=32)
    """Shingle size in words."""
    exact_verify_margin: float = Field(default=0.1, ge=0.0, le=1.0)
    """Candidate pairs whose MinHash estimate is within this of the threshold are decided by exact shingle
    Jaccard (re-reading their texts); 0 decides by the estimate alone."""


class DecontaminateConfig(FrozenConfig):
    enabled: bool = False
    """Also drop train documents sharing a long word n-gram with the val split (``against_val``) or an eval file
    (``eval_files``), after dedupe. The items of the ``eval.tasks`` are always checked, whatever this says: the
    summary counts them as ``eval_tasks``, apart from this optional check."""
    ngram: int = Field(default=13, ge=3, le=32)
    """N-gram length in words (lower-cased, whitespace-separated); 13 as in the GPT-3 contamination study."""
    against_val: bool = True
    """Check train documents against this run's own validation split."""
    eval_files: list[str] = []
    """Eval files, relative to the recipe's folder: ``.jsonl[.gz|.zst]`` (a text per line) or text (one per file)."""
    eval_text_field: str = "text"
    """Field holding the text in jsonl evaluation files."""
    max_ngram_train_docs: int | None = Field(default=None, ge=1)
    """An n-gram found in more train documents than this is boilerplate (licence header, template) and
    alone does not contaminate; None: every shared n-gram counts."""


class DedupeConfig(FrozenConfig):
    exact: bool = True
    """Remove documents whose normalised text was already seen (in this or an earlier run)."""
    near: NearDedupeConfig = NearDedupeConfig()
    decontaminate: DecontaminateConfig = DecontaminateConfig()
    """Train/eval decontamination, run by ``pipeline.dedupe.decontaminate.decontaminate_documents`` after dedupe."""
