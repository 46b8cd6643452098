"""The worked SFT example (configs/sft.yaml): its chat template renders and masks conversations with the quick start's
kind of tokenizer, and the recipe points at the quick start's export and its own corpus and template.

The tokenizer is one tokenmill trains (``<|endoftext|>`` and ``<|pad|>`` only), in an export made by the trainer's
own export function: what ``runs/tiny/model`` holds after the quick start. Running the example end to end is the
README test's job (it needs the quick start's run).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from tests.trainer.quick_start_model import SFT_TEMPLATE, quick_start_like_export
from tokenization.chat.masks import MaskedConversation, mask_conversation
from tokenization.chat.records import Conversation, parse_record
from tokenization.chat.template import ChatTemplate, load_chat_template

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "sft.yaml"
CORPUS = REPO / "data_manifests" / "python-stdlib-chat.jsonl"
TWO_ROUNDS = {"messages": [
    {"role": "system", "content": "You answer questions about the Python standard library in a few sentences."},
    {"role": "user", "content": "What does `json.dumps` do?"},
    {"role": "assistant", "content": "Serialize ``obj`` to a JSON formatted ``str``."},
    {"role": "user", "content": "And `json.loads`?"},
    {"role": "assistant", "content": "Deserialize ``s`` to a Python object."},
]}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    folder = quick_start_like_export(tmp_path_factory.mktemp("sft-example") / "run")
    return load_chat_template(folder, SFT_TEMPLATE)


def masked(template: ChatTemplate, record: dict) -> MaskedConversation:
    conversation = parse_record(record)
    assert isinstance(conversation, Conversation), conversation
    result = mask_conversation(template, conversation)
    assert isinstance(result, MaskedConversation), result
    return result


def trained_spans(template: ChatTemplate, result: MaskedConversation) -> list[str]:
    """The decoded runs of tokens that carry loss, special tokens kept."""
    spans, current = [], []
    for token, mark in zip(result.input_ids, [*result.loss_mask], strict=True):
        if mark:
            current.append(token)
        elif current:
            spans.append(template.tokenizer.decode(current))
            current = []
    return spans + ([template.tokenizer.decode(current)] if current else [])


def test_the_template_renders_with_the_quick_start_tokenizers_own_tokens(template: ChatTemplate) -> None:
    assert template.render_text(TWO_ROUNDS["messages"][:2], add_generation_prompt=True) == (
        "<|endoftext|>### System:\nYou answer questions about the Python standard library in a few sentences.\n\n"
        "### User:\nWhat does `json.dumps` do?\n\n### Assistant:\n")
    ids = template.render_ids(TWO_ROUNDS["messages"])
    eos_id = template.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert ids[0] == eos_id and ids.count(eos_id) == 3, "a start and one end per reply, each one special token"
    assert template.uses_generation_markers


def test_only_each_reply_and_its_end_token_carry_loss(template: ChatTemplate) -> None:
    result = masked(template, TWO_ROUNDS)
    assert result.method == "generation_markers"
    assert trained_spans(template, result) == ["Serialize ``obj`` to a JSON formatted ``str``.<|endoftext|>",
                                               "Deserialize ``s`` to a Python object.<|endoftext|>"]
    prompt_text = template.tokenizer.decode([token for token, mark in zip(result.input_ids, result.loss_mask,
                                                                          strict=True) if not mark])
    assert "What does `json.dumps` do?" in prompt_text and "### Assistant:" in prompt_text


def test_the_markers_mask_what_the_prefix_diff_finds(template: ChatTemplate) -> None:
    """Two independent ways to find the replies agree: the generation markers are where the template puts replies."""
    without_markers = dataclasses.replace(template, uses_generation_markers=False)
    records = [TWO_ROUNDS, {"prompt": "What is `queue.Queue`?", "completion": "Create a queue object."}]
    for record in records:
        by_markers, by_prefixes = masked(template, record), masked(without_markers, record)
        assert by_prefixes.method == "prefix_diff"
        assert (by_markers.input_ids, by_markers.loss_mask) == (by_prefixes.input_ids, by_prefixes.loss_mask)


def test_every_tenth_record_of_the_built_in_corpus_masks(template: ChatTemplate) -> None:
    records = [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines()[::10]]
    for record in records:
        result = masked(template, record)
        replies = ([message["content"] for message in record["messages"] if message["role"] == "assistant"]
                   if "messages" in record else [record["completion"]])
        assert trained_spans(template, result) == [f"{reply}<|endoftext|>" for reply in replies]


def test_the_recipe_fine_tunes_the_quick_starts_export_on_the_built_in_corpus() -> None:
    recipe = yaml.safe_load(RECIPE.read_text(encoding="utf-8"))
    tiny = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text(encoding="utf-8"))
    base = RECIPE.parent
    assert (base / recipe["model"]["from_pretrained"]).resolve() == (REPO / "runs" / tiny["name"] / "model").resolve()
    assert "tokenizer" not in recipe, "the model's own tokenizer"
    assert [(base / name).resolve() for name in recipe["data"]["manifests"]] == \
        [REPO / "data_manifests" / "python-stdlib-chat.yaml"]
    assert (base / recipe["chat"]["template_file"]).resolve() == SFT_TEMPLATE
    assert (recipe["chat"]["loss"], recipe["train"]["mode"], recipe["train"]["document_masking"]) == \
        ("assistant", "sft", True)
    assert recipe["pack"]["seq_len"] == tiny["pack"]["seq_len"], "the tiny model's context length"
    assert recipe["train"]["max_steps"] <= 300 and recipe["eval"]["checkpoints"] == "last"
