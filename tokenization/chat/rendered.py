"""What the SFT and preference data stages share: kept documents of one kind of source -> shards rendered by the
model's template, one unit per (split, source), with the records it cannot train on in a rejects file.

:class:`RenderedDataStage` owns everything but the rendering itself: which sources (``records: chat`` or
``records: preference`` in the manifests), the units, the inputs (the settings, the template files by sha256, the
files naming removed documents, every document part's fingerprint), the outputs (the unit's ``state.json`` and its
rejects file), what changed since the marker (a state or shard edited), reading the unit's documents, and writing
the shards, the rejects and the state (the pack stage's shape plus the template text). A subclass renders, masks and
packs in :meth:`RenderedDataStage.run`. Torch-free and transformers-free at import (``tokenmill status`` builds
every stage).
"""

from __future__ import annotations

import dataclasses
import json
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from core.conversations import Rejection
from core.documents import document_part_files, iter_documents
from core.files.atomic import read_json, sha256_file
from core.layout import CHAT_TEMPLATE_FILE, TOKENIZER_FILE, pack_unit, pack_unit_pair
from core.rundir import RunPaths
from core.schemas import REJECTS_SCHEMA
from core.shards.chat import ChatRows, write_chat_shard
from core.shards.check import shard_intact
from core.shards.store import ShardInfo, ShardRows, shard_relpath
from core.stage import Inputs, Progress, Stage
from tokenization.chat.config import ChatConfig
from tokenization.stage import part_fingerprints

if TYPE_CHECKING:
    from tokenization.chat.template import ChatTemplate

T = TypeVar("T")

TEMPLATE_FILES = (TOKENIZER_FILE, "tokenizer_config.json", CHAT_TEMPLATE_FILE, "special_tokens_map.json")
"""The model dir's files that decide how a record renders (the tokenizer and its template)."""
SPLITS = ("train", "val")
DOCUMENT_COLUMNS = ["doc_id", "source_id", "uri", "record"]
PROGRESS_EVERY = 256
"""Records between two progress reports."""


@dataclass(frozen=True)
class RenderedDataConfig:
    """What a rendering stage renders with: the model dir whose tokenizer and template render, the recipe's
    ``chat:`` section, its template file resolved, and ``pack.seq_len`` / ``pack.rows_per_shard``."""

    model_dir: Path
    chat: ChatConfig = dataclasses.field(default_factory=ChatConfig)
    template_file: Path | None = None
    """``chat.template_file`` taken from the recipe's folder, or None: the model's own template."""
    seq_len: int = 256
    rows_per_shard: int = 4096


@dataclass(frozen=True)
class ChatReject:
    """One kept document that is not trained on: which, why, and its record (a fixed one can be re-read)."""

    source_id: str | None
    uri: str
    code: str
    detail: str
    record: str


