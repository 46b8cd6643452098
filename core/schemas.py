"""The public data contracts of a run directory, as explicit pyarrow schemas (docs/formats.md documents each)."""

from __future__ import annotations

import pyarrow as pa

from core.preference_pairs import PREFERENCE_REJECT_REASONS

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
"""What a corpus or source name may be: it becomes a shard folder (``source=<name>``) and a column value."""

FORMAT_VERSION = 1
"""Bumped when a contract changes incompatibly; readers refuse files of another version."""

DOCUMENTS_SCHEMA = pa.schema(
    [
        pa.field("doc_id", pa.int64(), nullable=False),  # stable across re-runs: hash of (source, uri)
        pa.field("source", pa.string(), nullable=False),
        pa.field("source_id", pa.string()),  # the record's own id when the source has an id_field
        pa.field("uri", pa.string(), nullable=False),  # file:line, file#row=N or file (relative)
        pa.field("text", pa.large_string(), nullable=False),
        pa.field("num_chars", pa.int64(), nullable=False),
        pa.field("content_hash", pa.string(), nullable=False),  # exact-dedupe key (hex xxh3-128)
        pa.field("split", pa.string(), nullable=False),  # train | val
    ],
    metadata={"format_version": str(FORMAT_VERSION), "artifact": "documents"},
)

CHAT_DOCUMENTS_SCHEMA = DOCUMENTS_SCHEMA.append(pa.field("record", pa.large_string(), nullable=False))
"""The documents of a source with ``records: chat`` or ``records: preference``: DOCUMENTS_SCHEMA plus ``record``, the
conversation (:meth:`core.conversations.Conversation.normalised_json`) or the pair
(:meth:`core.preference_pairs.PreferencePair.normalised_json`) normalised, as JSON. A text source's parts keep
DOCUMENTS_SCHEMA (the ``documents`` view shows ``record`` as null for their rows when a run has both)."""


def documents_schema(chat: bool) -> pa.Schema:
    """The schema of a documents part: CHAT_DOCUMENTS_SCHEMA for a chat or preference source's (``chat``: its records
    are not text), else DOCUMENTS_SCHEMA."""
    return CHAT_DOCUMENTS_SCHEMA if chat else DOCUMENTS_SCHEMA

REJECTS_SCHEMA = pa.schema(
    [
        pa.field("source", pa.string(), nullable=False),
        pa.field("source_id", pa.string()),
        pa.field("uri", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),  # one of pipeline.filters.screen.REJECT_REASONS
        pa.field("detail", pa.string(), nullable=False),
        pa.field("raw", pa.large_binary()),  # original bytes, so a fixed record can be re-ingested
        # the normalised text a quality filter rejected (null for a broken record): a relaxed threshold brings it back
        pa.field("text", pa.large_string()),
    ],
    metadata={"format_version": str(FORMAT_VERSION), "artifact": "rejects"},
)

