"""The export carries the chat template the run's conversations were rendered with: ``apply_chat_template`` on
``model/`` renders what training saw (the base model's own template, or the run's template file instead)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from core.errors import ConfigError
from core.rundir import RunPaths
from tests.tokenization.chat import chat_tokenizers as ct
from tests.trainer.test_hf_models import save_tiny_model
from tokenization.chat.template import load_chat_template
from trainer.config import ModelConfig, ModelDims
from trainer.model.base_model import import_base_model
from trainer.model.export import export_model, hf_llama_config
from trainer.model.llama import ModelShape, build_model
from trainer.train import base_model_tokenizer_files, run_chat_template

MESSAGES = [{"role": "user", "content": "What is a tuple"}, {"role": "assistant", "content": "An immutable sequence"}]
RUN_TEMPLATE = "{{- 'Answer briefly.\n' }}" + ct.CHATML
"""The run's own template file: ChatML after a line of its own, so it renders unlike the base model's ChatML."""


@pytest.fixture(scope="module")
def chatml_tokenizer() -> Tokenizer:
    return ct.train_tokenizer(ct.CHATML_FAMILY)


def run_from_base_model(root: Path, tokenizer: Tokenizer, template: str | None, layout: str = "jinja") -> RunPaths:
    """A run dir whose base_model/ is a model folder with ``template`` (chat_template.jinja, or in
    tokenizer_config.json), brought in by the model stage, and whose tokenizer is that model's own (as the tokenizer
    stage copies it)."""
    source = ct.save_model_dir(root / "source", ct.CHATML_FAMILY, template, tokenizer)
    save_tiny_model(source, "llama", weights=False)
    if layout == "config":
        ct.move_template_into_tokenizer_config(source)
    paths = RunPaths(root / "run")
    import_base_model(paths, source, ModelConfig(hf_config=str(source)))
    paths.tokenizer_dir.mkdir(parents=True)
    shutil.copyfile(paths.base_model_tokenizer, paths.tokenizer)
    return paths


def exported_rendering(paths: RunPaths, chat_template_file: str | None = None) -> str:
    """The export's own rendering of MESSAGES, the files written as trainer.train writes them."""
    from transformers import AutoTokenizer

    shape = ModelShape(ModelDims(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32),
                       ct.VOCAB_SIZE + 16, 32)
    folder = export_model(build_model(shape, seed=0).state_dict(), hf_llama_config(shape), paths, paths.tokenizer,
                          tokenizer_extras=base_model_tokenizer_files(paths),
                          chat_template=run_chat_template(paths, chat_template_file))
    return AutoTokenizer.from_pretrained(folder).apply_chat_template(MESSAGES, tokenize=False)


@pytest.mark.parametrize("layout", ["jinja", "config"])
def test_the_export_renders_with_the_base_models_own_template(tmp_path: Path, chatml_tokenizer: Tokenizer,
                                                              layout: str) -> None:
    paths = run_from_base_model(tmp_path, chatml_tokenizer, ct.CHATML, layout)
    expected = load_chat_template(paths.base_model).render_text(MESSAGES)
    assert expected.startswith("<|im_start|>system\n")
    assert exported_rendering(paths) == expected


@pytest.mark.parametrize("layout", ["jinja", "config"])
def test_the_runs_template_file_replaces_the_base_models_in_the_export(tmp_path: Path, chatml_tokenizer: Tokenizer,
                                                                       layout: str) -> None:
    paths = run_from_base_model(tmp_path, chatml_tokenizer, ct.CHATML, layout)
    (paths.tokenizer_dir / "chat_template.jinja").write_text(RUN_TEMPLATE, encoding="utf-8")
    expected = load_chat_template(paths.base_model, paths.tokenizer_dir / "chat_template.jinja").render_text(MESSAGES)
    assert expected.startswith("Answer briefly.\n<|im_start|>system\n")
    assert exported_rendering(paths) == expected


def test_the_trainer_sections_template_file_wins_and_a_missing_one_is_one_line(tmp_path: Path,
                                                                                chatml_tokenizer: Tokenizer) -> None:
    paths = run_from_base_model(tmp_path, chatml_tokenizer, None)
    (paths.tokenizer_dir / "chat_template.jinja").write_text(ct.CHATML, encoding="utf-8")
    (paths.root / "chosen.jinja").write_text(RUN_TEMPLATE, encoding="utf-8")
    assert exported_rendering(paths, "chosen.jinja").startswith("Answer briefly.\n")
    with pytest.raises(ConfigError, match=r"missing\.jinja: cannot read the chat template to export"):
        run_chat_template(paths, "missing.jinja")
