"""Conversation records -> ``Conversation`` or ``Rejection``: :mod:`core.conversations`, re-exported here beside
the chat code that renders them (ingest reads the same parser, and ``pipeline`` cannot import ``tokenization``)."""

from core.conversations import (
    CHAT_REJECT_REASONS,
    MESSAGE_KEYS,
    ROLES,
    Conversation,
    Message,
    RecordFormat,
    Rejection,
    parse_record,
)

__all__ = ["CHAT_REJECT_REASONS", "MESSAGE_KEYS", "ROLES", "Conversation", "Message", "RecordFormat", "Rejection",
           "parse_record"]