ATTRIBUTE_VALUE_FIELDS = (
    pa.field("num_chars", pa.int64()),  # characters of the normalised text (before C4 removes lines)
    pa.field("num_control_chars", pa.int64()),  # NUL/control characters (binary)
    pa.field("num_words", pa.int64()),  # whitespace-separated words (mean_word_length)
    pa.field("num_word_chars", pa.int64()),  # characters in those words
    pa.field("num_symbols", pa.int64()),  # non-space symbols among them (symbol_ratio)
    pa.field("duplicate_line_fraction", pa.float64()),  # share of characters in repeated lines (duplicate_lines)
    pa.field("language", pa.string()),  # fastText lid.176 code (filters.language)
    pa.field("language_score", pa.float64()),  # its probability, 0..1
    # filters.gopher_repetition: share of paragraphs / lines repeating an earlier one, and of their characters
    pa.field("gopher_repetition_dup_para_frac", pa.float64()),
    pa.field("gopher_repetition_dup_para_char_frac", pa.float64()),
    pa.field("gopher_repetition_dup_line_frac", pa.float64()),
    pa.field("gopher_repetition_dup_line_char_frac", pa.float64()),
    pa.field("gopher_repetition_top_n_gram_char_frac", pa.map_(pa.int32(), pa.float64())),  # {n: share}
    pa.field("gopher_repetition_dup_n_gram_char_frac", pa.map_(pa.int32(), pa.float64())),  # {n: share}
    # filters.gopher_quality
    pa.field("gopher_quality_num_words", pa.int64()),  # words that are not only punctuation
    pa.field("gopher_quality_mean_word_length", pa.float64()),  # null without such a word
    pa.field("gopher_quality_hashes_per_word", pa.float64()),
    pa.field("gopher_quality_ellipses_per_word", pa.float64()),
    pa.field("gopher_quality_bullet_lines_ratio", pa.float64()),
    pa.field("gopher_quality_ellipsis_lines_ratio", pa.float64()),
    pa.field("gopher_quality_alpha_words_ratio", pa.float64()),
    pa.field("gopher_quality_num_stop_words", pa.int64()),
    # filters.c4: sentences and characters in the kept lines; first line (0-based) with lorem ipsum / a curly bracket
    pa.field("c4_num_sentences", pa.int64()),
    pa.field("c4_kept_chars", pa.int64()),
    pa.field("c4_lorem_ipsum_line", pa.int64()),
    pa.field("c4_curly_bracket_line", pa.int64()),
    # filters.fineweb: non-blank lines, and its ratios (null without a non-blank line)
    pa.field("fineweb_num_lines", pa.int64()),
    pa.field("fineweb_line_punct_ratio", pa.float64()),
    pa.field("fineweb_short_line_ratio", pa.float64()),
    pa.field("fineweb_char_dup_ratio", pa.float64()),
    pa.field("fineweb_new_line_ratio", pa.float64()),
    pa.field("quality_score", pa.float64()),  # the quality classifier's probability of its label, 0..1
)
"""One nullable column per measured value of the quality filters (``pipeline.filters.screen.QUALITY_FILTERS``): null
when that filter is off, or when it was never needed: ingest stops at the first failing filter, and within a web-grade
filter at its first failing rule, so later values are not measured."""

ATTRIBUTES_SCHEMA = pa.schema(
    [
        pa.field("doc_id", pa.int64(), nullable=False),  # the documents' doc_id (kept or not): hash of (source, uri)
        pa.field("source", pa.string(), nullable=False),
        pa.field("source_id", pa.string()),
        pa.field("uri", pa.string(), nullable=False),
        pa.field("reason", pa.string()),  # the verdict: the rejects reason, null when the document is kept
        *ATTRIBUTE_VALUE_FIELDS,
    ],
    metadata={"format_version": str(FORMAT_VERSION), "artifact": "attributes"},
)

