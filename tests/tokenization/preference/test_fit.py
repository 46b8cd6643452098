"""tokenization/preference/fit.py and the stage under ``chat.truncation: truncate``: a pair whose two sides do not fit
one row is rejected (``error``) or keeps its prompt and has each completion cut so that it fits (``truncate``); a cut
that leaves both sides the same, or a prompt that leaves no room, is still a rejection."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from core.preference_pairs import parse_pair
from core.rundir import RunPaths
from core.stage import run_stage
from flows.run_sql import run_query
from pipeline.sql.query import data_funnel
from tests.tokenization.chat.chat_run import assistant, long_answer, user
from tests.tokenization.preference.preference_run import SEQ_LEN, PreferenceCorpus
from tests.tokenization.preference.test_preference_run import normalised, shard_pairs
from tokenization.chat.config import ChatConfig
from tokenization.chat.records import Rejection
from tokenization.chat.template import ChatTemplate, load_chat_template
from tokenization.preference.fit import completion_budgets, fit_pair
from tokenization.preference.masks import MaskedPair, mask_pair
from tokenization.preference.stage import PreferenceDataConfig, PreferenceDataStage

PreferenceRun = tuple[Path, PreferenceCorpus]


@pytest.fixture()
def template(preference_run: PreferenceRun) -> ChatTemplate:
    return load_chat_template(RunPaths(preference_run[0]).base_model)


def masked(template: ChatTemplate, record: dict) -> MaskedPair:
    pair = mask_pair(template, parse_pair(record))
    assert isinstance(pair, MaskedPair), pair
    return pair


@pytest.mark.parametrize(("chosen", "rejected", "budget", "kept"), [
    (10, 100, 50, (10, 40)),  # the short answer keeps all it has; the long one the rest
    (100, 10, 50, (40, 10)),
    (100, 100, 50, (25, 25)),
    (30, 40, 50, (25, 25)),
    (30, 40, 51, (25, 26)),
])
def test_the_shorter_completion_keeps_up_to_half_and_the_longer_the_rest(chosen: int, rejected: int, budget: int,
                                                                        kept: tuple[int, int]) -> None:
    assert completion_budgets(chosen, rejected, budget) == kept


def test_a_pair_that_fits_is_unchanged_and_one_that_does_not_is_too_many_tokens(
        template: ChatTemplate, preference_run: PreferenceRun) -> None:
    corpus = preference_run[1]
    short = masked(template, corpus.pairs[0])
    assert fit_pair(short, SEQ_LEN, "error") is short
    long = masked(template, corpus.too_long)
    rejection = fit_pair(long, SEQ_LEN, "error")
    assert isinstance(rejection, Rejection) and rejection.code == "too_many_tokens"


def test_truncate_keeps_the_prompt_and_cuts_each_completion_to_fit(template: ChatTemplate,
                                                                  preference_run: PreferenceRun) -> None:
    long = masked(template, preference_run[1].too_long)
    fitted = fit_pair(long, SEQ_LEN, "truncate")
    assert isinstance(fitted, MaskedPair)
    prompt = long.num_prompt_tokens
    assert fitted.num_prompt_tokens == prompt and fitted.prompt_ids == long.prompt_ids
    assert len(fitted.chosen.input_ids) + len(fitted.rejected.input_ids) == SEQ_LEN  # the row, filled
    for cut, whole in ((fitted.chosen, long.chosen), (fitted.rejected, long.rejected)):
        assert cut.input_ids == whole.input_ids[:len(cut.input_ids)]  # a prefix: the completion cut at its end
        assert cut.loss_mask == whole.loss_mask[:len(cut.loss_mask)] and sum(cut.loss_mask[prompt:]) > 0


def test_a_cut_that_leaves_both_sides_the_same_or_a_prompt_too_long_is_still_rejected(
        template: ChatTemplate, preference_run: PreferenceRun) -> None:
    rejection = fit_pair(masked(template, preference_run[1].same_once_cut), SEQ_LEN, "truncate")
    assert isinstance(rejection, Rejection) and rejection.code == "identical_sides"
    long_prompt = {"prompt": [user(long_answer(60))], "chosen": [assistant("Yes.")], "rejected": [assistant("No.")]}
    rejection = fit_pair(masked(template, long_prompt), SEQ_LEN, "truncate")
    assert isinstance(rejection, Rejection) and rejection.code == "too_many_tokens"
    assert "the prompt is" in rejection.reason


def test_the_stage_under_truncate_packs_the_long_pair_cut(tmp_path: Path, preference_run: PreferenceRun) -> None:
    run, corpus = preference_run
    shutil.copytree(run, tmp_path / "run")
    paths = RunPaths(tmp_path / "run")
    config = PreferenceDataConfig(model_dir=paths.base_model, chat=ChatConfig(truncation="truncate"), seq_len=SEQ_LEN,
                                  rows_per_shard=4)
    stage = PreferenceDataStage(paths, config, ["pairs"])
    for unit in stage.units():
        assert not run_stage(stage, unit).skipped  # truncation changed: every unit is redone
        assert run_stage(stage, unit).skipped  # and then done
    rejects = [row for split in ("train", "val")
               for row in pq.read_table(paths.preference_rejects(split, "pairs")).to_pylist()]
    assert [(json.loads(row["raw"]), row["reason"]) for row in rejects] == [
        (json.loads(normalised(corpus.same_once_cut)), "identical_sides")]
    documents = run_query(paths.root, "SELECT doc_id, record FROM documents").to_pylist()
    doc_id = next(row["doc_id"] for row in documents if row["record"] == normalised(corpus.too_long))
    chosen_ids, _, rejected_ids, _ = shard_pairs(paths.root)[doc_id]
    assert len(chosen_ids) + len(rejected_ids) == SEQ_LEN
    # a stage reject whose reason ingest also gives (identical_sides) is still a document: read once, not rejected
    (funnel,) = data_funnel(paths.root)
    assert (funnel["records_read"], funnel["rejected"]) == (len(corpus.lines), len(corpus.bad))


def test_the_truncation_setting_is_in_the_fingerprint_and_the_loss_mode_is_not(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    fingerprints = {json.dumps(chat.model_dump()): PreferenceDataStage(
        paths, PreferenceDataConfig(model_dir=tmp_path, chat=chat), ["pairs"]).inputs("split=train/source=pairs")
        .fingerprint() for chat in (ChatConfig(), ChatConfig(loss="all"), ChatConfig(truncation="truncate"))}
    assert len(set(fingerprints.values())) == 2
