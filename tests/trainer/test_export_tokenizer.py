"""The export's tokenizer files tell transformers the EOS and pad tokens, as the README's loading lines use them.

``AutoTokenizer.from_pretrained(model_dir)`` and ``PreTrainedTokenizerFast.from_pretrained(model_dir)`` read
``tokenizer_config.json``. ``PreTrainedTokenizerFast(tokenizer_file=…)`` reads tokenizer.json alone, which has
no field naming EOS in transformers 5 (its constructor takes special tokens from its arguments only), so the
README passes them, as written in the export's tokenizer_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from core.rundir import RunPaths
from tests.conftest import STDLIB
from tests.trainer.test_hf_models import save_tiny_model
from tokenization.train_tokenizer import EOS_TOKEN, PAD_TOKEN, train_tokenizer
from trainer.config import ModelDims
from trainer.model.export import export_model, hf_llama_config
from trainer.model.llama import ModelShape, build_model

DIMS = ModelDims(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)


def trained_tokenizer(folder: Path) -> Path:
    texts = [path.read_text() for path in sorted((STDLIB / "json").glob("*.py"))]
    folder.mkdir(parents=True, exist_ok=True)
    train_tokenizer(texts, vocab_size=400).save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


@pytest.fixture
def export_dir(tmp_path: Path) -> Path:
    """A real export of the built-in model with a tokenizer tokenmill trained (the quick start's kind)."""
    tokenizer_json = trained_tokenizer(tmp_path / "tokenizer")
    shape = ModelShape(DIMS, Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(), 32)
    return export_model(build_model(shape, seed=3).state_dict(), hf_llama_config(shape), RunPaths(tmp_path),
                        tokenizer_json)


def special_tokens_of(tokenizer: object) -> tuple[object, ...]:
    return (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token, tokenizer.pad_token_id)


def test_auto_tokenizer_and_fast_from_pretrained_know_eos_and_pad(export_dir: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    expected = (EOS_TOKEN, 0, PAD_TOKEN, 1)
    assert special_tokens_of(AutoTokenizer.from_pretrained(export_dir)) == expected
    assert special_tokens_of(PreTrainedTokenizerFast.from_pretrained(export_dir)) == expected
    padded = AutoTokenizer.from_pretrained(export_dir)(["def f():", "x"], padding=True)["input_ids"]
    assert padded[1][-1] == 1, "padding uses <|pad|>, id 1"


def test_the_readme_line_for_tokenizer_file_knows_eos_and_pad(export_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    config = json.loads((export_dir / "tokenizer_config.json").read_text())
    readme = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text(encoding="utf-8")
    line = ('PreTrainedTokenizerFast(tokenizer_file="runs/tiny/model/tokenizer.json", '
            f'eos_token="{config["eos_token"]}", pad_token="{config["pad_token"]}")')
    assert line in readme
    bare = PreTrainedTokenizerFast(tokenizer_file=str(export_dir / "tokenizer.json"))
    assert bare.eos_token is None, "tokenizer.json alone names no EOS: the README must pass it"
    given = PreTrainedTokenizerFast(tokenizer_file=str(export_dir / "tokenizer.json"), eos_token=config["eos_token"],
                                    pad_token=config["pad_token"])
    assert special_tokens_of(given) == (EOS_TOKEN, 0, PAD_TOKEN, 1)


def test_a_model_tokenizer_without_a_pad_token_exports_the_eos_it_padded_with(tmp_path: Path) -> None:
    """A GPT-2-style tokenizer has no pad token; tokenmill pads with EOS, and the export says so."""
    from transformers import AutoTokenizer

    folder = save_tiny_model(tmp_path / "gpt2", "gpt2", vocab_size=400, pad_token_id=None)
    tokenizer_json = trained_tokenizer(folder)
    own_config = folder / "tokenizer_config.json"
    own_config.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN,
                                      "model_max_length": 128}))
    config = json.loads((folder / "config.json").read_text())
    export = export_model({}, config, RunPaths(tmp_path), tokenizer_json, tokenizer_extras=[own_config])
    loaded = AutoTokenizer.from_pretrained(export)
    assert special_tokens_of(loaded) == (EOS_TOKEN, 0, EOS_TOKEN, 0)
    exported = json.loads((export / "tokenizer_config.json").read_text())
    assert exported["model_max_length"] == 128, "the model's own settings are kept"
    assert json.loads(own_config.read_text()).get("pad_token") is None, "the base model's file is not changed"
