"""tokenization/chat/records.py: both record formats into one Conversation; each bad-record class rejected with its
reason, never an exception."""

from __future__ import annotations

from typing import Any

import pytest

from tokenization.chat.records import Conversation, Message, Rejection, parse_record

USER = {"role": "user", "content": "What is a tuple?"}
ASSISTANT = {"role": "assistant", "content": "An immutable sequence."}


def test_messages_record_keeps_roles_contents_and_tool_calls_as_given() -> None:
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"term": "tuple"}}}
    record = {"messages": [{"role": "system", "content": "Be brief."}, USER,
                           {"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "content": "a sequence type", "tool_call_id": "c1"}, ASSISTANT]}
    conversation = parse_record(record)
    assert isinstance(conversation, Conversation)
    assert [message.role for message in conversation.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert conversation.messages[2] == Message("assistant", "", tool_calls=(call,))
    assert conversation.template_input()[2] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert conversation.template_input()[3]["tool_call_id"] == "c1"
    assert conversation.trained_assistant_indices() == [2, 4]
    assert conversation.record_format == "messages"


def test_plain_prompt_completion_is_one_user_and_one_assistant_turn_and_only_the_completion_trains() -> None:
    conversation = parse_record({"prompt": "What is a tuple?", "completion": "An immutable sequence."})
    assert isinstance(conversation, Conversation)
    assert conversation.template_input() == [USER, ASSISTANT]
    assert conversation.first_trained_message == 1
    assert conversation.record_format == "prompt_completion"


def test_conversational_prompt_completion_trains_only_the_completions_assistant_turns() -> None:
    earlier = {"role": "assistant", "content": "Ask me anything."}
    conversation = parse_record({"prompt": [USER, earlier, USER], "completion": [ASSISTANT]})
    assert isinstance(conversation, Conversation)
    assert conversation.first_trained_message == 3
    assert conversation.trained_assistant_indices() == [3]


@pytest.mark.parametrize(("record", "reason"), [
    ({"messages": [USER, {"role": "robot", "content": "beep"}]}, "messages[1] has unknown role 'robot'"),
    ({"messages": [{"role": "system", "content": "Be brief."}, USER]}, "no assistant turn in 'messages'"),
    ({"prompt": [USER, ASSISTANT], "completion": [USER]}, "no assistant turn in the completion"),
    ({"messages": [USER, {"role": "assistant", "content": "   \n"}]}, "messages[1] (assistant) has empty content"),
    ({"messages": [{"role": "user", "content": ""}, ASSISTANT]}, "messages[0] (user) has empty content"),
    ({"prompt": "", "completion": "Yes."}, "prompt (user) has empty content"),
    ({"messages": [USER, {"role": "assistant", "content": 42}]}, "content must be a string, not a number"),
    ({"messages": [USER, {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}]},
     "content must be a string, not a list"),
    ({"messages": "hello"}, "'messages' must be a non-empty list of messages, not a string"),
    ({"messages": []}, "'messages' must be a non-empty list of messages, not a list"),
    ({"messages": [USER, "hello"]}, "messages[1] must be an object"),
    ({"messages": [USER, {"role": "assistant", "content": "ok", "weight": 0.5}]}, "unknown key(s) ['weight']"),
    ({"messages": [USER, {"role": "assistant", "content": "", "tool_calls": "lookup()"}]},
     "'tool_calls' must be a list of objects, not a string"),
    ({"messages": [{**USER, "tool_calls": [{}]}, ASSISTANT]}, "only assistant messages call tools"),
    ({"messages": [USER, {"role": None, "content": "x"}]}, "unknown role null"),
    ({"prompt": "Hi"}, "the record has no 'completion'"),
    ({"prompt": "Hi", "completion": [ASSISTANT]}, "must both be strings or both be message lists"),
    ({"messages": [USER, ASSISTANT], "prompt": "Hi", "completion": "Yes"}, "both 'messages' and 'prompt'"),
    ({"text": "plain text"}, "neither 'messages' nor 'prompt'/'completion' (keys: ['text'])"),
    (["not", "an", "object"], "a record must be an object"),
    ({"messages": [ASSISTANT, USER, ASSISTANT]}, "starts with an assistant turn"),
])
def test_each_bad_record_class_is_rejected_with_its_reason(record: Any, reason: str) -> None:
    result = parse_record(record)
    assert isinstance(result, Rejection)
    assert reason in result.reason


def test_a_long_value_is_not_pasted_into_the_reason() -> None:
    result = parse_record({"messages": [USER, {"role": "x" * 10_000, "content": "ok"}]})
    assert isinstance(result, Rejection)
    assert len(result.reason) < 200
