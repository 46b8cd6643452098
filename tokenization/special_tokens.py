"""Special ids of the data path: the ids that end, start and pad packed documents -> ``special_tokens.json``.

A tokenizer tokenmill trains names them ``<|endoftext|>`` and ``<|pad|>`` and adds no BOS. A Hugging Face model's
own tokenizer names them in its folder's ``tokenizer_config.json``, ``special_tokens_map.json`` and ``config.json``
(GPT-2: EOS only; Llama: ``<s>`` added by its post-processor, ``</s>``; Qwen2: ``<|endoftext|>``); those ids are
recorded in the run dir, so pack and the trainer agree on them without reading the model folder again.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from core.errors import ConfigError
from core.files.atomic import read_json
from core.layout import HF_CONFIG_FILE
from core.rundir import RunPaths
from tokenization.config import SPECIAL_TOKENS

EOS_TOKEN, PAD_TOKEN = SPECIAL_TOKENS

TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json")
"""Files of a Hugging Face model folder that name its special tokens (tokenizer_config.json wins)."""


@dataclass(frozen=True)
class SpecialTokens:
    """The ids pack puts around each document (``[bos] + ids + [eos]``) and after the last one (``pad``)."""

    eos_id: int
    pad_id: int
    bos_id: int | None = None

    @property
    def pad_is_eos(self) -> bool:
        """True when padding is the EOS id (a tokenizer without a pad token): only trailing EOS are padding."""
        return self.pad_id == self.eos_id


def load_tokenizer(path: Path) -> Tokenizer:
    """Load a ``tokenizer.json``; raises ConfigError naming the file when it is missing or corrupt."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: tokenizer file not found; run the tokenizer stage first or fix tokenizer.path.")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for every parse error
        raise ConfigError(
            f"{path}: not a valid tokenizer.json ({err}); point tokenizer.path at a file saved by "
            "`tokenizers` (Tokenizer.save) or delete it so the stage trains a new one."
        ) from None


def special_token_ids(tokenizer: Tokenizer) -> tuple[int, int]:
    """(eos_id, pad_id): the ids of ``<|endoftext|>`` and ``<|pad|>``; ConfigError when either is absent."""
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    if eos_id is None or pad_id is None:
        missing = [name for name, token_id in ((EOS_TOKEN, eos_id), (PAD_TOKEN, pad_id)) if token_id is None]
        raise ConfigError(
            f"tokenizer lacks the special tokens {missing}; add them (tokenizer.add_special_tokens"
            f"({SPECIAL_TOKENS})) and save it again, or train one with tokenizer.vocab_size."
        )
    return eos_id, pad_id


def named_special_tokens(tokenizer: Tokenizer) -> SpecialTokens:
    """The special ids of a tokenizer tokenmill trained (or one given with the same named tokens); no BOS."""
    eos_id, pad_id = special_token_ids(tokenizer)
    return SpecialTokens(eos_id=eos_id, pad_id=pad_id)


def model_special_tokens(folder: Path, tokenizer: Tokenizer) -> SpecialTokens:
    """The special ids of a Hugging Face model folder's tokenizer (``tokenizer``, loaded from its tokenizer.json).

    Token strings come from ``tokenizer_config.json``, else ``special_tokens_map.json``; ids from ``config.json``
    (``eos_token_id`` may be a list: its first id) where no string names them. Without a pad token, pad is EOS.
    BOS only when the tokenizer adds it (``add_bos_token: true``, or its post-processor puts it first).
    Raises ConfigError naming the folder when no EOS is found or a named token is not in the tokenizer.
    """
    folder = Path(folder)
    names, config = _token_names(folder), _json_object(folder / HF_CONFIG_FILE)
    eos_id = _token_id(folder, tokenizer, "eos", names, config)
    if eos_id is None:
        raise ConfigError(
            f"{folder}: the model's tokenizer names no EOS token (eos_token in tokenizer_config.json or "
            "special_tokens_map.json, eos_token_id in config.json); add one, or set a tokenizer section in the recipe."
        )
    pad_id = _token_id(folder, tokenizer, "pad", names, config)
    bos_id = _token_id(folder, tokenizer, "bos", names, config)
    adds_bos = bos_id is not None and _adds_bos(tokenizer, bos_id, names.get("add_bos_token"))
    return SpecialTokens(eos_id=eos_id, pad_id=eos_id if pad_id is None else pad_id,
                         bos_id=bos_id if adds_bos else None)


