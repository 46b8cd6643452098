"""Conversation -> token ids and a loss mask you can trust (or the ``Rejection`` saying why not).

The mask comes from the template itself, one of two ways chosen per template (``ChatTemplate.uses_generation_markers``):

- **generation markers**: the template's ``{% generation %}`` blocks, through transformers'
  ``return_assistant_tokens_mask`` (what TRL's ``assistant_only_loss`` uses). Each block must give one run of
  marked tokens per assistant turn. A template that rewrites an earlier turn (a thinking template dropping its
  ``<think>`` part) is handled: the marked tokens are the turn as rendered.
- **prefix diff**, for templates without markers (every stock Llama-3, Qwen, Gemma and Mistral template): assistant
  turn ``i`` is the text of ``messages[:i+1]`` after that of ``messages[:i]`` with the generation prompt, as in
  open-instruct's masking and TRL's prompt/completion split. Both renderings must be prefixes of the whole
  conversation's text (a template that rewrites earlier turns is refused per record), and the turn (with its
  header) must contain the message as written, stripped: a template that rewrites the content while rendering would
  otherwise get a mask that lands mid-content (allenai/open-instruct#1800). The character boundaries become token
  positions through the offsets of the one tokenization of the whole text: diffing separately tokenized prefixes
  instead breaks where the prompt's end tokenizes differently alone (a GPT-2 style pre-tokenizer splits the "\n\n"
  of Llama-3's header differently when content follows), which TRL resolves by shifting the completion's start
  into the header. A token that straddles a boundary is a rejection. The turn's end-of-turn token carries loss and
  what follows it (the newline before the next header in ChatML and Gemma) does not, the convention of the
  ``{% generation %}`` blocks tokenmill's tests compare against.

Never silent: a record whose mask carries no token, or every token when assistant-only loss was asked, is
rejected; so is one longer than ``max_tokens`` with ``truncation="error"``, and one whose messages contain the
tokenizer's special tokens (the data would otherwise write its own turn boundaries).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from tokenization.chat.records import Conversation, Rejection
from tokenization.chat.template import RENDER_ERRORS, ChatTemplate

LossMode = Literal["assistant", "last_assistant", "all"]
"""``assistant``: every assistant turn (of the completion, for a prompt/completion record), each with its end-of-turn
token; ``last_assistant``: only the last one; ``all``: every token."""
Truncation = Literal["error", "truncate"]
"""Over ``max_tokens``: reject the record (``error``) or keep its first ``max_tokens`` tokens (``truncate``)."""
MaskMethod = Literal["generation_markers", "prefix_diff", "all_tokens"]

Span = tuple[int, int]
"""Token positions [start, end) of one assistant turn in the rendered conversation."""


@dataclass(frozen=True)
class MaskedConversation:
    """A conversation rendered by the model's template: ``loss_mask[i] == 1`` when token ``i`` is a training target."""

    input_ids: list[int]
    loss_mask: list[int]
    method: MaskMethod

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


class _Refused(Exception):
    """Internal: carries a rejection (sentence, code) out of the span finders (never leaves this module)."""

    def __init__(self, message: str, code: str = "unmaskable") -> None:
        super().__init__(message)
        self.code = code


def mask_conversation(template: ChatTemplate, conversation: Conversation, mode: LossMode = "assistant",
                      max_tokens: int | None = None,
                      truncation: Truncation = "error") -> MaskedConversation | Rejection:
    """Render ``conversation`` with ``template`` and mark the tokens that carry loss under ``mode``."""
    try:
        _refuse_special_tokens_in_messages(template, conversation)
        if mode == "all":
            input_ids = template.render_ids(conversation.template_input())
            masked = MaskedConversation(input_ids, [1] * len(input_ids), "all_tokens")
        else:
            masked = _mask_assistant_turns(template, conversation, mode)
        masked = _fit(masked, max_tokens, truncation)
    except _Refused as refused:
        return Rejection(str(refused), refused.code)
    except RENDER_ERRORS as err:
        return Rejection(f"the chat template ({template.source.name}) refuses the conversation: {_first_line(err)}",
                         "template_error")
    return _checked(masked, mode)


def _mask_assistant_turns(template: ChatTemplate, conversation: Conversation, mode: LossMode) -> MaskedConversation:
    turns = conversation.trained_assistant_indices()
    if mode == "last_assistant":
        turns = turns[-1:]
    if template.uses_generation_markers:
        input_ids, spans = _spans_from_markers(template, conversation)
        method: MaskMethod = "generation_markers"
    else:
        input_ids, spans = _spans_from_prefixes(template, conversation, turns)
        method = "prefix_diff"
    loss_mask = [0] * len(input_ids)
    for turn in turns:
        start, end = spans[turn]
        loss_mask[start:end] = [1] * (end - start)
    return MaskedConversation(input_ids, loss_mask, method)


def _spans_from_markers(template: ChatTemplate, conversation: Conversation) -> tuple[list[int], dict[int, Span]]:
    """Token spans of every assistant turn, one run of ``{% generation %}`` tokens each, in order."""
    input_ids, marks = template.render_with_assistant_mask(conversation.template_input())
    runs = _runs_of_ones(marks)
    assistant_turns = [index for index, message in enumerate(conversation.messages) if message.role == "assistant"]
    if len(runs) != len(assistant_turns):
        raise _Refused(f"the template's generation blocks mark {len(runs)} span(s) for {len(assistant_turns)} "
                       "assistant turn(s); cannot tell which tokens belong to which turn")
    return input_ids, dict(zip(assistant_turns, runs, strict=True))


