"""A run dir prepared once per session from the preference corpus of
:mod:`tests.tokenization.preference.preference_run`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tokenization.chat.chat_run import prepare
from tests.tokenization.preference.preference_run import PreferenceCorpus, preference_corpus, write_recipe


@pytest.fixture(scope="session")
def preference_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreferenceCorpus]:
    """``tokenmill prepare`` once on the preference corpus: (run dir, corpus)."""
    corpus = preference_corpus()
    return prepare(write_recipe(tmp_path_factory.mktemp("preference-run"), corpus)), corpus
