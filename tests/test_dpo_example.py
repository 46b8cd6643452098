"""The worked DPO example (configs/dpo.yaml): it continues from the SFT example's export with the SFT example's
template, and every pair of its corpus renders and masks with that template on the quick start's kind of tokenizer,
each side's loss on its own answer only.

Running the example end to end is the README test's job (it needs the quick start's and the SFT example's runs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.trainer.quick_start_model import SFT_TEMPLATE, quick_start_like_export
from tokenization.chat.template import ChatTemplate, load_chat_template
from tokenization.preference.masks import MaskedPair, mask_pair
from tokenization.preference.records import PreferencePair, parse_pair

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "dpo.yaml"
SFT_RECIPE = REPO / "configs" / "sft.yaml"
CORPUS = REPO / "data_manifests" / "python-stdlib-preference.jsonl"


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    folder = quick_start_like_export(tmp_path_factory.mktemp("dpo-example") / "run", with_template=True)
    return load_chat_template(folder, SFT_TEMPLATE)


def trained_text(template: ChatTemplate, input_ids: list[int], loss_mask: list[int]) -> str:
    return template.tokenizer.decode([token for token, mark in zip(input_ids, loss_mask, strict=True) if mark])


def test_each_side_trains_on_its_own_answer_after_the_same_prompt(template: ChatTemplate) -> None:
    records = [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines()[::7]]
    for record in records:
        pair = parse_pair(record)
        assert isinstance(pair, PreferencePair), pair
        masked = mask_pair(template, pair)
        assert isinstance(masked, MaskedPair), (record["id"], masked)
        for side, result in (("chosen", masked.chosen), ("rejected", masked.rejected)):
            assert trained_text(template, result.input_ids, result.loss_mask) == \
                getattr(pair, side)[0].content + "<|endoftext|>"
        prompt = template.tokenizer.decode(masked.prompt_ids)
        assert prompt.endswith("### Assistant:\n") and pair.prompt[-1].content in prompt


def test_the_recipe_tunes_the_sft_examples_export_with_its_template_on_the_built_in_pairs() -> None:
    recipe = yaml.safe_load(RECIPE.read_text(encoding="utf-8"))
    sft = yaml.safe_load(SFT_RECIPE.read_text(encoding="utf-8"))
    base = RECIPE.parent
    assert (base / recipe["model"]["from_pretrained"]).resolve() == (REPO / "runs" / sft["name"] / "model").resolve()
    assert (base / recipe["chat"]["template_file"]).resolve() == (base / sft["chat"]["template_file"]).resolve()
    assert [(base / name).resolve() for name in recipe["data"]["manifests"]] == \
        [REPO / "data_manifests" / "python-stdlib-preference.yaml"]
    assert (recipe["train"]["mode"], recipe["train"]["dpo"]["beta"]) == ("dpo", 0.1)
    assert recipe["pack"]["seq_len"] == sft["pack"]["seq_len"], "the tiny model's context length"
    assert recipe["train"]["max_steps"] <= 200 and recipe["eval"]["checkpoints"] == "last"
    assert "tokenizer" not in recipe, "the model's own tokenizer"
