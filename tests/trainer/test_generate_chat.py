"""``tokenmill generate --chat``: the user's message goes through the export's chat template with the generation
prompt, and the reply is what transformers generates from the same rendering; a model without a template is one line.

The export is quick-start-like (tokenmill's tokenizer, the built-in Llama, random weights) with the worked example's
template (configs/sft-chat.jinja) saved beside it, as an SFT run's export carries it; its weights are drawn wide, so
that greedy replies are varied text rather than one repeated token.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.errors import ConfigError
from tests.trainer.quick_start_model import quick_start_like_export
from trainer.model.generate import chat_reply, load_chat_template_of, load_exported_model

TOKENMILL = str(Path(sys.executable).parent / "tokenmill")
MESSAGE = "What does `json.dumps` do?"


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("chat-run") / "run"
    quick_start_like_export(run_dir, with_template=True, seed=5, scale=15)
    return run_dir


def transformers_reply(model_dir: Path, message: str, max_new_tokens: int) -> tuple[list[int], str]:
    """(prompt ids, greedy reply) by transformers alone: its tokenizer's template, its ``generate``, stopping at
    the tokenizer's special tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stop = [tokenizer.convert_tokens_to_ids(token) for token in tokenizer.all_special_tokens]
    output = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop,
                            pad_token_id=stop[0])
    return prompt[0].tolist(), tokenizer.decode(output[0, prompt.shape[1]:], skip_special_tokens=True)


def test_the_reply_is_greedy_generation_from_the_templates_rendering(chat_run: Path) -> None:
    model_dir = chat_run / "model"
    model, _, special, context_len = load_exported_model(model_dir)
    template = load_chat_template_of(model_dir)
    reply = chat_reply(model, template, context_len, MESSAGE, max_new_tokens=16, temperature=0)
    prompt_ids, expected = transformers_reply(model_dir, MESSAGE, max_new_tokens=16)
    assert prompt_ids[0] == special.eos_id, "the template starts a conversation as pretraining started documents"
    assert template.tokenizer.decode(prompt_ids).endswith("### User:\nWhat does `json.dumps` do?\n\n### Assistant:\n")
    assert reply == expected and len(set(reply)) > 4


def test_a_model_without_a_chat_template_is_named(tmp_path: Path) -> None:
    model_dir = quick_start_like_export(tmp_path / "run")
    with pytest.raises(ConfigError, match=r"model: the model has no chat template \(chat_template\.jinja or .*; "
                                          r"fine-tune it on conversations \(train\.mode: sft.* or leave out --chat"):
        load_chat_template_of(model_dir)


def test_the_command_prints_the_reply_or_one_error_line(chat_run: Path, tmp_path: Path) -> None:
    done = subprocess.run([TOKENMILL, "generate", str(chat_run), MESSAGE, "--chat", "--max-new-tokens", "12"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    model_dir = chat_run / "model"
    model, _, _, context_len = load_exported_model(model_dir)
    reply = chat_reply(model, load_chat_template_of(model_dir), context_len, MESSAGE, max_new_tokens=12)
    assert done.stdout == reply + "\n"
    plain = tmp_path / "plain"
    quick_start_like_export(plain)
    done = subprocess.run([TOKENMILL, "generate", str(plain), MESSAGE, "--chat"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and done.stdout == "", "a user error (docs/cli.md)"
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: {plain / 'model'}: the model has no chat template")