DUPLICATES_SCHEMA = pa.schema(
    [
        pa.field("doc_id", pa.int64(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("source_id", pa.string()),
        pa.field("uri", pa.string(), nullable=False),
        pa.field("duplicate_of", pa.int64(), nullable=False),  # the survivor's doc_id
        pa.field("kind", pa.string(), nullable=False),  # exact | near
        pa.field("similarity", pa.float64(), nullable=False),  # 1.0 for exact copies
    ],
    metadata={"format_version": str(FORMAT_VERSION), "artifact": "duplicates"},
)

SHARD_INDEX_SCHEMA = pa.schema(
    [
        pa.field("path", pa.string(), nullable=False),  # relative to the run dir
        pa.field("split", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("num_rows", pa.int64(), nullable=False),
        pa.field("num_tokens", pa.int64(), nullable=False),  # real tokens, padding excluded
        pa.field("sha256", pa.string(), nullable=False),
        pa.field("tokenizer_sha256", pa.string(), nullable=False),
        pa.field("seq_len", pa.int32(), nullable=False),
    ],
    metadata={"format_version": str(FORMAT_VERSION), "artifact": "shard_index"},
)

NON_FILTER_REJECT_REASONS: dict[str, str] = {
    "unreadable_file": "the whole file could not be read (corrupt compression, not the declared format)",
    "invalid_json": "the line is not valid JSON",
    "not_an_object": "the JSON value is not an object",
    "invalid_utf8": "the bytes are not valid UTF-8",
    "missing_text": "the text field is absent or null",
    "non_string_text": "the text field is not a string",
    "contaminated": "a train document sharing a dedupe.decontaminate.ngram-word n-gram with the validation "
                    "split or an evaluation file (the detail names which, and the n-gram)",
    "outside_source": "a symbolic link (to a file or a folder) in the source folder that resolves outside it; "
                      "not read",
    "not_a_regular_file": "a FIFO, socket or device in the source folder; not opened (only regular files are read)",
    "missing_file": "a file planned for an ingest part that was deleted or renamed before the part read it; "
                    "nothing to read (its name is kept)",
    **PREFERENCE_REJECT_REASONS,  # the chat reasons (core.conversations) and the pairs' own
}
"""The ``rejects.reason`` values that are not quality filters (a record or file that cannot be read, a train
document that is contaminated, a conversation or preference pair that cannot be trained on: ``core.conversations``,
``core.preference_pairs``),
with their meaning; later stages may add reasons, never rename them. Each quality filter's reason is a row of
``pipeline.filters.screen.QUALITY_FILTERS``;
``pipeline.filters.screen.REJECT_REASONS`` holds them all."""


CONSUMED_SCHEMA = pa.schema([
    ("step", pa.int64()), ("micro_step", pa.int32()), ("rank", pa.int32()), ("batch_row", pa.int32()),
    ("sample", pa.int64()), ("shard_path", pa.string()), ("row_in_shard", pa.int64()), ("source", pa.string()),
    ("segment", pa.int32()), ("spike", pa.bool_()), ("rolled_back", pa.bool_())])
"""The ``consumed`` view (derived by :mod:`trainer.metrics.consumed`): one row per training row per step. ``rank`` is
the data-parallel rank (a TP group is one), ``micro_step`` the micro-batch within the rank's step, ``batch_row``
the row within it, ``sample`` the global sample number, ``segment`` the launch (train_segments), ``spike`` the
step's update was skipped as a loss spike, ``rolled_back`` a later rollback undid it."""
ROW_LOSSES_SCHEMA = pa.schema([
    ("step", pa.int64()), ("micro_step", pa.int32()), ("rank", pa.int32()), ("batch_row", pa.int32()),
    ("sample", pa.int64()), ("loss", pa.float64()), ("segment", pa.int32())])
"""The ``row_losses`` view: one row per training row per step (``train.log_row_losses``), its mean next-token loss."""


def shard_schema(token_type: pa.DataType, seq_len: int, metadata: dict[str, str]) -> pa.Schema:
    """Schema of one packed token shard (Arrow IPC file, uncompressed).

    ``input_ids``: fixed_size_list<token_type>[seq_len]; ``doc_ids``: the documents with tokens in the row;
    ``doc_starts``: where each of those documents' tokens begin in the row (0 for a document continued
    from the previous row); ``first_doc_offset``: how many tokens of the row's first document came
    before this row; ``num_tokens``: real tokens in the row (the rest is padding).
    """
    return pa.schema(
        [
            pa.field("input_ids", pa.list_(pa.field("item", token_type, nullable=False), seq_len),
                     nullable=False),
            pa.field("doc_ids", pa.list_(pa.int64()), nullable=False),
            pa.field("doc_starts", pa.list_(pa.int32()), nullable=False),
            pa.field("first_doc_offset", pa.int32(), nullable=False),
            pa.field("num_tokens", pa.int32(), nullable=False),
        ],
        metadata=metadata,
    )
