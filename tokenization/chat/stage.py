"""SFT data stage: conversation files of one split -> packed chat shards under ``sft/split=<split>/``.

Every record is parsed (:mod:`.records`), rendered and masked by the model's own template (:mod:`.masks`), and
packed whole (:mod:`.pack`) into chat shards (:mod:`core.shards.chat`); every record that cannot be trained on goes
to ``rejects/sft-<split>.parquet`` (REJECTS_SCHEMA: ``reason`` its class, ``detail`` the sentence, ``raw`` the line),
so nothing is lost silently and a bad record never stops the run. ``doc_ids`` in the shards are record numbers:
the n-th non-blank line of the split's files, in the order given (rejects' ``source_id`` counts the same way).

``state.json`` is written after the shards and rejects, the marker after it (:func:`core.stage.run_stage`). The
fingerprint holds the chat files' and the template files' sha256, so an edited file or template re-runs the split.
Prefect-free and torch-free at import: the chat modules (transformers) are imported inside :meth:`run`.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from core.errors import ConfigError
from core.files.atomic import read_json, sha256_file
from core.layout import TOKENIZER_FILE
from core.rundir import RunPaths
from core.schemas import REJECTS_SCHEMA
from core.shards.chat import ChatRows, write_chat_shard
from core.shards.check import shard_intact
from core.shards.store import ShardInfo, ShardRows, token_dtype_for_vocab
from core.stage import Inputs, Progress, Stage
from tokenization.chat.records import Rejection, parse_record

if TYPE_CHECKING:
    from tokenization.chat.masks import LossMode, MaskedConversation, Truncation
    from tokenization.chat.template import ChatTemplate

STATE_VERSION = 1
"""Bumped when the same inputs give other shards or another state.json."""
TEMPLATE_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
"""The model dir's files that decide how a conversation renders (the tokenizer and its template)."""
SPLITS = ("train", "val")
CHAT_SOURCE = "chat"
"""The ``source`` of every chat shard (its metadata and ShardInfo); a reject's source is its chat file's name."""
PROGRESS_EVERY = 256
"""Records between two progress reports."""


@dataclass(frozen=True)
class SftDataConfig:
    """What the stage reads and how it masks: the chat files per split and the model dir whose template renders."""

    model_dir: Path
    train_files: tuple[Path, ...]
    val_files: tuple[Path, ...] = ()
    seq_len: int = 2048
    loss: LossMode = "assistant"
    truncation: Truncation = "error"
    template_file: Path | None = None
    """A Jinja file to render with instead of the model's own template (for a base model that has none)."""
    rows_per_shard: int = 1024
    packed: bool = True

    def files(self, split: str) -> tuple[Path, ...]:
        return self.train_files if split == "train" else self.val_files


@dataclass(frozen=True)
class ChatReject:
    """One record that is not trained on: where it is, why, and its bytes (a fixed record can be re-read)."""

    file: Path
    record: int
    line: int
    code: str
    detail: str
    raw: bytes