def _spans_from_prefixes(template: ChatTemplate, conversation: Conversation,
                         turns: list[int]) -> tuple[list[int], dict[int, Span]]:
    """Token spans of the assistant turns ``turns``, each the difference of two prefix renderings."""
    full_text = template.render_text(conversation.template_input())
    input_ids, offsets = template.encode_with_offsets(full_text)
    starts = [start for start, _ in offsets]
    spans = {}
    for turn in turns:
        start_char, end_char = _prefix_chars(template, conversation, turn, full_text)
        start = _token_at(starts, offsets, start_char, turn, "its generation prompt and its reply")
        end = _token_at(starts, offsets, end_char, turn, "its end and the next turn")
        end = _end_of_turn(input_ids, start, end, template.special_token_ids)
        if end <= start:
            raise _Refused(f"assistant turn {turn} renders to no tokens after its generation prompt")
        spans[turn] = (start, end)
    return input_ids, spans


def _prefix_chars(template: ChatTemplate, conversation: Conversation, turn: int, full_text: str) -> tuple[int, int]:
    """[start, end) characters of assistant turn ``turn`` in ``full_text``: after ``messages[:turn]`` rendered with
    the generation prompt, up to the end of ``messages[:turn+1]`` rendered; both must be prefixes of the whole."""
    prompt_text = template.render_text(conversation.template_input(turn), add_generation_prompt=True)
    turn_text = template.render_text(conversation.template_input(turn + 1))
    for part, text in (("prompt before it", prompt_text), ("conversation up to it", turn_text)):
        if not full_text.startswith(text):
            raise _Refused(f"assistant turn {turn} cannot be masked: the template renders the {part} differently "
                           "once later turns follow (it rewrites earlier turns, e.g. drops their <think> part); "
                           "use a template with {% generation %} markers or loss on last_assistant")
    _check_content_rendered(template, conversation, turn, turn_text)
    return len(prompt_text), len(turn_text)


def _token_at(starts: list[int], offsets: list[tuple[int, int]], char: int, turn: int, between: str) -> int:
    """The index of the first token starting at or after ``char``; refused when a token straddles ``char`` (the
    tokenizer merged text across the turn's boundary, so no token position separates them)."""
    index = bisect.bisect_left(starts, char)
    if index > 0 and offsets[index - 1][1] > char:
        raise _Refused(f"assistant turn {turn} cannot be masked: one token spans {between}")
    return index


def _end_of_turn(input_ids: list[int], start: int, end: int, control_ids: frozenset[int]) -> int:
    """The end of the turn: just past its last control token (``<|im_end|>``, ``<|eot_id|>``, ``</s>``), so what
    the template writes after it (a newline before the next header) carries no loss; ``end`` without one."""
    for position in range(end - 1, start - 1, -1):
        if input_ids[position] in control_ids:
            return position + 1
    return end


def _check_content_rendered(template: ChatTemplate, conversation: Conversation, turn: int, turn_text: str) -> None:
    """Refuse a turn whose rendering (header included) does not contain its content as written, stripped."""
    header_start = template.render_text(conversation.template_input(turn))
    rendered_turn = turn_text[len(header_start):] if turn_text.startswith(header_start) else turn_text
    content = conversation.messages[turn].content.strip()
    if content not in rendered_turn:
        raise _Refused(f"assistant turn {turn} cannot be masked: the template rewrites its content while rendering "
                       "(the rendered turn does not contain the message as written, e.g. a <think> part dropped); "
                       "use a template with {% generation %} markers")


def _refuse_special_tokens_in_messages(template: ChatTemplate, conversation: Conversation) -> None:
    """Every string a message hands the template (content, tool-call arguments, names) is checked."""
    special = template.special_tokens
    for index, message in enumerate(conversation.messages):
        text = "\n".join(_strings(message.as_template_input()))
        found = sorted(token for token in special if token in text)
        if found:
            raise _Refused(f"message {index} ({message.role}) contains the tokenizer's special token(s) "
                           f"{', '.join(found)}: they would be read as turn boundaries, not text", "special_tokens")


def _strings(value: Any) -> Iterator[str]:
    """The strings inside a message's nested dicts and lists (keys too: a template may render them)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def _fit(masked: MaskedConversation, max_tokens: int | None, truncation: Truncation) -> MaskedConversation:
    num_tokens = len(masked.input_ids)
    if max_tokens is None or num_tokens <= max_tokens:
        return masked
    if truncation == "error":
        raise _Refused(f"the conversation is {num_tokens} tokens, longer than {max_tokens} (seq_len) with "
                       "truncation: error", "too_many_tokens")
    return MaskedConversation(masked.input_ids[:max_tokens], masked.loss_mask[:max_tokens], masked.method)


def _checked(masked: MaskedConversation, mode: LossMode) -> MaskedConversation | Rejection:
    """The never-silent rule: a mask that trains on nothing, or on everything when assistant-only was asked."""
    if masked.num_loss_tokens == 0:
        return Rejection(f"no token carries loss ({mode} loss, {masked.method}): nothing of the assistant's turns "
                         "is left to train on", "no_loss_tokens")
    if mode != "all" and masked.num_loss_tokens == len(masked.input_ids):
        return Rejection(f"every token carries loss although {mode} loss was asked ({masked.method}): the prompt "
                         "is marked as assistant text", "all_tokens_loss")
    return masked


def _runs_of_ones(marks: list[int]) -> list[Span]:
    runs: list[Span] = []
    start = None
    for position, mark in enumerate([*marks, 0]):
        if mark and start is None:
            start = position
        elif not mark and start is not None:
            runs.append((start, position))
            start = None
    return runs


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
