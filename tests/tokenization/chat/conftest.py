"""Model dirs of four chat template families (stock and ``{% generation %}``-marked) plus thinking templates, built
once per session (a BPE per family trains in ~0.1 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tokenization.chat import chat_tokenizers as ct
from tests.tokenization.chat.chat_run import ChatCorpus, chat_corpus, prepare, write_recipe

MODEL_DIRS = {
    "llama3": (ct.LLAMA3_FAMILY, ct.LLAMA3),
    "llama3_marked": (ct.LLAMA3_FAMILY, ct.LLAMA3_MARKED),
    "chatml": (ct.CHATML_FAMILY, ct.CHATML),
    "chatml_marked": (ct.CHATML_FAMILY, ct.CHATML_MARKED),
    "gemma": (ct.GEMMA_FAMILY, ct.GEMMA),
    "gemma_marked": (ct.GEMMA_FAMILY, ct.GEMMA_MARKED),
    "mistral": (ct.MISTRAL_FAMILY, ct.MISTRAL),
    "mistral_marked": (ct.MISTRAL_FAMILY, ct.MISTRAL_MARKED),
    "thinking": (ct.CHATML_FAMILY, ct.THINKING),
    "thinking_marked": (ct.CHATML_FAMILY, ct.THINKING_MARKED),
    "thinking_always_stripped": (ct.CHATML_FAMILY, ct.THINKING_ALWAYS_STRIPPED),
    "chatml_no_template": (ct.CHATML_FAMILY, None),
}
"""Model dir name -> (family, template); the stock and marked twins render the same text."""


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-models")
    tokenizers = {}
    dirs = {}
    for name, (family, template) in MODEL_DIRS.items():
        if family.name not in tokenizers:
            tokenizers[family.name] = ct.train_tokenizer(family)
        dirs[name] = ct.save_model_dir(root / name, family, template, tokenizers[family.name])
    return dirs


@pytest.fixture(scope="session")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ChatCorpus]:
    """``tokenmill prepare`` once on the chat corpus of :mod:`tests.tokenization.chat.chat_run`: (run dir, corpus)."""
    corpus = chat_corpus()
    return prepare(write_recipe(tmp_path_factory.mktemp("chat-run"), corpus)), corpus
