"""Preference records -> one typed ``PreferencePair`` (or the ``Rejection`` saying why not); no I/O, never raises.

Read by ingest (a manifest source with ``records: preference``: each record becomes a document whose ``text`` is
:attr:`PreferencePair.prompt_text` and whose ``record`` is :meth:`PreferencePair.normalised_json`) and by the
preference data stage (which parses that JSON again, renders and masks it); here in ``core`` because both the data
library and the tokenization package read it, as :mod:`core.conversations`. ``tokenization.preference.records``
re-exports it.

Three record shapes are read, as TRL 1.16's ``DPOTrainer`` reads them (``trl.data_utils``):

- explicit prompt, conversational: ``prompt`` (or ``messages``) a message list, ``chosen`` and ``rejected`` message
  lists (usually one assistant turn each);
- explicit prompt, plain: three strings, read as one user turn and one assistant turn per side, so the model's chat
  template renders them as it renders the SFT data (TRL instead concatenates plain strings without a template);
- implicit prompt: only ``chosen`` and ``rejected``, two whole conversations; their longest common prefix of
  messages is the prompt (``trl.extract_prompt``).

Messages are checked as the SFT records are (:mod:`tokenization.chat.records`: roles, keys, empty content); a pair
is also rejected when a side is empty, when both sides are the same, or when a side does not start with the
assistant's answer (a side that adds a user turn first would answer another prompt).
The length check needs tokens and lives in :mod:`tokenization.preference.masks`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from core.conversations import (  # the chat parser's pieces: a message is checked the same way here
    CHAT_REJECT_REASONS,
    BadRecord,
    Conversation,
    Message,
    Rejection,
    kind_of,
    parse_messages,
)

PairFormat = Literal["conversational", "plain", "implicit_prompt"]
Side = Literal["chosen", "rejected"]
SIDES: tuple[Side, Side] = ("chosen", "rejected")

PREFERENCE_REJECT_REASONS: dict[str, str] = {
    **CHAT_REJECT_REASONS,
    "empty_side": "'chosen' or 'rejected' is empty: a pair needs two answers to compare",
    "identical_sides": "'chosen' and 'rejected' are the same (as written, or once rendered): nothing to prefer",
    "not_an_answer": "'chosen' or 'rejected' does not start with an assistant turn (it would change the prompt)",
    "prompt_mismatch": "the prompt renders to different tokens before 'chosen' than before 'rejected'",
}
"""The ``rejects.reason`` values of preference records (:attr:`Rejection.code`), with their meaning: the chat
reasons (a message's role, key or content; the template; the length) plus the pair's own."""


@dataclass(frozen=True)
class PreferencePair:
    """A valid pair: a non-empty prompt and two different completions, each with an assistant turn."""

    prompt: tuple[Message, ...]
    chosen: tuple[Message, ...]
    rejected: tuple[Message, ...]
    record_format: PairFormat

    def conversation(self, side: Side) -> Conversation:
        """The prompt followed by one side, as the chat code renders and masks it: only the side's assistant turns
        may carry loss (``first_trained_message`` is where the side starts)."""
        return Conversation(self.prompt + getattr(self, side), first_trained_message=len(self.prompt),
                            record_format="prompt_completion")

    @property
    def prompt_text(self) -> str:
        """The prompt's message contents joined by a blank line: what dedupe and decontamination read for a pair
        (the prompt is what an evaluation set would share; the two answers differ by design)."""
        return "\n\n".join(message.content for message in self.prompt)

    def normalised(self) -> dict[str, Any]:
        """The pair in one canonical form that :func:`parse_pair` reads back into the same prompt and sides:
        ``{"prompt": [...], "chosen": [...], "rejected": [...]}``, message lists whatever shape the record had (a
        plain pair's strings become a user and an assistant turn; an implicit prompt becomes explicit)."""
        return {key: [message.as_template_input() for message in getattr(self, key)]
                for key in ("prompt", *SIDES)}

    def normalised_json(self) -> str:
        """:meth:`normalised` as compact JSON (keys sorted, non-ASCII kept): the documents' ``record`` column."""
        return json.dumps(self.normalised(), ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def parse_pair(record: Any) -> PreferencePair | Rejection:
    """Read one preference record in any of the three shapes; bad data gives a Rejection with its code."""
    try:
        return _parse(record)
    except BadRecord as bad:
        return Rejection(str(bad), bad.code)


def _parse(record: Any) -> PreferencePair:
    if not isinstance(record, Mapping):
        raise BadRecord(f"a preference record must be an object with 'chosen' and 'rejected', not {kind_of(record)}")
    missing = [side for side in SIDES if side not in record]
    if missing:
        raise BadRecord(f"the record has no {' or '.join(repr(side) for side in missing)}; a preference record "
                         f"needs 'chosen' and 'rejected' (keys: {sorted(map(str, record))})")
    prompt_keys = [key for key in ("prompt", "messages") if key in record]
    if len(prompt_keys) == 2:
        raise BadRecord("the record has both 'prompt' and 'messages'; give the prompt once")
    for side in SIDES:
        _refuse_empty_side(record[side], side)
    if not prompt_keys:
        return _implicit_prompt_pair(record["chosen"], record["rejected"])
    return _explicit_prompt_pair(record[prompt_keys[0]], prompt_keys[0], record["chosen"], record["rejected"])


def _explicit_prompt_pair(prompt: Any, prompt_key: str, chosen: Any, rejected: Any) -> PreferencePair:
    if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
        user = parse_messages([{"role": "user", "content": prompt}], prompt_key)
        sides = [parse_messages([{"role": "assistant", "content": text}], side)
                 for side, text in zip(SIDES, (chosen, rejected), strict=True)]
        return _pair(user, sides[0], sides[1], "plain")
    if isinstance(prompt, list) and isinstance(chosen, list) and isinstance(rejected, list):
        return _pair(parse_messages(prompt, prompt_key), parse_messages(chosen, "chosen"),
                     parse_messages(rejected, "rejected"), "conversational")
    raise BadRecord(f"'{prompt_key}', 'chosen' and 'rejected' must all be strings or all be message lists, not "
                     f"{kind_of(prompt)}, {kind_of(chosen)} and {kind_of(rejected)}")


def _implicit_prompt_pair(chosen: Any, rejected: Any) -> PreferencePair:
    """The prompt is the messages both conversations start with (``trl.extract_prompt``)."""
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise BadRecord(f"without a 'prompt', 'chosen' and 'rejected' must be whole conversations (message lists) "
                         f"that start with the same prompt, not {kind_of(chosen)} and {kind_of(rejected)}; plain "
                         "strings need a 'prompt'", "no_prompt")
    chosen_messages = parse_messages(chosen, "chosen")
    rejected_messages = parse_messages(rejected, "rejected")
    shared = 0
    for chosen_message, rejected_message in zip(chosen_messages, rejected_messages, strict=False):
        if chosen_message != rejected_message:
            break
        shared += 1
    _refuse_identical(chosen_messages, rejected_messages)
    for side, messages in zip(SIDES, (chosen_messages, rejected_messages), strict=True):
        if shared == len(messages):
            raise BadRecord(f"'{side}' has nothing after the prompt it shares with the other side (its "
                             f"{len(messages)} message(s) all start the other conversation)", "empty_side")
    if shared == 0:
        raise BadRecord("'chosen' and 'rejected' differ from their first message: without a 'prompt' the prompt "
                         "is the messages they share, and they share none", "no_prompt")
    return _pair(chosen_messages[:shared], chosen_messages[shared:], rejected_messages[shared:], "implicit_prompt")


def _pair(prompt: list[Message], chosen: list[Message], rejected: list[Message],
          record_format: PairFormat) -> PreferencePair:
    _refuse_identical(chosen, rejected)
    for side, messages in zip(SIDES, (chosen, rejected), strict=True):
        if not any(message.role == "assistant" for message in messages):
            raise BadRecord(f"'{side}' has no assistant turn: nothing of it to score", "no_assistant_turn")
        if messages[0].role != "assistant":
            raise BadRecord(f"'{side}' starts with a {messages[0].role} turn, not the assistant's answer: both sides "
                             "must answer the same prompt (move the shared turns into the prompt)", "not_an_answer")
    return PreferencePair(tuple(prompt), tuple(chosen), tuple(rejected), record_format)


def _refuse_identical(chosen: list[Message], rejected: list[Message]) -> None:
    if chosen == rejected:
        raise BadRecord("'chosen' and 'rejected' are identical: the pair prefers nothing", "identical_sides")


def _refuse_empty_side(value: Any, side: Side) -> None:
    """An empty string, an empty list, blank text or messages that are all blank is an empty side, named as such
    (not as a malformed message)."""
    if value is None or value == [] or _blank(value) or (isinstance(value, list) and all(map(_blank, value))):
        raise BadRecord(f"'{side}' is empty ({kind_of(value) if value is None else repr(value)}): a pair needs two "
                         "answers to compare", "empty_side")


def _blank(value: Any) -> bool:
    """Blank text, or a message whose content is blank and which calls no tool."""
    if isinstance(value, Mapping):
        return not value.get("tool_calls") and _blank(value.get("content") or "")
    return isinstance(value, str) and not value.strip()
