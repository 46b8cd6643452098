"""Ingest stage, what a reader yields: a :class:`Record` (a document as read) or a :class:`Reject` (why not).

Shared by every format's reader: how a JSON line becomes one or the other (:func:`parse_json_line`), how a
chat or preference source's record becomes a conversation or pair document (:func:`structured_record`), the
``too_long`` reject of a record not read whole, and the UTF-8 checks every stored string passes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from core.conversations import Rejection, parse_record
from core.preference_pairs import parse_pair
from pipeline.ingest.streams import MAX_JSON_BYTES_PER_CHAR, RECORD_SLACK_BYTES, TOO_LONG_RAW_BYTES
from pipeline.manifest import SourceConfig


@dataclass(frozen=True, slots=True)
class Record:
    """A document as read: text not yet normalised; ``raw`` is kept when the reader had the bytes anyway."""

    uri: str
    text: str
    source_id: str | None
    raw: bytes | None
    record: str | None = None
    """A chat source's conversation or a preference source's pair, normalised, as JSON (the documents' ``record``
    column); None for text."""


@dataclass(frozen=True, slots=True)
class Reject:
    """A record (or file) that could not become a document, with why and its original bytes."""

    uri: str
    reason: str
    detail: str
    raw: bytes | None
    source_id: str | None = None


def too_long(uri: str, prefix: bytes, num_bytes: int, max_bytes: int, source_id: str | None = None) -> Reject:
    """The ``too_long`` reject of a record of ``num_bytes`` not read whole; ``raw`` holds its first bytes."""
    kept = prefix[:TOO_LONG_RAW_BYTES]
    detail = (f"{num_bytes} bytes, above the {max_bytes}-byte limit for one record ({MAX_JSON_BYTES_PER_CHAR} bytes "
              f"per character of filters.max_chars, plus {RECORD_SLACK_BYTES >> 20} MiB); not parsed, raw holds "
              f"its first {len(kept)} bytes")
    return Reject(uri, "too_long", detail, kept, source_id)


def parse_json_line(line: bytes, uri: str, source: SourceConfig) -> Record | Reject:
    """A jsonl line as a record, or the reject that says why it is not one (a lone surrogate in the text is
    found by :func:`pipeline.ingest.readers.storable`)."""
    try:
        obj = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        return Reject(uri, "invalid_utf8", f"byte {err.start}: {err.reason}", line)
    except (ValueError, RecursionError) as err:
        return Reject(uri, "invalid_json", " ".join(str(err).split())[:200], line)
    if not isinstance(obj, dict):
        return Reject(uri, "not_an_object", f"the line holds {json_kind(obj)}, not a JSON object", line)
    source_id = source_id_text(obj.get(source.id_field)) if source.id_field else None
    if source.records != "text":
        return structured_record(source.records, obj, uri, line, source_id)
    value = obj.get(source.text_field)
    if source.text_field in obj and value is None:
        return Reject(uri, "missing_text", f"'{source.text_field}' is null", line, source_id)
    if value is None:
        keys = ", ".join(sorted(obj)[:10])
        detail = f"no '{source.text_field}' field (keys: {keys}); set text_field in the manifest"
        return Reject(uri, "missing_text", detail, line, source_id)
    if not isinstance(value, str):
        detail = f"'{source.text_field}' holds {json_kind(value)}, not a string"
        return Reject(uri, "non_string_text", detail, line, source_id)
    return Record(uri, value, source_id, line)


def chat_record(obj: Mapping[str, object], uri: str, raw: bytes | None, source_id: str | None) -> Record | Reject:
    """A chat source's record (an object with ``messages`` or ``prompt``/``completion``; its other fields, an id
    or a dataset's metadata, are not read) as a conversation document, or the reject with its reason (``unknown_role``,
    ``no_assistant_turn``, ``empty_content``, ... of :data:`core.conversations.CHAT_REJECT_REASONS`)."""
    conversation = parse_record(obj)
    if isinstance(conversation, Rejection):
        return _reject(conversation, obj, uri, raw, source_id)
    return Record(uri, conversation.document_text(), source_id, raw, conversation.normalised_json())


def preference_record(obj: Mapping[str, object], uri: str, raw: bytes | None,
                      source_id: str | None) -> Record | Reject:
    """A preference source's record (``prompt`` or ``messages`` with ``chosen`` and ``rejected``, or the two sides
    alone; its other fields are not read) as a pair document whose text is the prompt, or the reject with its reason
    (``identical_sides``, ``empty_side``, ``bad_record``, ... of
    :data:`core.preference_pairs.PREFERENCE_REJECT_REASONS`)."""
    pair = parse_pair(obj)
    if isinstance(pair, Rejection):
        return _reject(pair, obj, uri, raw, source_id)
    return Record(uri, pair.prompt_text, source_id, raw, pair.normalised_json())


def structured_record(records: str, obj: Mapping[str, object], uri: str, raw: bytes | None,
                      source_id: str | None) -> Record | Reject:
    """A record of a source whose ``records`` is ``chat`` or ``preference``, as :func:`chat_record` or
    :func:`preference_record` reads it."""
    read = preference_record if records == "preference" else chat_record
    return read(obj, uri, raw, source_id)


def _reject(rejection: Rejection, obj: Mapping[str, object], uri: str, raw: bytes | None,
            source_id: str | None) -> Reject:
    """The reject of a record that did not parse; ``raw``: its bytes, or (a table row) the record as JSON."""
    raw = raw if raw is not None else json.dumps(obj, ensure_ascii=False, default=str).encode("utf-8")
    return Reject(uri, rejection.code, rejection.reason, raw, source_id)


RECORD_FIELDS = {"chat": ("messages", "prompt", "completion"),
                 "preference": ("prompt", "messages", "chosen", "rejected")}
"""The fields of a chat or preference record that hold it, by the source's ``records`` (the columns a table reader
reads)."""


JSON_KINDS = {dict: "an object", list: "an array", bool: "a boolean", int: "a number", float: "a number",
              str: "a string", type(None): "null"}
"""What a parsed JSON value is, in JSON's own words (``json.loads`` gives Python types)."""


def json_kind(value: object) -> str:
    """``value``'s JSON kind, with an article: "an array", "a number", "null"."""
    return JSON_KINDS.get(type(value), f"a {type(value).__name__}")


def source_id_text(value: object) -> str | None:
    """An id field's value as valid UTF-8 text (bytes decoded with ``\\xNN`` escapes), or None."""
    if value is None:
        return None
    text = value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)
    return text if is_utf8(text) else backslash_escaped(text)


def is_utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (holds no lone surrogate)."""
    return text.isascii() or _is_encodable(text)


def backslash_escaped(text: str) -> str:
    """``text`` with each lone surrogate written as ``\\udNNN``: valid UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _is_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
