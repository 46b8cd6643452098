"""tokenization/preference/records.py: TRL's preference shapes into one PreferencePair; each bad-pair class rejected
with its reason code and a sentence naming the field, never an exception."""

from __future__ import annotations

from typing import Any

import pytest

from tests.preference.pairs import CHOSEN, CONVERSATIONAL, IMPLICIT, PLAIN, REJECTED, USER
from tokenization.chat.records import Message, Rejection
from tokenization.preference.records import PREFERENCE_REJECT_REASONS, PreferencePair, parse_pair


def _messages(*dicts: dict[str, str]) -> tuple[Message, ...]:
    return tuple(Message(d["role"], d["content"]) for d in dicts)


def test_conversational_pair_keeps_prompt_and_sides_and_only_the_side_trains() -> None:
    pair = parse_pair(CONVERSATIONAL)
    assert pair == PreferencePair(_messages(USER), _messages(CHOSEN), _messages(REJECTED), "conversational")
    conversation = pair.conversation("rejected")
    assert conversation.template_input() == [USER, REJECTED]
    assert conversation.first_trained_message == 1
    assert conversation.trained_assistant_indices() == [1]


def test_messages_key_is_the_prompt_and_the_implicit_prompt_is_the_shared_prefix() -> None:
    explicit = parse_pair(CONVERSATIONAL)
    with_messages = parse_pair({"messages": [USER], "chosen": [CHOSEN], "rejected": [REJECTED]})
    implicit = parse_pair(IMPLICIT)
    assert isinstance(with_messages, PreferencePair) and isinstance(implicit, PreferencePair)
    expected = (explicit.prompt, explicit.chosen, explicit.rejected)
    assert (with_messages.prompt, with_messages.chosen, with_messages.rejected) == expected
    assert (implicit.prompt, implicit.chosen, implicit.rejected) == expected
    assert implicit.record_format == "implicit_prompt"


def test_plain_pair_is_a_user_turn_and_one_assistant_turn_per_side() -> None:
    pair = parse_pair(PLAIN)
    assert isinstance(pair, PreferencePair)
    assert pair.conversation("chosen").template_input() == [{"role": "user", "content": PLAIN["prompt"]},
                                                            {"role": "assistant", "content": "def"}]
    assert pair.record_format == "plain"
    assert pair.prompt_text == PLAIN["prompt"]


SYSTEM = {"role": "system", "content": "Be brief."}


@pytest.mark.parametrize(("record", "code", "named"), [
    ({"prompt": [USER], "chosen": [CHOSEN], "rejected": [dict(CHOSEN)]}, "identical_sides", "identical"),
    ({"prompt": "Q?", "chosen": "same", "rejected": "same"}, "identical_sides", "identical"),
    ({"chosen": [USER, CHOSEN], "rejected": [USER, CHOSEN]}, "identical_sides", "identical"),
    ({"prompt": "Q?", "chosen": "def", "rejected": ""}, "empty_side", "'rejected' is empty"),
    ({"prompt": [USER], "chosen": [], "rejected": [REJECTED]}, "empty_side", "'chosen' is empty"),
    ({"prompt": [USER], "chosen": [CHOSEN], "rejected": [{"role": "assistant", "content": "  "}]}, "empty_side",
     "'rejected' is empty"),
    ({"prompt": [USER], "chosen": [CHOSEN], "rejected": None}, "empty_side", "'rejected' is empty"),
    ({"chosen": [USER, CHOSEN], "rejected": [USER]}, "empty_side", "'rejected' has nothing after the prompt"),
    ({"prompt": [USER], "chosen": [{"role": "robot", "content": "beep"}], "rejected": [REJECTED]}, "unknown_role",
     "chosen[0] has unknown role 'robot'"),
    ({"prompt": [{"role": "user", "content": "Q?", "weight": 2}], "chosen": [CHOSEN], "rejected": [REJECTED]},
     "unknown_key", "prompt[0] has unknown key(s) ['weight']"),
    ({"prompt": [USER], "chosen": [CHOSEN], "rejected": [{"role": "user", "content": "Never mind."}]},
     "no_assistant_turn", "'rejected' has no assistant turn"),
    ({"prompt": [USER], "chosen": [CHOSEN], "rejected": [{"role": "user", "content": "Why?"}, REJECTED]},
     "not_an_answer", "'rejected' starts with a user turn"),
    ({"chosen": [USER, CHOSEN, USER, CHOSEN], "rejected": [USER, CHOSEN, {"role": "user", "content": "Why?"},
                                                           REJECTED]}, "not_an_answer", "'chosen' starts with a user"),
    ({"chosen": "def", "rejected": "lambda"}, "no_prompt", "plain strings need a 'prompt'"),
    ({"chosen": [SYSTEM, USER, CHOSEN], "rejected": [USER, REJECTED]}, "no_prompt", "they share none"),
    ({"prompt": [USER], "chosen": [CHOSEN]}, "bad_record", "has no 'rejected'"),
    ({"prompt": "Q?", "chosen": [CHOSEN], "rejected": "no"}, "bad_record", "must all be strings or all be"),
    ({"prompt": "Q?", "messages": [USER], "chosen": "a", "rejected": "b"}, "bad_record", "both 'prompt' and"),
    (["prompt", "chosen", "rejected"], "bad_record", "not a list"),
])
def test_bad_pair_is_rejected_with_its_code_and_a_sentence_naming_the_field(record: Any, code: str,
                                                                            named: str) -> None:
    rejection = parse_pair(record)
    assert isinstance(rejection, Rejection)
    assert (rejection.code, named in rejection.reason) == (code, True), rejection.reason
    assert code in PREFERENCE_REJECT_REASONS


ODD_VALUES: list[Any] = [None, 0, "", "text", [], [None], [{}], [{"role": 1}], [{"role": "user"}], {"role": "user"},
                         [{"role": "assistant", "content": None, "tool_calls": "call"}], [[USER]], 1.5, True]


def test_no_value_in_any_field_raises() -> None:
    for prompt in ODD_VALUES:
        for side in ODD_VALUES:
            for record in ({"prompt": prompt, "chosen": side, "rejected": [REJECTED]},
                           {"messages": prompt, "chosen": [CHOSEN], "rejected": side},
                           {"chosen": side, "rejected": prompt}):
                assert isinstance(parse_pair(record), PreferencePair | Rejection)