def write_special_tokens(paths: RunPaths, special: SpecialTokens) -> None:
    """Record the run's special ids in ``tokenizer/special_tokens.json`` (atomically)."""
    paths.write_json(paths.special_tokens, asdict(special))


def read_special_tokens(paths: RunPaths) -> SpecialTokens:
    """The run's special ids: ``tokenizer/special_tokens.json`` when the tokenizer came from a model folder, else
    the named tokens of ``tokenizer/tokenizer.json`` (every run dir written before that file existed).

    Raises ConfigError when the tokenizer is missing, or the record is not one :func:`write_special_tokens` wrote.
    """
    if not paths.special_tokens.is_file():
        return named_special_tokens(load_tokenizer(paths.tokenizer))
    record = read_json(paths.special_tokens)
    try:
        return SpecialTokens(eos_id=int(record["eos_id"]), pad_id=int(record["pad_id"]),
                             bos_id=None if record.get("bos_id") is None else int(record["bos_id"]))
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"{paths.special_tokens}: not a special-tokens record ({err!r}); delete it and "
                          "tokenizer/ to re-run the tokenizer stage.") from None


def _token_names(folder: Path) -> dict[str, Any]:
    """eos_token/bos_token/pad_token strings (a dict's ``content``) and ``add_bos_token``, first file first."""
    names: dict[str, Any] = {}
    for name in reversed(TOKENIZER_FILES):
        names.update({key: value for key, value in _json_object(folder / name).items() if value is not None})
    return {key: value["content"] if isinstance(value, dict) and "content" in value else value
            for key, value in names.items()}


def _token_id(folder: Path, tokenizer: Tokenizer, kind: str, names: dict[str, Any],
              config: dict[str, Any]) -> int | None:
    """The id of the ``kind`` (eos/bos/pad) token: named by string in the tokenizer files, else config.json's id."""
    token = names.get(f"{kind}_token")
    if isinstance(token, str):
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ConfigError(f"{folder}: {kind}_token {token!r} is not a token of its tokenizer.json; fix "
                              f"{kind}_token in {' / '.join(TOKENIZER_FILES)}.")
        return token_id
    token_id = config.get(f"{kind}_token_id")
    if isinstance(token_id, list):
        token_id = token_id[0] if token_id else None
    if token_id is None:
        return None
    if not isinstance(token_id, int) or tokenizer.id_to_token(token_id) is None:
        raise ConfigError(f"{folder / HF_CONFIG_FILE}: {kind}_token_id {token_id!r} is not an id of the model's "
                          "tokenizer.json; fix it, or name the token in tokenizer_config.json.")
    return token_id


def _adds_bos(tokenizer: Tokenizer, bos_id: int, add_bos_token: Any) -> bool:
    """Whether the model's tokenizer starts a text with BOS: its config says so, or its post-processor does."""
    if isinstance(add_bos_token, bool):
        return add_bos_token
    ids = tokenizer.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos_id and tokenizer.encode("a", add_special_tokens=False).ids[:1] != [bos_id]


def _json_object(path: Path) -> dict[str, Any]:
    """A model folder's JSON file as a dict ({} when absent); ConfigError naming the file when it is not JSON."""
    if not path.is_file():
        return {}
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err}); fix or restore the model folder's file.") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: a JSON object expected, found {type(loaded).__name__}; fix the file.")
    return loaded
