"""The report's sample generation of a fine-tuned export (one with a chat template) is its chat reply to the prompt;
an export without a template still continues the prompt as text."""

from __future__ import annotations

from pathlib import Path

from tests.trainer.quick_start_model import quick_start_like_export
from tests.trainer.test_sample_generation import write_documents
from trainer.model.generate import chat_reply, generate_text, load_chat_template_of, load_exported_model
from trainer.model.sample_generation import SAMPLE_SETTINGS, write_sample_generation

QUESTION = "What does `email.utils.parsedate_to_datetime` do with a date string from a header?"


def test_a_chat_export_samples_its_reply_to_the_whole_first_message(tmp_path: Path) -> None:
    paths = write_documents(tmp_path, [(f"{QUESTION}\n\nIt parses it.", "val")])
    quick_start_like_export(tmp_path, with_template=True, seed=5, scale=15)
    record = write_sample_generation(paths)
    model, _, _, context_len = load_exported_model(paths.model)
    expected = chat_reply(model, load_chat_template_of(paths.model), context_len, QUESTION, **SAMPLE_SETTINGS)
    assert (record["prompt"], record["completion"], record["chat"]) == (QUESTION, expected, True)


def test_an_export_without_a_template_continues_the_prompt(tmp_path: Path) -> None:
    paths = write_documents(tmp_path, [(f"{QUESTION}\n\nIt parses it.", "val")])
    quick_start_like_export(tmp_path, seed=5, scale=15)
    record = write_sample_generation(paths)
    model, tokenizer, special, context_len = load_exported_model(paths.model)
    prompt = QUESTION[:40]
    expected = generate_text(model, tokenizer, special, context_len, prompt, **SAMPLE_SETTINGS)[len(prompt):]
    assert (record["prompt"], record["completion"]) == (prompt, expected) and "chat" not in record
