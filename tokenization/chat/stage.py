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
over the whole unit, so an appended part would move them anyway. What it shares with the preference data stage (units,
inputs, outputs, writing) is :class:`tokenization.chat.rendered.RenderedDataStage`. Prefect-free and torch-free at
import: the chat modules (transformers) are imported inside :meth:`SftDataStage.run`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.conversations import Rejection, parse_record
from core.files.atomic import read_json
from core.layout import PACK_STATE_FILES, pack_unit_pair
from core.rundir import RunPaths
from core.shards.store import token_dtype_for_vocab
from core.stage import Progress
from tokenization.chat.rendered import (
    ChatReject,
    RenderedDataConfig,
    RenderedDataStage,
    pad_id,
    parsed_record,
    sources_with_records,
)

if TYPE_CHECKING:
    from tokenization.chat.masks import MaskedConversation
    from tokenization.chat.template import ChatTemplate

STATE_VERSION = 2
"""Bumped when the same inputs give other shards or another state.json (2: shards under ``shards/``, from the
documents of a chat source)."""

SftDataConfig = RenderedDataConfig
"""What the stage renders with (the model dir, the recipe's ``chat:`` section, ``pack.seq_len``, rows per shard)."""


class SftDataStage(RenderedDataStage):
    """Kept documents of the chat sources -> chat shards and rejects; a unit per (split, chat source), as pack."""

    name = "sft_data"
    records = "chat"
    state_kind = "chat"
    state_version = STATE_VERSION
    progress_unit = "conversations"

    def rejects_path(self, split: str, source: str) -> Path:
        return self.paths.sft_rejects(split, source)

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        # masks and template import transformers: here, not at module level (tokenmill status imports every stage)
        from tokenization.chat.masks import mask_conversation  # (transformers)
        from tokenization.chat.template import load_chat_template  # (transformers)

        split, source = pack_unit_pair(str(unit))
        config = self.config
        template = load_chat_template(Path(config.model_dir), config.template_file)

        def render(record: str) -> MaskedConversation | Rejection:
            parsed = parsed_record(record, parse_record)
            if isinstance(parsed, Rejection):
                return parsed
            return mask_conversation(template, parsed, config.chat.loss, config.seq_len, config.chat.truncation)

        kept, rejects = self.render_documents(split, source, render, on_progress)
        return self._write(split, source, template, kept, rejects)

    def _write(self, split: str, source: str, template: ChatTemplate, kept: list[tuple[int, MaskedConversation]],
               rejects: list[ChatReject]) -> dict[str, Any]:
        from tokenization.chat.pack import pack_conversations  # imports transformers (see run)

        chat = pack_conversations(kept, self.config.seq_len, pad_id(template.tokenizer),
                                  token_dtype_for_vocab(len(template.tokenizer)), packed=self.config.chat.packed)
        return self.write_unit(split, source, template, chat, rejects, {"num_conversations": len(kept)},
                               {"chat_template": template.text, "loss": self.config.chat.loss})


def chat_sources(run: Any) -> list[str]:
    """Names of the run's manifest sources with ``records: chat``."""
    return sources_with_records(run, "chat")


def read_chat_template(paths: RunPaths) -> str | None:
    """The template the run's chat or preference shards were rendered with (every such state records the same
    one), or None for a run without them: what the exported model's tokenizer must carry."""
    for state_path in sorted(paths.shards.glob(PACK_STATE_FILES)):
        state = read_json(state_path)
        if state.get("kind") in ("chat", "preference"):
            return str(state["chat_template"])
    return None