class RenderedDataStage(Stage):
    """Kept documents of the sources whose ``records`` is :attr:`records` -> chat shards and rejects; a unit per
    (split, source), as pack. Subclasses set ``name``, ``records``, ``state_kind``, ``state_version`` and write
    :meth:`rejects_path` and :meth:`run`."""

    reads = ("ingest", "dedupe", "decontaminate", "base-model")
    records: ClassVar[str]
    """The manifest sources' ``records`` value this stage renders (``chat``, ``preference``)."""
    state_kind: ClassVar[str]
    """``state.json``'s ``kind``: which stage wrote a (split, source) folder's shards."""
    state_version: ClassVar[int]
    """Bumped when the same inputs give other shards or another state.json."""

    def __init__(self, paths: RunPaths, config: RenderedDataConfig, sources: list[str]) -> None:
        super().__init__(paths)
        self.config, self.sources = config, list(sources)

    @classmethod
    def build(cls, run: Any) -> RenderedDataStage | None:
        """The recipe's sources with ``records:`` :attr:`records` and its ``chat:`` section, rendered by the run's
        ``base_model/``; None when no manifest source has them."""
        sources = sources_with_records(run, cls.records)
        if not sources:
            return None
        chat = run.recipe.chat or ChatConfig()
        template_file = None if chat.template_file is None else (Path(run.base) / chat.template_file).resolve()
        config = RenderedDataConfig(run.paths.base_model, chat, template_file, run.recipe.pack.seq_len,
                                    run.recipe.pack.rows_per_shard)
        return cls(run.paths, config, sources)

    def units(self) -> list[str]:
        return [pack_unit(split, source) for split in SPLITS for source in self.sources]

    def label(self, unit: str | None) -> str:
        split, source = pack_unit_pair(str(unit))
        return f"{self.name} {split}/{source}"

    def settings(self) -> dict[str, Any]:
        """The ``chat:`` settings this stage reads (all but the template file, which is an input file)."""
        return self.config.chat.model_dump(mode="json", exclude={"template_file"})

    def inputs(self, unit: str | None) -> Inputs:
        """The settings, the template files by sha256 (``missing`` when absent), the files naming removed documents
        and every document part's fingerprint (cheap: marker reads); nothing here needs the run to exist."""
        config = self.config
        template_files = [Path(config.model_dir) / name for name in TEMPLATE_FILES]
        files = {f"template:{path.name}": digest(path) for path in template_files}
        if config.template_file is not None:
            # keyed by its name: the marker holds no absolute path (a copied run dir must still read as done)
            files[f"template_file:{Path(config.template_file).name}"] = digest(config.template_file)
        # the files naming the documents dedupe and decontamination removed (a unit reads only the others)
        files.update({self.paths.key(path): digest(path) for path in (self.paths.duplicates, self.paths.contaminated)})
        settings = {**self.settings(), "seq_len": config.seq_len, "rows_per_shard": config.rows_per_shard}
        upstream = {f"ingest/{Path(name).stem}": value
                    for name, value in part_fingerprints(self.paths, document_part_files(self.paths)).items()}
        return Inputs(settings=settings, files=files, upstream=upstream, version=str(self.state_version))

    @abstractmethod
    def rejects_path(self, split: str, source: str) -> Path:
        """Where the unit's rejects go (rows of REJECTS_SCHEMA)."""

    def outputs(self, unit: str | None) -> list[Path]:
        split, source = pack_unit_pair(str(unit))
        return [self.paths.pack_state(split, source), self.rejects_path(split, source)]

    def changed_since(self, unit: str | None, recorded: dict[str, Any]) -> list[Path]:
        """A state that is not the marker's, or shards missing or changed since they were written."""
        state_path = self.paths.pack_state(*pack_unit_pair(str(unit)))
        state = read_json(state_path)
        if state.get("summary") != recorded["summary"]:
            return [state_path]
        infos = [ShardInfo(**info) for info in state["shards"]]
        return [self.paths.root / info.path for info in infos if not shard_intact(self.paths.root, info)]

    def documents(self, split: str, source: str) -> Iterator[tuple[int, str | None, str, str]]:
        """``(doc_id, source_id, uri, record)`` of the unit's kept documents, in documents order."""
        for batch in iter_documents(self.paths, split=split, source=source, columns=DOCUMENT_COLUMNS):
            yield from zip(*(batch.column(name).to_pylist() for name in DOCUMENT_COLUMNS), strict=True)

    def render_documents(self, split: str, source: str, render: Callable[[str], T | Rejection],
                         on_progress: Progress) -> tuple[list[tuple[int, T]], list[ChatReject]]:
        """Each kept document's ``record`` through ``render``: ``(doc_id, what it gave)`` kept, in documents order,
        or the rejection as a :class:`ChatReject`; progress every :data:`PROGRESS_EVERY` records."""
        kept: list[tuple[int, T]] = []
        rejects: list[ChatReject] = []
        for number, (doc_id, source_id, uri, record) in enumerate(self.documents(split, source), start=1):
            rendered = render(record)
            if isinstance(rendered, Rejection):
                rejects.append(ChatReject(source_id, uri, rendered.code, rendered.reason, record))
            else:
                kept.append((doc_id, rendered))
            if number % PROGRESS_EVERY == 0:
                on_progress(number, None, {"rejects": len(rejects)})
        return kept, rejects

    def write_unit(self, split: str, source: str, template: ChatTemplate, rows: ChatRows, rejects: list[ChatReject],
                   counts: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        """Shards (replacing the folder's old ones), then rejects, then state.json (what :meth:`changed_since`
        checks); returns the summary: ``counts`` first, then rows, shards, tokens, loss tokens and rejects by
        reason. ``state``: the keys the state adds to the pack stage's shape (the template text among them)."""
        folder = self.paths.shard_folder(split, source)
        if folder.exists():  # a previous run's shards: none of them may outlive this run's state
            self.paths.remove_folder(folder)
        vocab_size = len(template.tokenizer)
        tokenizer_sha256 = digest(Path(self.config.model_dir) / TOKENIZER_FILE)
        records = None if self.records == "chat" else self.records
        infos = write_shards(self.paths, split, source, rows, self.config.rows_per_shard, tokenizer_sha256,
                             vocab_size, records)
        write_rejects(self.paths, self.rejects_path(split, source), source, rejects)
        summary = {**counts, "num_rows": len(rows), "num_shards": len(infos),
                   "num_tokens": int(sum(info.num_tokens for info in infos)),
                   "num_loss_tokens": int(rows.loss_mask.sum()), "num_rejects": len(rejects),
                   "rejects_by_reason": dict(sorted(Counter(reject.code for reject in rejects).items()))}
        self.paths.write_json(self.paths.pack_state(split, source), {
            "version": self.state_version, "kind": self.state_kind, "split": split, "source": source,
            "tokenizer_sha256": tokenizer_sha256, "seq_len": self.config.seq_len, "vocab_size": vocab_size,
            "shards": [dataclasses.asdict(info) for info in infos], "summary": summary, **state})
        return summary


def sources_with_records(run: Any, records: str) -> list[str]:
    """Names of the run's manifest sources with ``records:`` ``records`` (from the recipe's manifests, or, for a run
    read from its run.yaml, the manifests it recorded)."""
    manifests = [item.manifest for item in run.manifests]
    if not manifests and run.record is not None:
        manifests = run.record.manifests or []
    return [source.name for manifest in manifests for source in manifest.sources if source.records == records]


def parsed_record(record: str | None, parse: Callable[[Any], T]) -> T | Rejection:
    """A document's ``record`` read by ``parse`` (the chat or the preference parser); a record that is not JSON
    (written by hand into docs/) is a ``bad_record`` rejection."""
    try:
        value = json.loads(record or "null")
    except (ValueError, RecursionError):
        return Rejection("the document's record is not valid JSON", "bad_record")
    return parse(value)


def write_rejects(paths: RunPaths, target: Path, source: str, rejects: list[ChatReject]) -> None:
    """The rejects as one Parquet file of REJECTS_SCHEMA (written even when empty: it replaces an older run's)."""
    rows = [{"source": source, "source_id": reject.source_id, "uri": reject.uri, "reason": reject.code,
             "detail": reject.detail, "raw": reject.record.encode("utf-8"), "text": None} for reject in rejects]
    table = pa.Table.from_pylist(rows, schema=REJECTS_SCHEMA)
    with paths.atomic_write(target) as tmp:
        pq.write_table(table, tmp)


def write_shards(paths: RunPaths, split: str, source: str, chat: ChatRows, rows_per_shard: int,
                 tokenizer_sha256: str, vocab_size: int, records: str | None = None) -> list[ShardInfo]:
    """``chat`` (ChatRows) cut into shards of ``rows_per_shard`` rows, each written atomically; ``records``: the
    shards' schema metadata ``records`` (``preference``), None for conversations."""
    infos = []
    for part, start in enumerate(range(0, len(chat), rows_per_shard)):
        end = start + rows_per_shard
        rows = chat.rows
        piece = ChatRows(ShardRows(rows.input_ids[start:end], rows.doc_ids[start:end], rows.doc_starts[start:end],
                                   rows.first_doc_offset[start:end], rows.num_tokens[start:end]),
                         chat.loss_mask[start:end])
        infos.append(write_chat_shard(paths.root, shard_relpath(split, source, part), piece, split=split,
                                      source=source, tokenizer_sha256=tokenizer_sha256, vocab_size=vocab_size,
                                      records=records))
    return infos


def pad_id(tokenizer: Any) -> int:
    """The tokenizer's pad token, else its EOS, else 0: padding carries no loss and no attention either way."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0


def digest(path: Path) -> str:
    """The file's sha256, or ``missing``."""
    path = Path(path)
    return sha256_file(path) if path.is_file() else "missing"
