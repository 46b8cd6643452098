"""Preference data stage: a preference source's kept pairs of one split -> preference shards in
``shards/split=*/source=*/``.

A manifest source with ``records: preference`` is ingested, filtered, deduplicated and decontaminated on its prompts
(each kept pair is a document whose ``text`` is its prompt and whose ``record`` is the normalised pair,
:mod:`core.preference_pairs`). Here each pair is rendered and masked by the model's own template, as the SFT data
stage renders a conversation (:func:`tokenization.preference.masks.mask_pair`: the run's ``base_model/`` or the
recipe's ``chat.template_file``; loss on each side's completion only, whatever ``chat.loss`` says), fitted to one
row (:mod:`tokenization.preference.fit`: both sides together within ``pack.seq_len``, cut under ``chat.truncation:
truncate``), and packed whole, chosen side then rejected side under the pair's doc id
(:func:`tokenization.preference.pack.pack_pairs`), into chat shards marked ``records: preference``
(:mod:`core.shards.preference`). A pair it cannot train on goes to ``rejects/preference-<split>-<source>.parquet``
with its reason (:data:`core.preference_pairs.PREFERENCE_REJECT_REASONS`).

Units, inputs, outputs, the ``state.json`` (the pack stage's shape plus the template text, so
:class:`tokenization.shard_index.ShardIndexStage` indexes the shards) and the write order are the SFT data stage's
(:class:`tokenization.chat.rendered.RenderedDataStage`). Torch- and transformers-free at import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.conversations import Rejection
from core.layout import pack_unit_pair
from core.preference_pairs import parse_pair
from core.shards.preference import PREFERENCE_RECORDS
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
    from tokenization.chat.template import ChatTemplate
    from tokenization.preference.masks import MaskedPair

STATE_VERSION = 1
"""Bumped when the same inputs give other shards or another state.json."""

PreferenceDataConfig = RenderedDataConfig
"""What the stage renders with (the model dir, the recipe's ``chat:`` section, ``pack.seq_len``, rows per shard)."""


class PreferenceDataStage(RenderedDataStage):
    """Kept pairs of the preference sources -> preference shards and rejects; a unit per (split, preference
    source), as pack."""

    name = "preference_data"
    records = PREFERENCE_RECORDS
    state_kind = PREFERENCE_RECORDS
    state_version = STATE_VERSION
    progress_unit = "pairs"

    def settings(self) -> dict[str, Any]:
        """Only ``chat.truncation``: a pair's loss is always each side's completion, and pairs are always packed."""
        return {"truncation": self.config.chat.truncation}

    def rejects_path(self, split: str, source: str) -> Path:
        return self.paths.preference_rejects(split, source)

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        # masks and template import transformers: here, not at module level (tokenmill status imports every stage)
        from tokenization.chat.template import load_chat_template  # (transformers)

        split, source = pack_unit_pair(str(unit))
        template = load_chat_template(Path(self.config.model_dir), self.config.template_file)
        kept, rejects = self.render_documents(split, source, lambda record: self._masked(template, record),
                                              on_progress)
        return self._write(split, source, template, kept, rejects)

    def _masked(self, template: ChatTemplate, record: str) -> MaskedPair | Rejection:
        """The document's pair rendered, masked and fitted to one row, or why not."""
        from tokenization.preference.fit import fit_pair  # (transformers)
        from tokenization.preference.masks import mask_pair  # (transformers)

        pair = parsed_record(record, parse_pair)
        if isinstance(pair, Rejection):
            return pair
        masked = mask_pair(template, pair)
        if isinstance(masked, Rejection):
            return masked
        return fit_pair(masked, self.config.seq_len, self.config.chat.truncation)

    def _write(self, split: str, source: str, template: ChatTemplate, kept: list[tuple[int, MaskedPair]],
               rejects: list[ChatReject]) -> dict[str, Any]:
        from tokenization.preference.pack import pack_pairs  # imports transformers (see run)

        rows = pack_pairs(kept, self.config.seq_len, pad_id(template.tokenizer),
                          token_dtype_for_vocab(len(template.tokenizer)))
        return self.write_unit(split, source, template, rows, rejects, {"num_pairs": len(kept)},
                               {"chat_template": template.text, "records": PREFERENCE_RECORDS})


def preference_sources(run: Any) -> list[str]:
    """Names of the run's manifest sources with ``records: preference``."""
    return sources_with_records(run, PREFERENCE_RECORDS)
