"""Model dirs of four chat template families for preference data, built once per session (the chat tests'
tokenizers and templates, :mod:`tests.tokenization.chat.chat_tokenizers`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tokenization.chat import chat_tokenizers as ct

PREFERENCE_MODEL_DIRS = {
    "llama3": (ct.LLAMA3_FAMILY, ct.LLAMA3),
    "chatml": (ct.CHATML_FAMILY, ct.CHATML),
    "chatml_marked": (ct.CHATML_FAMILY, ct.CHATML_MARKED),
    "gemma": (ct.GEMMA_FAMILY, ct.GEMMA),
    "mistral": (ct.MISTRAL_FAMILY, ct.MISTRAL),
    "thinking": (ct.CHATML_FAMILY, ct.THINKING_ALWAYS_STRIPPED),
}
"""Model dir name -> (family, template): stock templates of the Llama-3, ChatML, Gemma and Mistral families, a
ChatML twin with ``{% generation %}`` markers, and a template that drops the reasoning it is given."""


@pytest.fixture(scope="session")
def preference_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("preference-models")
    tokenizers = {}
    dirs = {}
    for name, (family, template) in PREFERENCE_MODEL_DIRS.items():
        if family.name not in tokenizers:
            tokenizers[family.name] = ct.train_tokenizer(family)
        dirs[name] = ct.save_model_dir(root / name, family, template, tokenizers[family.name])
    return dirs
