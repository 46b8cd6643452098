"""core/config.py: a validation error is one line per problem, and an unknown key names the key it is near."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.config import describe_validation_error
from flows.recipe import RunRecipe
from pipeline.manifest import CorpusManifest

RECIPE = {"name": "x", "data": {"manifests": ["m.yaml"]}, "tokenizer": {"vocab_size": 512}}
MANIFEST = {"name": "m", "sources": [{"name": "s", "path": "corpus", "format": "text"}]}


def message(model: type, data: dict) -> str:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(data)
    return describe_validation_error(caught.value, "f.yaml", model)


@pytest.mark.parametrize(("model", "data", "expected"), [
    (RunRecipe, {**RECIPE, "train": {"max_stpes": 3}},
     "f.yaml: train.max_stpes: unknown key (misspelt?); did you mean `max_steps`?"),
    (RunRecipe, {**RECIPE, "tokeniser": {}}, "f.yaml: tokeniser: unknown key (misspelt?); did you mean `tokenizer`?"),
    (CorpusManifest, {**MANIFEST, "sources": [{**MANIFEST["sources"][0], "text_feild": "t"}]},
     "f.yaml: sources.0.text_feild: unknown key (misspelt?); did you mean `text_field`?"),
    (CorpusManifest, {**MANIFEST, "filters": {"max_charz": 10}},
     "f.yaml: filters.max_charz: unknown key (misspelt?); did you mean `max_chars`?"),
], ids=["recipe-nested", "recipe-top", "manifest-list-item", "manifest-filters"])
def test_an_unknown_key_names_the_near_one(model: type, data: dict, expected: str) -> None:
    assert message(model, data).startswith(expected)


def test_a_key_near_nothing_gets_no_guess() -> None:
    text = message(RunRecipe, {**RECIPE, "train": {"zzzz": 3}})
    assert "train.zzzz: unknown key (misspelt?); remove it" in text and "did you mean" not in text
