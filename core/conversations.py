"""Conversation records -> one typed ``Conversation`` (or the ``Rejection`` saying why not); no I/O, never raises.

Read by ingest (a manifest source with ``records: chat``: each record becomes a document whose ``text`` is
:meth:`Conversation.document_text` and whose ``record`` is :meth:`Conversation.normalised_json`) and by the SFT data
stage (which parses that JSON again and renders it with the model's template); here in ``core`` because both the
data library and the tokenization package read it. ``tokenization.chat.records`` re-exports it.

Two record formats are read, as TRL reads them:

- ``messages``: ``[{"role", "content"}, ...]`` with roles system/user/assistant/tool; an assistant message may carry
  ``tool_calls`` (kept as given, for the template to render) and then may have empty content.
- ``prompt``/``completion``: either two strings (TRL's plain variant, read as one user turn and one assistant turn,
  so the model's chat template renders it) or two message lists (TRL's conversational variant). Only the completion
  carries loss, as in TRL's ``completion_only_loss``: ``Conversation.first_trained_message`` marks where it starts.

A bad record (unknown role or key, wrong types, empty content, no assistant turn to train on) becomes a
``Rejection`` whose reason names the message and the value; the length check needs tokens and lives in ``masks``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

ROLES = ("system", "user", "assistant", "tool")
"""Roles a message may have; ``tool`` carries a tool's answer back to the assistant (never loss)."""
MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")
"""Keys a message may have; another key is a rejection, not silently dropped (a template might have used it)."""

RecordFormat = Literal["messages", "prompt_completion"]