class SftDataStage(Stage):
    """Conversation files -> ``sft/split=<split>/`` chat shards, ``rejects/sft-<split>.parquet``; a unit per split."""

    name = "sft_data"
    progress_unit = "records"

    def __init__(self, paths: RunPaths, config: SftDataConfig) -> None:
        super().__init__(paths)
        self.config = config

    @classmethod
    def build(cls, run: Any) -> SftDataStage | None:
        """The recipe's ``sft`` section (an :class:`SftDataConfig`), or None: no recipe section exists yet."""
        config = getattr(run.recipe, "sft", None)
        return None if config is None else cls(run.paths, config)

    def units(self) -> list[str]:
        return [split for split in SPLITS if self.config.files(split)]

    def inputs(self, unit: str | None) -> Inputs:
        """The split's chat files and the template files by sha256 (``missing`` when absent), and the settings."""
        config = self.config
        files = {f"chat:{path}": _digest(path) for path in config.files(str(unit))}
        template_files = [Path(config.model_dir) / name for name in TEMPLATE_FILES]
        if config.template_file is not None:
            template_files.append(Path(config.template_file))
        files.update({f"template:{path}": _digest(path) for path in template_files})
        settings = {"seq_len": config.seq_len, "loss": config.loss, "truncation": config.truncation,
                    "rows_per_shard": config.rows_per_shard, "packed": config.packed}
        return Inputs(settings=settings, files=files, version=str(STATE_VERSION))

    def outputs(self, unit: str | None) -> list[Path]:
        return [self.paths.sft_state(str(unit)), self.paths.sft_rejects(str(unit))]

    def changed_since(self, unit: str | None, recorded: dict[str, Any]) -> list[Path]:
        """A state that is not the marker's, or shards missing or changed since they were written."""
        state_path = self.paths.sft_state(str(unit))
        state = read_json(state_path)
        if state.get("summary") != recorded["summary"]:
            return [state_path]
        infos = [ShardInfo(**info) for info in state["shards"]]
        return [self.paths.root / info.path for info in infos if not shard_intact(self.paths.root, info)]

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        # masks and template import transformers: here, not at module level (tokenmill status imports every stage)
        from tokenization.chat.masks import mask_conversation  # (transformers)
        from tokenization.chat.template import load_chat_template  # (transformers)

        split, config = str(unit), self.config
        template = load_chat_template(Path(config.model_dir), config.template_file)
        kept: list[tuple[int, MaskedConversation]] = []
        rejects: list[ChatReject] = []
        for number, (path, line_no, raw, record) in enumerate(read_records(config.files(split))):
            if isinstance(record, ChatReject):
                rejects.append(dataclasses.replace(record, record=number))
                continue
            parsed = parse_record(record)
            if not isinstance(parsed, Rejection):
                parsed = mask_conversation(template, parsed, config.loss, config.seq_len, config.truncation)
            if isinstance(parsed, Rejection):
                rejects.append(ChatReject(path, number, line_no, parsed.code, parsed.reason, raw))
            else:
                kept.append((number, parsed))
            if (number + 1) % PROGRESS_EVERY == 0:
                on_progress(number + 1, None, {"rejects": len(rejects)})
        return self._write(split, template, kept, rejects)

    def _write(self, split: str, template: ChatTemplate, kept: list[tuple[int, MaskedConversation]],
               rejects: list[ChatReject]) -> dict[str, Any]:
        """Shards, then rejects, then state.json (what :meth:`changed_since` checks); returns the summary."""
        from tokenization.chat.pack import pack_conversations  # imports transformers (see run)

        folder = self.paths.sft_folder(split)
        if folder.exists():  # a previous run's shards: none of them may outlive this run's state
            self.paths.remove_folder(folder)
        vocab_size = len(template.tokenizer)
        chat = pack_conversations(kept, self.config.seq_len, _pad_id(template.tokenizer),
                                  token_dtype_for_vocab(vocab_size), packed=self.config.packed)
        infos = _write_shards(self.paths, split, chat, self.config.rows_per_shard,
                              _digest(Path(self.config.model_dir) / TOKENIZER_FILE), vocab_size)
        write_rejects(self.paths, self.paths.sft_rejects(split), rejects)
        summary = {"num_conversations": len(kept), "num_rows": len(chat), "num_shards": len(infos),
                   "num_tokens": int(sum(info.num_tokens for info in infos)),
                   "num_loss_tokens": int(chat.loss_mask.sum()), "num_rejects": len(rejects),
                   "rejects_by_reason": dict(sorted(Counter(reject.code for reject in rejects).items()))}
        self.paths.write_json(self.paths.sft_state(split), {
            "version": STATE_VERSION, "split": split, "seq_len": self.config.seq_len,
            "shards": [dataclasses.asdict(info) for info in infos], "summary": summary})
        return summary


def read_records(files: tuple[Path, ...]) -> Iterator[tuple[Path, int, bytes, Any]]:
    """``(file, line number, line bytes, JSON value or ChatReject)`` for every non-blank line of the jsonl
    (optionally .gz) ``files`` in order; a line that is not UTF-8 JSON is a reject, a file that cannot be
    read is one ConfigError line naming it."""
    for path in map(Path, files):
        opener = gzip.open if path.suffix == ".gz" else open
        try:
            with opener(path, "rb") as lines:
                for line_no, raw in enumerate(lines, start=1):
                    raw = raw.rstrip(b"\r\n")
                    if raw.strip():
                        yield path, line_no, raw, _json(path, line_no, raw)
        except (OSError, EOFError) as err:
            raise ConfigError(f"{path}: cannot read the chat file ({err.__class__.__name__}: {err}); name a "
                              "readable jsonl file of conversation records") from None


def _json(path: Path, line_no: int, raw: bytes) -> Any:
    """The line's JSON value, or the ChatReject saying why not (its record number is set by the caller)."""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        return ChatReject(path, -1, line_no, "invalid_utf8", f"byte {err.start}: {err.reason}", raw)
    except json.JSONDecodeError as err:
        return ChatReject(path, -1, line_no, "invalid_json", f"not valid JSON: {err.msg} (column {err.colno})", raw)


def write_rejects(paths: RunPaths, target: Path, rejects: list[ChatReject]) -> None:
    """The rejects as one Parquet file of REJECTS_SCHEMA (written even when empty: it replaces an older run's)."""
    rows = [{"source": reject.file.name, "source_id": str(reject.record), "uri": f"{reject.file}:{reject.line}",
             "reason": reject.code, "detail": reject.detail, "raw": reject.raw, "text": None} for reject in rejects]
    table = pa.Table.from_pylist(rows, schema=REJECTS_SCHEMA)
    with paths.atomic_write(target) as tmp:
        pq.write_table(table, tmp)


def _write_shards(paths: RunPaths, split: str, chat: ChatRows, rows_per_shard: int, tokenizer_sha256: str,
                  vocab_size: int) -> list[ShardInfo]:
    """``chat`` (ChatRows) cut into shards of ``rows_per_shard`` rows, each written atomically."""
    infos = []
    for part, start in enumerate(range(0, len(chat), rows_per_shard)):
        end = start + rows_per_shard
        rows = chat.rows
        piece = ChatRows(ShardRows(rows.input_ids[start:end], rows.doc_ids[start:end], rows.doc_starts[start:end],
                                   rows.first_doc_offset[start:end], rows.num_tokens[start:end]),
                         chat.loss_mask[start:end])
        infos.append(write_chat_shard(paths.root, paths.key(paths.sft_shard(split, part)), piece, split=split,
                                      source=CHAT_SOURCE, tokenizer_sha256=tokenizer_sha256,
                                      vocab_size=vocab_size))
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
