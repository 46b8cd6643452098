"""Local model dirs with chat templates of real families, built without downloads.

Each family gets a small byte-level BPE trained on standard-library text, its control tokens added as special tokens
(as the real models have them), wrapped as a ``PreTrainedTokenizerFast`` and saved with ``save_pretrained``. The
templates are written out here: each stock one as its model ships it (no ``{% generation %}`` block), and a twin
with the block around the assistant's content and end-of-turn token (TRL's ``*_training.jinja`` variants do the
same; here the block ends at the end-of-turn token, the convention tokenmill's prefix diff follows).
"""

from __future__ import annotations

import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 600

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
"""Meta-Llama-3-8B-Instruct's template."""
LLAMA3_MARKED = (
    "{%- for message in messages %}{%- if loop.index0 == 0 %}{{- bos_token }}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}"
    "{%- else %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)

_CHATML_TOOL_CALLS = (
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}{%- endfor %}"
)
_CHATML_HEAD = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}"
)
_CHATML_TAIL = "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
CHATML = (_CHATML_HEAD + "{{- message.content }}" + "{%- if message.tool_calls %}" + _CHATML_TOOL_CALLS
          + "{%- endif %}{{- '<|im_end|>\n' }}" + _CHATML_TAIL)
"""Qwen2.5-Instruct's ChatML: its default system turn, tool calls in ``<tool_call>`` tags (written right after the
content here), tool answers in ``<tool_response>``; the tools section of the system turn is left out."""
CHATML_MARKED = (_CHATML_HEAD + "{%- generation %}{{- message.content }}{%- if message.tool_calls %}"
                 + _CHATML_TOOL_CALLS + "{%- endif %}{{- '<|im_end|>' }}{%- endgeneration %}{{- '\n' }}"
                 + _CHATML_TAIL)

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
"""gemma-2-it's template."""
GEMMA_MARKED = (
    "{{- bos_token -}}{%- if messages[0]['role'] == 'system' -%}{{- raise_exception('System role not supported') -}}"
    "{%- endif -%}{%- for message in messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{- '<start_of_turn>model\n' -}}"
    "{%- generation -%}{{- message['content'] | trim + '<end_of_turn>' -}}{%- endgeneration -%}{{- '\n' -}}"
    "{%- else -%}{{- '<start_of_turn>' + message['role'] + '\n' + message['content'] | trim + '<end_of_turn>\n' -}}"
    "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
"""Mistral-7B-Instruct-v0.1's template: ``[INST]`` is plain text, the turn ends with ``</s>``, no generation prompt."""
MISTRAL_MARKED = MISTRAL.replace("{{ message['content'] + eos_token}}",
                                 "{% generation %}{{ message['content'] + eos_token}}{% endgeneration %}")

_THINKING_HEAD = (
    "{%- set ns = namespace(last_query_index=messages|length - 1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    "{%- if '</think>' in content and loop.index0 < ns.last_query_index %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\n' }}"
)
_THINKING_TAIL = (
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
THINKING = _THINKING_HEAD + "{{- content + '<|im_end|>\n' }}" + _THINKING_TAIL
"""Qwen3's rule: the ``<think>...</think>`` part of assistant turns before the last user turn is not rendered."""
THINKING_MARKED = (_THINKING_HEAD + "{%- generation %}{{- content + '<|im_end|>' }}{%- endgeneration %}{{- '\n' }}"
                   + _THINKING_TAIL)
THINKING_ALWAYS_STRIPPED = THINKING.replace("'</think>' in content and loop.index0 < ns.last_query_index",
                                            "'</think>' in content")
"""A template that never renders the reasoning it was given, not even in the last turn."""


@dataclass(frozen=True)
class Family:
    """A template family: its control tokens and the tokenizer's named special tokens."""

    name: str
    control_tokens: tuple[str, ...]
    bos: str
    eos: str
    added_tokens: tuple[str, ...] = ()
    """Added tokens that are not special (``<think>``, ``<tool_call>``: ordinary text to the model's chat API)."""


LLAMA3_FAMILY = Family("llama3", ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                  "<|end_of_text|>"), bos="<|begin_of_text|>", eos="<|eot_id|>")
CHATML_FAMILY = Family("chatml", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), bos="<|endoftext|>",
                       eos="<|im_end|>", added_tokens=("<tool_call>", "</tool_call>", "<think>", "</think>"))
GEMMA_FAMILY = Family("gemma", ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"), bos="<bos>",
                      eos="<eos>")
MISTRAL_FAMILY = Family("mistral", ("<unk>", "<s>", "</s>"), bos="<s>", eos="</s>")


def stdlib_text(num_files: int = 6) -> list[str]:
    """A few standard-library sources and their docstrings: a stable, local training text."""
    paths = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:num_files]
    return [path.read_text(encoding="utf-8") for path in paths]


def train_tokenizer(family: Family) -> Tokenizer:
    """A byte-level BPE with the family's control tokens as its first ids."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(family.control_tokens),
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(stdlib_text(), trainer=trainer)
    return tokenizer


def save_model_dir(folder: Path, family: Family, template: str | None, tokenizer: Tokenizer | None = None) -> Path:
    """``folder`` as ``save_pretrained`` writes it: the tokenizer with ``template`` as its chat template."""
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer or train_tokenizer(family), bos_token=family.bos,
                                      eos_token=family.eos)
    wrapped.add_special_tokens({"additional_special_tokens": list(family.control_tokens)})
    if family.added_tokens:
        wrapped.add_tokens(list(family.added_tokens))
    if template is not None:
        wrapped.chat_template = template
    wrapped.save_pretrained(str(folder))
    return folder


def move_template_into_tokenizer_config(folder: Path) -> Path:
    """The older layout: the template as ``chat_template`` in tokenizer_config.json, no chat_template.jinja."""
    jinja = folder / "chat_template.jinja"
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = jinja.read_text()
    config_file.write_text(json.dumps(config))
    jinja.unlink()
    return folder
