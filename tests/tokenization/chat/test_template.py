"""tokenization/chat/template.py: the model's own template, from either place a model dir keeps it, or the recipe's
file; refused in one line when it and the tokenizer disagree."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from core.errors import ConfigError
from tests.tokenization.chat import chat_tokenizers as ct
from tokenization.chat.template import PROBE_MESSAGES, load_chat_template


def copy_dir(model_dirs: dict[str, Path], name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model_dirs[name], tmp_path / name))


def test_the_template_comes_from_chat_template_jinja(model_dirs: dict[str, Path]) -> None:
    template = load_chat_template(model_dirs["chatml"])
    assert template.source == model_dirs["chatml"] / "chat_template.jinja"
    assert template.text == ct.CHATML
    assert template.render_text(PROBE_MESSAGES[1:3]).startswith("<|im_start|>system\nYou are a helpful")


def test_or_from_tokenizer_config_json_in_the_older_layout(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    folder = ct.move_template_into_tokenizer_config(copy_dir(model_dirs, "gemma", tmp_path))
    template = load_chat_template(folder)
    assert template.source == folder / "tokenizer_config.json"
    assert template.text == ct.GEMMA


def test_a_model_without_a_template_asks_for_one_and_takes_the_recipes_file(model_dirs: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    folder = model_dirs["chatml_no_template"]
    with pytest.raises(ConfigError, match=r"the model has no chat template .*name a template file in the recipe"):
        load_chat_template(folder)
    recipe_template = tmp_path / "chatml.jinja"
    recipe_template.write_text(ct.CHATML_MARKED)
    template = load_chat_template(folder, recipe_template)
    assert (template.source, template.text, template.uses_generation_markers) == (recipe_template, ct.CHATML_MARKED,
                                                                                  True)


def test_a_template_with_tokens_the_tokenizer_lacks_is_refused_in_one_line_naming_the_file(
        model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """ChatML's template on the Llama-3 tokenizer: ``<|im_start|>`` would be split into ordinary pieces."""
    wrong = tmp_path / "chatml.jinja"
    wrong.write_text(ct.CHATML)
    with pytest.raises(ConfigError) as refused:
        load_chat_template(model_dirs["llama3"], wrong)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{wrong}: the chat template emits <|im_end|>, <|im_start|>, which the tokenizer in ")
    gemma_in_model_dir = copy_dir(model_dirs, "mistral", tmp_path)
    (gemma_in_model_dir / "chat_template.jinja").write_text(ct.GEMMA)
    with pytest.raises(ConfigError, match=r"chat_template.jinja: the chat template emits <end_of_turn>, "
                                          r"<start_of_turn>, which"):
        load_chat_template(gemma_in_model_dir)


def test_a_template_that_fails_on_a_plain_conversation_is_refused(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ raise_exception('this template only renders tools') }}")
    with pytest.raises(ConfigError, match=r"broken.jinja: the chat template fails on a plain user/assistant "
                                          r"conversation \(this template only renders tools\)"):
        load_chat_template(model_dirs["chatml"], broken)


def test_generation_markers_are_used_only_where_they_mark_tokens(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """transformers returns an all-zero mask for a template without the block (only a log line says so), and for a
    block in a branch the conversation never takes: both must fall back to the prefix diff."""
    stock = load_chat_template(model_dirs["chatml"])
    _, zeros = stock.render_with_assistant_mask(PROBE_MESSAGES)
    assert not any(zeros)
    assert not stock.uses_generation_markers
    assert load_chat_template(model_dirs["chatml_marked"]).uses_generation_markers
    unreachable = tmp_path / "unreachable.jinja"
    unreachable.write_text(ct.CHATML.replace("{{- message.content }}", "{%- if message.never %}{% generation %}"
                                             "{{- message.content }}{% endgeneration %}{%- else %}"
                                             "{{- message.content }}{%- endif %}"))
    assert not load_chat_template(model_dirs["chatml"], unreachable).uses_generation_markers


def test_missing_or_unreadable_inputs_are_one_line_errors(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model folder not found"):
        load_chat_template(tmp_path / "absent")
    with pytest.raises(ConfigError, match="cannot read the chat template"):
        load_chat_template(model_dirs["chatml"], tmp_path / "absent.jinja")
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    with pytest.raises(ConfigError, match="cannot load its tokenizer"):
        load_chat_template(not_a_model)
