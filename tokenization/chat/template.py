"""The model's own chat template: loaded from a local model dir (or a file the recipe names), checked once against
the tokenizer it will be rendered with, then used to render conversations into token ids.

The template text is what ``tokenizer_config.json`` (``chat_template``) or ``chat_template.jinja`` in the model dir
holds; transformers renders it in its sandboxed Jinja environment (``apply_chat_template``). Loading refuses, in one
line naming the file, a template that emits special-looking tokens (``<|im_start|>``, ``<end_of_turn>``, ``</s>``)
which the tokenizer would split into ordinary pieces: the model would be trained on text where it expects control
tokens, and nothing downstream would notice.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from core.errors import ConfigError
from core.layout import CHAT_TEMPLATE_FILE

TEMPLATE_FILE = CHAT_TEMPLATE_FILE
"""Where transformers >= 4.43 saves a model's chat template (it wins over ``tokenizer_config.json``'s)."""
TOKENIZER_CONFIG = "tokenizer_config.json"

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""A ``{% generation %}`` block: transformers' ``return_assistant_tokens_mask`` marks the tokens it renders."""
SPECIAL_LOOKING = re.compile(r"<\|[^<>|\s]+\|>|</?[A-Za-z_][A-Za-z0-9_.:-]*>")
"""Strings that are control tokens in every major template family: ``<|eot_id|>``, ``<s>``, ``<start_of_turn>``."""

RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError)
"""What rendering a record can raise: the template's ``raise_exception`` (a TemplateError) or Jinja operations on
data of an unexpected shape. A record that triggers one is rejected, never a crash."""

PROBE_MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is a tuple"},
    {"role": "assistant", "content": "An immutable sequence"},
    {"role": "user", "content": "And a list"},
    {"role": "assistant", "content": "A mutable one"},
]
"""A plain conversation whose words look like no token: every special-looking string in its rendering comes from
the template itself."""


@dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer with its chat template set, checked against each other; the one object conversations render with."""

    tokenizer: PreTrainedTokenizerBase
    text: str
    """The Jinja source, exactly as read (written into the exported model later, so evaluation renders the same)."""
    source: Path
    """The file the template came from (for messages and lineage)."""
    uses_generation_markers: bool
    """True when the template's ``{% generation %}`` blocks mark assistant tokens (checked on the probe, not just
    grepped: a marker that marks nothing would give an all-zero mask, which transformers reports only in a log line)."""

    def render_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The conversation as the template writes it; raises one of ``RENDER_ERRORS`` when the template refuses."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def render_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> list[int]:
        """Token ids of ``render_text`` (no BOS/EOS added: the template writes its own, as in apply_chat_template)."""
        return self.encode(self.render_text(messages, add_generation_prompt))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, offsets): ``offsets[i]`` is the [start, end) character range of ``text`` that token ``i`` covers."""
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoded["input_ids"]), [tuple(pair) for pair in encoded["offset_mapping"]]

    def render_with_assistant_mask(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """(ids, mask): mask[i] = 1 where token i was rendered inside a ``{% generation %}`` block."""
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                      return_assistant_tokens_mask=True)
        return list(rendered["input_ids"]), list(rendered["assistant_masks"])

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the tokenizer's special tokens (``<|im_end|>``, ``<|eot_id|>``, ``</s>``): the control tokens that
        end a turn. Added tokens that are not special (``<think>``, ``<tool_call>``) are text to the model."""
        return frozenset(index for index, token in self.tokenizer.added_tokens_decoder.items() if token.special)

    @cached_property
    def special_tokens(self) -> frozenset[str]:
        """The special tokens as strings: never allowed inside a message (the data would write turn boundaries)."""
        return frozenset(token.content for token in self.tokenizer.added_tokens_decoder.values() if token.special)


def load_chat_template(model_dir: Path, template_file: Path | None = None) -> ChatTemplate:
    """The chat template of the local model dir ``model_dir``, or ``template_file`` when the recipe names one.

    Raises ConfigError (one line, naming the file) when the tokenizer cannot be loaded, no template exists, the
    template fails on a plain conversation, or it emits special-looking tokens the tokenizer does not have.
    """
    model_dir = Path(model_dir)
    tokenizer = _load_tokenizer(model_dir)
    text, source = _template_source(model_dir, template_file)
    tokenizer.chat_template = text
    probe = _render_probe(tokenizer, source)
    _check_special_tokens(tokenizer, probe, source, model_dir)
    return ChatTemplate(tokenizer=tokenizer, text=text, source=source,
                        uses_generation_markers=_marks_assistant_tokens(tokenizer, text, probe))


def _load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    if not model_dir.is_dir():
        raise ConfigError(f"{model_dir}: model folder not found; point the recipe at a local model dir")
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, json.JSONDecodeError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{model_dir}: cannot load its tokenizer ({first_line}); the folder needs tokenizer.json "
                          "and tokenizer_config.json as save_pretrained writes them") from None


def _template_source(model_dir: Path, template_file: Path | None) -> tuple[str, Path]:
    """(template text, the file it came from): the recipe's file, else the model dir's own."""
    if template_file is not None:
        return _read_template_file(Path(template_file)), Path(template_file)
    jinja_file = model_dir / TEMPLATE_FILE
    if jinja_file.is_file():
        return _read_template_file(jinja_file), jinja_file
    config_file = model_dir / TOKENIZER_CONFIG
    template = _config_template(config_file) if config_file.is_file() else None
    if template is None:
        raise ConfigError(f"{model_dir}: the model has no chat template ({TEMPLATE_FILE} or 'chat_template' in "
                          f"{TOKENIZER_CONFIG}); name a template file in the recipe")
    return template, config_file


def _read_template_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the chat template ({err.__class__.__name__}); name a readable "
                          "UTF-8 Jinja file") from None
    if not text.strip():
        raise ConfigError(f"{path}: the chat template file is empty")
    return text


def _config_template(config_file: Path) -> str | None:
    """``chat_template`` of a tokenizer_config.json: a string, or the ``default`` one of a list of named templates."""
    try:
        template = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        raise ConfigError(f"{config_file}: not a readable JSON object; fix or re-save the tokenizer") from None
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ConfigError(f"{config_file}: 'chat_template' must be a Jinja string (or named templates with a "
                          "'default'), not " + type(template).__name__)
    return template


def _render_probe(tokenizer: PreTrainedTokenizerBase, source: Path) -> list[dict[str, Any]]:
    """The probe conversation the template accepts (without the system turn for templates that refuse one)."""
    errors = []
    for probe in (PROBE_MESSAGES, PROBE_MESSAGES[1:]):
        try:
            tokenizer.apply_chat_template(probe, tokenize=False)
            return probe
        except RENDER_ERRORS as err:
            errors.append(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
    raise ConfigError(f"{source}: the chat template fails on a plain user/assistant conversation ({errors[-1]}); "
                      "fix the template or name another one")


def _check_special_tokens(tokenizer: PreTrainedTokenizerBase, probe: list[dict[str, Any]], source: Path,
                          model_dir: Path) -> None:
    """ConfigError naming ``source`` when the rendered probe holds a special-looking string the tokenizer lacks."""
    rendered = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    known = set(tokenizer.get_added_vocab()) | set(tokenizer.all_special_tokens)
    missing = sorted({token for token in SPECIAL_LOOKING.findall(rendered) if token not in known})
    if missing:
        raise ConfigError(f"{source}: the chat template emits {', '.join(missing)}, which the tokenizer in "
                          f"{model_dir} does not have as special or added token(s); use the template made for "
                          "this tokenizer, or add the tokens to the tokenizer (add_special_tokens) and save it")


def _marks_assistant_tokens(tokenizer: PreTrainedTokenizerBase, text: str, probe: list[dict[str, Any]]) -> bool:
    """True when the template has ``{% generation %}`` blocks and they mark tokens of the probe conversation.

    Without a block transformers returns an all-zero mask with only a log line (FACTS, transformers 5.25); that case
    and a block that marks nothing both mean: derive the mask by rendering prefixes instead.
    """
    if not GENERATION_BLOCK.search(text) or not tokenizer.is_fast:
        return False
    rendered = tokenizer.apply_chat_template(probe, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
    return any(rendered["assistant_masks"])
