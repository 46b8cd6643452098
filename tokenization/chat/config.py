"""Settings of the SFT data stage: the recipe's ``chat:`` section (how conversations render and which tokens train)."""

from __future__ import annotations

from typing import Literal

from core.config import FrozenConfig


class ChatConfig(FrozenConfig):
    """The recipe's ``chat:`` section, read by :class:`tokenization.chat.stage.SftDataStage` for every manifest source
    with ``records: chat`` (``pack.seq_len`` and ``pack.rows_per_shard`` size its shards, as for text sources), and
    by :class:`tokenization.preference.stage.PreferenceDataStage` for ``records: preference`` (``template_file`` and
    ``truncation`` only: a pair's loss is each side's completion, and pairs are always packed whole)."""

    template_file: str | None = None
    """A Jinja chat template (relative to the recipe's folder) to render with instead of the model's own (for a base
    model that has none); its ``{% generation %}`` blocks, when it has them, mark the assistant's tokens."""
    loss: Literal["assistant", "last_assistant", "all"] = "assistant"
    """Which tokens carry loss: every assistant turn with its end-of-turn token (of the completion, for a
    prompt/completion record), only the last one, or every token."""
    truncation: Literal["error", "truncate"] = "error"
    """A conversation longer than ``pack.seq_len`` tokens: rejected (``too_many_tokens`` in rejects), or cut to its
    first ``seq_len`` tokens (rejected as ``no_loss_tokens`` if nothing trained is left). A preference pair whose two
    sides together are longer: rejected, or each side's completion cut at its end so that they fit
    (:mod:`tokenization.preference.fit`)."""
    packed: bool = True
    """Pack whole conversations into rows (best-fit decreasing; document masking keeps them apart); False: one
    conversation per row, padded (for a model whose attention cannot take the document mask)."""
