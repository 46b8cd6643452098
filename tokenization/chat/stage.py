"""SFT data stage: a chat source's kept documents of one split -> chat shards in ``shards/split=*/source=*/``.

A manifest source with ``records: chat`` is ingested, filtered, deduplicated and decontaminated like any other; each
of its kept documents holds its conversation (the documents' ``record`` column, :mod:`core.conversations`). Here each
is rendered and masked by the model's own template (:mod:`.masks`; the run's ``base_model/``, or the recipe's
``chat.template_file``) and packed whole (:mod:`.pack`) into chat shards (:mod:`core.shards.chat`: the token columns
plus ``loss_mask`` and ``num_loss_tokens``). A conversation that cannot be trained on (too many tokens with
``chat.truncation: error``, no token left to train on, a template that rewrites it) goes to
``rejects/sft-<split>-<source>.parquet`` with its reason, so nothing is lost silently and a bad record never stops
the run. ``doc_ids`` in the shards are the documents' own ids: lineage joins ``documents`` as for text shards.

``state.json`` beside the shards has the pack stage's shape (its ``shards`` are what
:class:`tokenization.shard_index.ShardIndexStage` lists in ``shards/index.parquet``) plus the template text it
rendered with (what the trainer writes into the exported model); it is written after the shards and rejects, the
marker after it (:func:`core.stage.run_stage`). Each unit is rewritten whole: conversations are packed best-fit
over the whole unit, so an appended part would move them anyway. Prefect-free and torch-free at import: the chat
modules (transformers) are imported inside :meth:`SftDataStage.run`.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from core.conversations import Conversation, Rejection, parse_record
from core.documents import document_part_files, iter_documents
from core.files.atomic import read_json, sha256_file
from core.layout import CHAT_TEMPLATE_FILE, PACK_STATE_FILES, TOKENIZER_FILE, pack_unit, pack_unit_pair
from core.rundir import RunPaths
from core.schemas import REJECTS_SCHEMA
from core.shards.chat import ChatRows, write_chat_shard
from core.shards.check import shard_intact
from core.shards.store import ShardInfo, ShardRows, shard_relpath, token_dtype_for_vocab
from core.stage import Inputs, Progress, Stage
from tokenization.chat.config import ChatConfig
from tokenization.stage import part_fingerprints

if TYPE_CHECKING:
    from tokenization.chat.masks import MaskedConversation
    from tokenization.chat.template import ChatTemplate

STATE_VERSION = 2
"""Bumped when the same inputs give other shards or another state.json (2: shards under ``shards/``, from the
documents of a chat source)."""
TEMPLATE_FILES = (TOKENIZER_FILE, "tokenizer_config.json", CHAT_TEMPLATE_FILE, "special_tokens_map.json")
"""The model dir's files that decide how a conversation renders (the tokenizer and its template)."""
SPLITS = ("train", "val")
DOCUMENT_COLUMNS = ["doc_id", "source_id", "uri", "record"]
PROGRESS_EVERY = 256
"""Conversations between two progress reports."""


@dataclass(frozen=True)
class SftDataConfig:
    """What the stage renders with: the model dir whose tokenizer and template render, the recipe's ``chat:``
    section, its template file resolved, and ``pack.seq_len`` / ``pack.rows_per_shard``."""

    model_dir: Path
    chat: ChatConfig = dataclasses.field(default_factory=ChatConfig)
    template_file: Path | None = None
    """``chat.template_file`` taken from the recipe's folder, or None: the model's own template."""
    seq_len: int = 256
    rows_per_shard: int = 4096


@dataclass(frozen=True)
class ChatReject:
    """One kept document that is not trained on: which, why, and its conversation (a fixed one can be re-read)."""

    source_id: str | None
    uri: str
    code: str
    detail: str
    record: str


