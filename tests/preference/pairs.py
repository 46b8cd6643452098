"""Preference records shared by the preference tests: each shape TRL reads, with one- and multi-turn prompts."""

from __future__ import annotations

from typing import Any

USER = {"role": "user", "content": "What is a tuple?"}
CHOSEN = {"role": "assistant", "content": "An immutable sequence."}
REJECTED = {"role": "assistant", "content": "A mutable mapping."}

CONVERSATIONAL = {"prompt": [USER], "chosen": [CHOSEN], "rejected": [REJECTED]}
MULTI_TURN = {"prompt": [{"role": "user", "content": "Name a loop."}, {"role": "assistant", "content": "for"},
                         {"role": "user", "content": "Another one?"}],
              "chosen": [{"role": "assistant", "content": "while"}],
              "rejected": [{"role": "assistant", "content": "if, which is not a loop at all"}]}
PLAIN = {"prompt": "Which keyword defines a function?", "chosen": "def", "rejected": "lambda, always"}
IMPLICIT = {"chosen": [USER, CHOSEN], "rejected": [USER, REJECTED]}

RECORDS: list[dict[str, Any]] = [CONVERSATIONAL, MULTI_TURN, PLAIN]


def as_conversational(record: dict[str, Any]) -> dict[str, Any]:
    """A plain record in TRL's conversational format (a user turn, one assistant turn per side): what tokenmill
    renders a plain record as, so TRL sees the same conversation."""
    if not isinstance(record["prompt"], str):
        return record
    return {"prompt": [{"role": "user", "content": record["prompt"]}],
            "chosen": [{"role": "assistant", "content": record["chosen"]}],
            "rejected": [{"role": "assistant", "content": record["rejected"]}]}