@dataclass(frozen=True)
class Message:
    """One turn; ``tool_calls`` and the other optional keys reach the template exactly as the record had them."""

    role: str
    content: str
    tool_calls: tuple[Mapping[str, Any], ...] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The dict ``apply_chat_template`` reads: role and content, plus the optional keys the record set."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls is not None:
            message["tool_calls"] = [dict(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


@dataclass(frozen=True)
class Conversation:
    """A valid conversation: at least one assistant turn at or after ``first_trained_message``."""

    messages: tuple[Message, ...]
    first_trained_message: int
    """Messages before this index are the prompt of a prompt/completion record: they never carry loss."""
    record_format: RecordFormat

    def template_input(self, num_messages: int | None = None) -> list[dict[str, Any]]:
        """The first ``num_messages`` messages (all by default) as ``apply_chat_template`` takes them."""
        return [message.as_template_input() for message in self.messages[:num_messages]]

    def document_text(self) -> str:
        """The messages' contents joined by a blank line: what dedupe, the quality filters and decontamination read
        of a conversation (roles and template markup left out, so a copy differing only in them is a copy)."""
        return "\n\n".join(message.content for message in self.messages if message.content.strip())

    def normalised(self) -> dict[str, Any]:
        """The conversation in one canonical record form that :func:`parse_record` reads back into an equal
        Conversation: ``{"messages": [...]}``, or ``{"prompt": [...], "completion": [...]}`` (message lists, also for
        a record whose prompt and completion were strings)."""
        messages = self.template_input()
        if self.record_format == "messages":
            return {"messages": messages}
        return {"prompt": messages[:self.first_trained_message], "completion": messages[self.first_trained_message:]}

    def normalised_json(self) -> str:
        """:meth:`normalised` as compact JSON (keys sorted, non-ASCII kept): the documents' ``record`` column."""
        return json.dumps(self.normalised(), ensure_ascii=False, sort_keys=True, separators=(",", ":"))

    def trained_assistant_indices(self) -> list[int]:
        """Indices of the assistant turns that may carry loss (those of the completion, for a prompt/completion)."""
        return [index for index, message in enumerate(self.messages)
                if message.role == "assistant" and index >= self.first_trained_message]


@dataclass(frozen=True)
class Rejection:
    """Why a record cannot be trained on; goes to ``rejects`` with the record's id.

    ``reason``: the sentence naming the message and value (``rejects.detail``); ``code``: its class, one of
    :data:`CHAT_REJECT_REASONS` (``rejects.reason``), so SQL can count rejects by kind without parsing sentences."""

    reason: str
    code: str = "bad_record"


CHAT_REJECT_REASONS: dict[str, str] = {
    "bad_record": "the record is not a conversation in the 'messages' or 'prompt'/'completion' format",
    "unknown_key": "a message has a key other than role, content, tool_calls, tool_call_id, name",
    "unknown_role": "a message's role is not system, user, assistant or tool",
    "empty_content": "a message has empty content (and no tool calls)",
    "no_assistant_turn": "no assistant turn to train on (in the completion, for a prompt/completion record)",
    "no_prompt": "the conversation starts with an assistant turn: there is no prompt before it",
    "special_tokens": "a message contains the tokenizer's special tokens (they would write turn boundaries)",
    "template_error": "the chat template refuses the conversation",
    "unmaskable": "the assistant turns' tokens cannot be told apart from the prompt's with this template",
    "too_many_tokens": "the conversation (a preference pair: its two sides together) is longer than pack.seq_len "
                       "tokens with chat.truncation: error",
    "no_loss_tokens": "no token carries loss under the asked loss mode",
    "all_tokens_loss": "every token carries loss although assistant-only loss was asked",
}
"""The ``rejects.reason`` values of chat records (:attr:`Rejection.code`), with their meaning (part of
:data:`core.schemas.NON_FILTER_REJECT_REASONS`). Ingest rejects a record that does not parse; the SFT data stage one
that cannot be rendered and masked (:data:`RENDERING_REASONS`)."""

RENDERING_REASONS = ("special_tokens", "template_error", "unmaskable", "too_many_tokens", "no_loss_tokens",
                     "all_tokens_loss")
"""The chat reasons decided when a kept document is rendered by the SFT data stage: such a record is in ``documents``
(it passed ingest, dedupe and decontamination) and in ``rejects``, like a contaminated one."""


class BadRecord(Exception):
    """Carries a rejection (code, sentence) out of the nested checks (this module's and the preference parser's)."""

    def __init__(self, message: str, code: str = "bad_record") -> None:
        super().__init__(message)
        self.code = code


def parse_record(record: Any) -> Conversation | Rejection:
    """Read one record in the ``messages`` or ``prompt``/``completion`` format; bad data gives a Rejection."""
    try:
        return _parse(record)
    except BadRecord as bad:
        return Rejection(str(bad), bad.code)


def _parse(record: Any) -> Conversation:
    if not isinstance(record, Mapping):
        raise BadRecord(f"a record must be an object with 'messages' or 'prompt'/'completion', not {kind_of(record)}")
    has_messages = "messages" in record
    has_prompt_completion = "prompt" in record or "completion" in record
    if has_messages and has_prompt_completion:
        raise BadRecord("the record has both 'messages' and 'prompt'/'completion'; keep one format per record")
    if has_messages:
        messages = parse_messages(record["messages"], "messages")
        return _conversation(messages, first_trained_message=0, record_format="messages")
    if has_prompt_completion:
        return _parse_prompt_completion(record)
    raise BadRecord(f"the record has neither 'messages' nor 'prompt'/'completion' (keys: {sorted(map(str, record))})")


def _parse_prompt_completion(record: Mapping[str, Any]) -> Conversation:
    if "prompt" not in record or "completion" not in record:
        missing = "prompt" if "prompt" not in record else "completion"
        raise BadRecord(f"the record has no '{missing}'; a prompt/completion record needs both")
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        messages = [_parse_message({"role": "user", "content": prompt}, "prompt"),
                    _parse_message({"role": "assistant", "content": completion}, "completion")]
        return _conversation(messages, first_trained_message=1, record_format="prompt_completion")
    if isinstance(prompt, list) and isinstance(completion, list):
        prompt_messages = parse_messages(prompt, "prompt")
        completion_messages = parse_messages(completion, "completion")
        return _conversation(prompt_messages + completion_messages, first_trained_message=len(prompt_messages),
                             record_format="prompt_completion")
    raise BadRecord(f"'prompt' and 'completion' must both be strings or both be message lists, not "
                     f"{kind_of(prompt)} and {kind_of(completion)}")


def parse_messages(messages: Any, field: str) -> list[Message]:
    if not isinstance(messages, list) or not messages:
        raise BadRecord(f"'{field}' must be a non-empty list of messages, not {kind_of(messages)}")
    return [_parse_message(message, f"{field}[{index}]") for index, message in enumerate(messages)]


def _parse_message(message: Any, where: str) -> Message:
    if not isinstance(message, Mapping):
        raise BadRecord(f"{where} must be an object with 'role' and 'content', not {kind_of(message)}")
    unknown = sorted(str(key) for key in message if key not in MESSAGE_KEYS)
    if unknown:
        raise BadRecord(f"{where} has unknown key(s) {unknown}; a message may have {list(MESSAGE_KEYS)}",
                         "unknown_key")
    role = message.get("role")
    if role not in ROLES:
        raise BadRecord(f"{where} has unknown role {_show(role)}; roles are {list(ROLES)}", "unknown_role")
    tool_calls = _tool_calls(message.get("tool_calls"), where)
    if tool_calls is not None and role != "assistant":
        raise BadRecord(f"{where} ({role}) has 'tool_calls'; only assistant messages call tools")
    content = message.get("content")
    if content is None and tool_calls:
        content = ""
    if not isinstance(content, str):
        raise BadRecord(f"{where} ({role}) content must be a string, not {kind_of(content)}")
    if not content.strip() and not tool_calls:
        raise BadRecord(f"{where} ({role}) has empty content", "empty_content")
    optional = {key: message.get(key) for key in ("tool_call_id", "name")}
    for key, value in optional.items():
        if value is not None and not isinstance(value, str):
            raise BadRecord(f"{where} '{key}' must be a string, not {kind_of(value)}")
    return Message(role=role, content=content, tool_calls=tool_calls, **optional)


def _tool_calls(tool_calls: Any, where: str) -> tuple[Mapping[str, Any], ...] | None:
    if tool_calls is None:
        return None
    if not isinstance(tool_calls, list) or not all(isinstance(call, Mapping) for call in tool_calls):
        raise BadRecord(f"{where} 'tool_calls' must be a list of objects, not {kind_of(tool_calls)}")
    return tuple(tool_calls)


def _conversation(messages: list[Message], first_trained_message: int, record_format: RecordFormat) -> Conversation:
    conversation = Conversation(tuple(messages), first_trained_message, record_format)
    trained = conversation.trained_assistant_indices()
    if not trained:
        where = "in the completion" if record_format == "prompt_completion" else "in 'messages'"
        raise BadRecord(f"no assistant turn {where}: nothing to train on", "no_assistant_turn")
    if trained[0] == 0:
        raise BadRecord("the conversation starts with an assistant turn: there is no prompt before it", "no_prompt")
    return conversation


def kind_of(value: Any) -> str:
    """The JSON-ish type name of a value, for a reason string (never the value itself: it can be long)."""
    names = {str: "a string", list: "a list", dict: "an object", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), "an object" if isinstance(value, Mapping) else type(value).__name__)


def _show(value: Any) -> str:
    """A short, quoted rendering of a scalar from a record (roles are short; anything else is cut)."""
    text = repr(value) if isinstance(value, str) else kind_of(value)
    return text if len(text) <= 40 else text[:37] + "..."