class SftDataStage(Stage):
    """Kept documents of the chat sources -> chat shards and rejects; a unit per (split, chat source), as pack."""

    name = "sft_data"
    reads = ("ingest", "dedupe", "decontaminate", "base-model")
    progress_unit = "conversations"

    def __init__(self, paths: RunPaths, config: SftDataConfig, sources: list[str]) -> None:
        super().__init__(paths)
        self.config, self.sources = config, list(sources)

    @classmethod
    def build(cls, run: Any) -> SftDataStage | None:
        """The recipe's chat sources with its ``chat:`` section, rendered by the run's ``base_model/``; None when no
        manifest source has ``records: chat``."""
        sources = chat_sources(run)
        if not sources:
            return None
        chat = run.recipe.chat or ChatConfig()
        template_file = None if chat.template_file is None else (Path(run.base) / chat.template_file).resolve()
        config = SftDataConfig(run.paths.base_model, chat, template_file, run.recipe.pack.seq_len,
                               run.recipe.pack.rows_per_shard)
        return cls(run.paths, config, sources)

    def units(self) -> list[str]:
        return [pack_unit(split, source) for split in SPLITS for source in self.sources]

    def label(self, unit: str | None) -> str:
        split, source = pack_unit_pair(str(unit))
        return f"sft_data {split}/{source}"

    def inputs(self, unit: str | None) -> Inputs:
        """The settings, the template files by sha256 (``missing`` when absent), the files naming removed documents
        and every document part's fingerprint (cheap: marker reads); nothing here needs the run to exist."""
        config = self.config
        template_files = [Path(config.model_dir) / name for name in TEMPLATE_FILES]
        files = {f"template:{path.name}": _digest(path) for path in template_files}
        if config.template_file is not None:
            # keyed by its name: the marker holds no absolute path (a copied run dir must still read as done)
            files[f"template_file:{Path(config.template_file).name}"] = _digest(config.template_file)
        # the files naming the documents dedupe and decontamination removed (a unit reads only the others)
        files.update({self.paths.key(path): _digest(path) for path in (self.paths.duplicates, self.paths.contaminated)})
        settings = {**config.chat.model_dump(mode="json", exclude={"template_file"}), "seq_len": config.seq_len,
                    "rows_per_shard": config.rows_per_shard}
        upstream = {f"ingest/{Path(name).stem}": value
                    for name, value in part_fingerprints(self.paths, document_part_files(self.paths)).items()}
        return Inputs(settings=settings, files=files, upstream=upstream, version=str(STATE_VERSION))

    def outputs(self, unit: str | None) -> list[Path]:
        split, source = pack_unit_pair(str(unit))
        return [self.paths.pack_state(split, source), self.paths.sft_rejects(split, source)]

    def changed_since(self, unit: str | None, recorded: dict[str, Any]) -> list[Path]:
        """A state that is not the marker's, or shards missing or changed since they were written."""
        state_path = self.paths.pack_state(*pack_unit_pair(str(unit)))
        state = read_json(state_path)
        if state.get("summary") != recorded["summary"]:
            return [state_path]
        infos = [ShardInfo(**info) for info in state["shards"]]
        return [self.paths.root / info.path for info in infos if not shard_intact(self.paths.root, info)]

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        # masks and template import transformers: here, not at module level (tokenmill status imports every stage)
        from tokenization.chat.masks import mask_conversation  # (transformers)
        from tokenization.chat.template import load_chat_template  # (transformers)

        split, source = pack_unit_pair(str(unit))
        config = self.config
        template = load_chat_template(Path(config.model_dir), config.template_file)
        kept: list[tuple[int, MaskedConversation]] = []
        rejects: list[ChatReject] = []
        for number, (doc_id, source_id, uri, record) in enumerate(self._documents(split, source), start=1):
            parsed = _conversation(record)
            if not isinstance(parsed, Rejection):
                parsed = mask_conversation(template, parsed, config.chat.loss, config.seq_len, config.chat.truncation)
            if isinstance(parsed, Rejection):
                rejects.append(ChatReject(source_id, uri, parsed.code, parsed.reason, record))
            else:
                kept.append((doc_id, parsed))
            if number % PROGRESS_EVERY == 0:
                on_progress(number, None, {"rejects": len(rejects)})
        return self._write(split, source, template, kept, rejects)

    def _documents(self, split: str, source: str) -> Iterator[tuple[int, str | None, str, str]]:
        """``(doc_id, source_id, uri, record)`` of the unit's kept documents, in documents order."""
        for batch in iter_documents(self.paths, split=split, source=source, columns=DOCUMENT_COLUMNS):
            yield from zip(*(batch.column(name).to_pylist() for name in DOCUMENT_COLUMNS), strict=True)

    def _write(self, split: str, source: str, template: ChatTemplate, kept: list[tuple[int, MaskedConversation]],
               rejects: list[ChatReject]) -> dict[str, Any]:
        """Shards, then rejects, then state.json (what :meth:`changed_since` checks); returns the summary."""
        from tokenization.chat.pack import pack_conversations  # imports transformers (see run)

        folder = self.paths.shard_folder(split, source)
        if folder.exists():  # a previous run's shards: none of them may outlive this run's state
            self.paths.remove_folder(folder)
        vocab_size = len(template.tokenizer)
        tokenizer_sha256 = _digest(Path(self.config.model_dir) / TOKENIZER_FILE)
        chat = pack_conversations(kept, self.config.seq_len, _pad_id(template.tokenizer),
                                  token_dtype_for_vocab(vocab_size), packed=self.config.chat.packed)
        infos = _write_shards(self.paths, split, source, chat, self.config.rows_per_shard, tokenizer_sha256,
                              vocab_size)
        write_rejects(self.paths, self.paths.sft_rejects(split, source), source, rejects)
        summary = {"num_conversations": len(kept), "num_rows": len(chat), "num_shards": len(infos),
                   "num_tokens": int(sum(info.num_tokens for info in infos)),
                   "num_loss_tokens": int(chat.loss_mask.sum()), "num_rejects": len(rejects),
                   "rejects_by_reason": dict(sorted(Counter(reject.code for reject in rejects).items()))}
        self.paths.write_json(self.paths.pack_state(split, source), {
            "version": STATE_VERSION, "kind": "chat", "split": split, "source": source,
            "tokenizer_sha256": tokenizer_sha256, "seq_len": self.config.seq_len, "vocab_size": vocab_size,
            "shards": [dataclasses.asdict(info) for info in infos], "summary": summary,
            "chat_template": template.text, "loss": self.config.chat.loss})
        return summary


