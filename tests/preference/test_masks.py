"""tokenization/preference/masks.py: both sides rendered with the model's template, the shared prompt identical on
both, loss only on each completion (end-of-turn token included), token by token against TRL's DPOTrainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.preference.pairs import CONVERSATIONAL, MULTI_TURN, RECORDS, as_conversational
from tests.preference.trl_dpo import dpo_trainer, trl_sides
from tests.tokenization.chat import chat_tokenizers as ct
from tokenization.chat.records import Rejection
from tokenization.chat.template import ChatTemplate, load_chat_template
from tokenization.preference.masks import MaskedPair, mask_pair
from tokenization.preference.records import PreferencePair, parse_pair

END_OF_TURN = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>", "chatml_marked": "<|im_end|>",
               "gemma": "<end_of_turn>", "mistral": "</s>"}


def masked_pair(template: ChatTemplate, record: dict[str, Any], **settings: Any) -> MaskedPair:
    pair = parse_pair(record)
    assert isinstance(pair, PreferencePair), pair
    result = mask_pair(template, pair, **settings)
    assert isinstance(result, MaskedPair), result
    return result


def rejected_pair(template: ChatTemplate, record: dict[str, Any], **settings: Any) -> Rejection:
    pair = parse_pair(record)
    assert isinstance(pair, PreferencePair), pair
    result = mask_pair(template, pair, **settings)
    assert isinstance(result, Rejection), f"expected a rejection, got {result}"
    return result


@pytest.mark.parametrize("family", sorted(END_OF_TURN))
def test_token_ids_equal_trls_and_the_masks_differ_only_where_documented(
        family: str, preference_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Same ids on every family. TRL's mask also covers what follows the end-of-turn token (ChatML's and Gemma's
    newline) and, for Llama-3, the header's ``\\n\\n`` that tokenizes differently alone: nothing else."""
    template = load_chat_template(preference_model_dirs[family])
    expected = trl_sides(dpo_trainer(preference_model_dirs[family], [as_conversational(r) for r in RECORDS],
                                     tmp_path))
    for record, trl in zip(RECORDS, expected, strict=True):
        ours = masked_pair(template, record)
        for side in ("chosen", "rejected"):
            result = getattr(ours, side)
            trl_ids, trl_mask = trl[side]
            assert result.input_ids == trl_ids
            first, last = result.loss_mask.index(1), len(result.loss_mask) - result.loss_mask[::-1].index(1)
            assert result.loss_mask[first:last] == trl_mask[first:last] == [1] * (last - first)
            before = template.tokenizer.decode(trl_ids[trl_mask.index(1):first])
            assert before.strip() == "" and first - trl_mask.index(1) <= 2
            assert template.tokenizer.decode(trl_ids[last - 1:last]) == END_OF_TURN[family]
            assert template.tokenizer.decode(trl_ids[last:]).strip() == ""
            if family in ("mistral", "chatml", "chatml_marked", "gemma"):
                assert result.loss_mask[:last] == trl_mask[:last]
            if family == "mistral":
                assert result.loss_mask == trl_mask


@pytest.mark.parametrize("family", ["llama3", "chatml", "chatml_marked"])
def test_prompt_tokens_are_shared_and_the_mask_is_each_completion_with_its_end_of_turn(
        family: str, preference_model_dirs: dict[str, Path]) -> None:
    template = load_chat_template(preference_model_dirs[family])
    result = masked_pair(template, MULTI_TURN)
    prompt_messages = MULTI_TURN["prompt"]
    assert result.chosen.input_ids[:result.num_prompt_tokens] == result.rejected.input_ids[:result.num_prompt_tokens]
    assert template.tokenizer.decode(result.prompt_ids) == template.render_text(prompt_messages,
                                                                              add_generation_prompt=True)
    for side in ("chosen", "rejected"):
        masked = getattr(result, side)
        trained = [token for token, loss in zip(masked.input_ids, masked.loss_mask, strict=True) if loss]
        assert template.tokenizer.decode(trained) == MULTI_TURN[side][0]["content"] + END_OF_TURN[family]


def test_too_long_side_rejects_the_pair_with_truncation_error_and_is_cut_with_truncate(
        preference_model_dirs: dict[str, Path]) -> None:
    template = load_chat_template(preference_model_dirs["chatml"])
    lengths = [len(side.input_ids) for side in (masked_pair(template, MULTI_TURN).chosen,
                                                masked_pair(template, MULTI_TURN).rejected)]
    limit = min(lengths) + 1
    rejection = rejected_pair(template, MULTI_TURN, max_tokens=limit)
    assert rejection.code == "too_many_tokens"
    assert rejection.reason.startswith(f"'rejected': the conversation is {max(lengths)} tokens, longer than {limit}")
    cut = masked_pair(template, MULTI_TURN, max_tokens=limit, truncation="truncate")
    assert len(cut.rejected.input_ids) == limit and len(cut.chosen.input_ids) == min(lengths)


def test_sides_the_template_renders_alike_are_rejected_as_identical(preference_model_dirs: dict[str, Path]) -> None:
    """Llama-3's template trims each message: two answers that differ only in surrounding blanks are one answer."""
    template = load_chat_template(preference_model_dirs["llama3"])
    record = {"prompt": "What does pass do?", "chosen": "Nothing.", "rejected": "  Nothing.\n"}
    assert rejected_pair(template, record).code == "identical_sides"


def test_a_prompt_rendered_differently_before_each_answer_is_refused(tmp_path: Path) -> None:
    """A (marked) template whose user turn depends on the answer that follows: the two sides would be compared
    under different contexts."""
    answer_dependent = ct.CHATML_MARKED.replace(
        "'<|im_start|>' + message.role + '\n' + message.content",
        "'<|im_start|>' + message.role + '\n' + message.content + (' (long)' if messages[-1].content|length > 20 "
        "else '')")
    assert answer_dependent != ct.CHATML_MARKED
    template = load_chat_template(ct.save_model_dir(tmp_path / "model", ct.CHATML_FAMILY, answer_dependent))
    assert rejected_pair(template, CONVERSATIONAL).code == "prompt_mismatch"
    short = {**CONVERSATIONAL, "rejected": [{"role": "assistant", "content": "A dict."}]}
    assert isinstance(mask_pair(template, parse_pair({**short, "chosen": [{"role": "assistant", "content": "A set"}]})),
                      MaskedPair)


def test_a_template_that_rewrites_a_side_rejects_the_pair_naming_the_side(
        preference_model_dirs: dict[str, Path]) -> None:
    template = load_chat_template(preference_model_dirs["thinking"])
    record = {"prompt": "Is 7 prime?", "chosen": "<think>7 has no divisor</think>Yes.", "rejected": "No."}
    rejection = rejected_pair(template, record)
    assert rejection.code == "unmaskable" and rejection.reason.startswith("'chosen': ")