def chat_sources(run: Any) -> list[str]:
    """Names of the run's manifest sources with ``records: chat`` (from the recipe's manifests, or, for a run read
    from its run.yaml, the manifests it recorded)."""
    manifests = [item.manifest for item in run.manifests]
    if not manifests and run.record is not None:
        manifests = run.record.manifests or []
    return [source.name for manifest in manifests for source in manifest.sources if source.records == "chat"]


def read_chat_template(paths: RunPaths) -> str | None:
    """The template the SFT data stage rendered the run's chat shards with (every chat state records the same
    one), or None for a run without chat sources: what the exported model's tokenizer must carry."""
    for state_path in sorted(paths.shards.glob(PACK_STATE_FILES)):
        state = read_json(state_path)
        if state.get("kind") == "chat":
            return str(state["chat_template"])
    return None


def _conversation(record: str | None) -> Conversation | Rejection:
    """The document's conversation; a ``record`` that is not one (written by hand into docs/) is a rejection."""
    try:
        return parse_record(json.loads(record or "null"))
    except (ValueError, RecursionError):
        return Rejection("the document's record is not valid JSON", "bad_record")


def write_rejects(paths: RunPaths, target: Path, source: str, rejects: list[ChatReject]) -> None:
    """The rejects as one Parquet file of REJECTS_SCHEMA (written even when empty: it replaces an older run's)."""
    rows = [{"source": source, "source_id": reject.source_id, "uri": reject.uri, "reason": reject.code,
             "detail": reject.detail, "raw": reject.record.encode("utf-8"), "text": None} for reject in rejects]
    table = pa.Table.from_pylist(rows, schema=REJECTS_SCHEMA)
    with paths.atomic_write(target) as tmp:
        pq.write_table(table, tmp)


def _write_shards(paths: RunPaths, split: str, source: str, chat: ChatRows, rows_per_shard: int,
                  tokenizer_sha256: str, vocab_size: int) -> list[ShardInfo]:
    """``chat`` (ChatRows) cut into shards of ``rows_per_shard`` rows, each written atomically."""
    infos = []
    for part, start in enumerate(range(0, len(chat), rows_per_shard)):
        end = start + rows_per_shard
        rows = chat.rows
        piece = ChatRows(ShardRows(rows.input_ids[start:end], rows.doc_ids[start:end], rows.doc_starts[start:end],
                                   rows.first_doc_offset[start:end], rows.num_tokens[start:end]),
                         chat.loss_mask[start:end])
        infos.append(write_chat_shard(paths.root, shard_relpath(split, source, part), piece, split=split,
                                      source=source, tokenizer_sha256=tokenizer_sha256, vocab_size=vocab_size))
    return infos


def _pad_id(tokenizer: Any) -> int:
    """The tokenizer's pad token, else its EOS, else 0: padding carries no loss and no attention either way."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0


def _digest(path: Path) -> str:
    path = Path(path)
    return sha256_file(path) if path.is_file() else "missing"
