"""tokenization/special_tokens.py and the model-folder tokenizer stage: a model's own EOS/BOS/pad ids, end to end
into packed shards (GPT-2, Llama and Qwen2 style folders built locally)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from core.errors import ConfigError
from core.rundir import RunPaths
from tests.tokenization.model_folders import (
    VOCAB_SIZE,
    byte_level_bpe,
    gpt2_folder,
    llama_folder,
    qwen2_folder,
    write_model_folder,
)
from tests.tokenization.test_stage import read_rows, stdlib_texts, write_docs_part
from tokenization.config import PackConfig, TokenizerConfig
from tokenization.pack import Packer
from tokenization.special_tokens import (
    SpecialTokens,
    load_tokenizer,
    model_special_tokens,
    read_special_tokens,
    write_special_tokens,
)
from tokenization.stage import pack_split_source, write_index
from tokenization.train_tokenizer import check_tokenizer_fits, prepare_tokenizer


def special_of(folder: Path) -> SpecialTokens:
    return model_special_tokens(folder, load_tokenizer(folder / "tokenizer.json"))


def test_gpt2_style_has_eos_pads_with_it_and_adds_no_bos(tmp_path: Path) -> None:
    special = special_of(gpt2_folder(tmp_path))
    assert special == SpecialTokens(eos_id=0, pad_id=0, bos_id=None) and special.pad_is_eos


@pytest.mark.parametrize("add_bos_token", [True, None])
def test_llama_style_bos_is_found_from_its_config_or_post_processor(tmp_path: Path,
                                                                    add_bos_token: bool | None) -> None:
    special = special_of(llama_folder(tmp_path, add_bos_token))
    assert special == SpecialTokens(eos_id=2, pad_id=2, bos_id=1)


def test_add_bos_token_false_means_no_bos(tmp_path: Path) -> None:
    assert special_of(llama_folder(tmp_path, add_bos_token=False)).bos_id is None


def test_qwen2_style_pads_with_its_named_pad_token_and_config_ids_are_a_fallback(tmp_path: Path) -> None:
    assert special_of(qwen2_folder(tmp_path / "named")) == SpecialTokens(eos_id=0, pad_id=0, bos_id=None)
    # Without tokenizer_config.json: config.json's eos_token_id list gives its first id; bos 0 is never added.
    assert special_of(qwen2_folder(tmp_path / "ids", tokenizer_config=False)) == SpecialTokens(0, 0, None)


def test_a_folder_saved_by_transformers_gives_the_same_ids(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = byte_level_bpe(["<unk>", "<s>", "</s>", "<pad>"], bos="<s>")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(tmp_path)
    transformers.AutoConfig.for_model("llama", vocab_size=VOCAB_SIZE, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=3).save_pretrained(tmp_path)
    assert special_of(tmp_path) == SpecialTokens(eos_id=2, pad_id=3, bos_id=1)


def test_no_eos_anywhere_is_an_error_naming_the_folder(tmp_path: Path) -> None:
    folder = write_model_folder(tmp_path / "model", byte_level_bpe(["<unk>"]), None, {"vocab_size": VOCAB_SIZE})
    with pytest.raises(ConfigError, match=r"model: the model's tokenizer names no EOS token \(eos_token"):
        special_of(folder)


def test_a_named_token_missing_from_the_tokenizer_is_an_error_naming_the_key(tmp_path: Path) -> None:
    folder = gpt2_folder(tmp_path)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ConfigError, match=r"eos_token '</s>' is not a token of its tokenizer.json"):
        special_of(folder)


def test_special_tokens_round_trip_and_a_trained_run_keeps_the_named_ids(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    paths.tokenizer.parent.mkdir(parents=True)
    trained = byte_level_bpe(["<|endoftext|>", "<|pad|>"])
    trained.save(str(paths.tokenizer))
    assert read_special_tokens(paths) == SpecialTokens(eos_id=0, pad_id=1, bos_id=None)  # no special_tokens.json
    write_special_tokens(paths, SpecialTokens(eos_id=2, pad_id=2, bos_id=1))
    assert read_special_tokens(paths) == SpecialTokens(eos_id=2, pad_id=2, bos_id=1)


def test_model_tokenizer_is_copied_byte_for_byte_warns_once_and_is_skipped_after(tmp_path: Path) -> None:
    folder, paths = gpt2_folder(tmp_path / "model"), RunPaths(tmp_path / "run")
    with pytest.warns(UserWarning, match=r"no pad token; padding uses its EOS id 0 and those padding labels are mas"):
        summary = prepare_tokenizer(paths, None, None, model_folder=folder)
    assert paths.tokenizer.read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert read_special_tokens(paths) == SpecialTokens(eos_id=0, pad_id=0, bos_id=None)
    assert summary["vocab_size"] == VOCAB_SIZE and summary["trained"] is False
    assert paths.marker("tokenizer").is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is skipped: no second warning
        assert prepare_tokenizer(paths, None, None, model_folder=folder) == {**summary, "skipped": True}


def test_a_model_folder_without_tokenizer_json_asks_for_a_tokenizer_section(tmp_path: Path) -> None:
    folder = gpt2_folder(tmp_path / "model")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"model: the model folder has no tokenizer.json.*add a tokenizer section"):
        prepare_tokenizer(RunPaths(tmp_path / "run"), None, None, model_folder=folder)


@pytest.mark.filterwarnings("ignore:.*no pad token:UserWarning")
def test_a_tokenizer_larger_than_the_embedding_is_an_error_naming_both_numbers(tmp_path: Path) -> None:
    folder, paths = gpt2_folder(tmp_path / "model", vocab_size=300), RunPaths(tmp_path / "run")
    with pytest.raises(ConfigError, match=r"config.json vocab_size: the tokenizer has 400 ids but the model's "
                                          r"embedding has only 300 rows"):
        prepare_tokenizer(paths, None, None, model_folder=folder)
    assert not paths.marker("tokenizer").exists()


def test_a_trained_tokenizer_is_checked_against_the_model_too(tmp_path: Path) -> None:
    folder, paths = gpt2_folder(tmp_path / "model", vocab_size=300), RunPaths(tmp_path / "run")
    write_docs_part(paths.root, 0, stdlib_texts(100_000))
    config = TokenizerConfig(vocab_size=400, sample_bytes=100_000)
    with pytest.raises(ConfigError, match=r"400 ids but the model's embedding has only 300 rows"):
        prepare_tokenizer(paths, config, None, model_folder=folder)
    prepare_tokenizer(paths, config.model_copy(update={"vocab_size": 300}), None, model_folder=folder)
    assert read_special_tokens(paths) == SpecialTokens(eos_id=0, pad_id=1, bos_id=None)


def test_check_tokenizer_fits_names_both_numbers_and_the_keys() -> None:
    check_tokenizer_fits(300, 300, "model")
    with pytest.raises(ConfigError, match=r"^base_model: the tokenizer has 301 ids .* only 300 rows.*tokenizer\.path"
                                          r" or tokenizer\.vocab_size of at most 300.*model\.hf_config"):
        check_tokenizer_fits(301, 300, "base_model")


def test_packer_puts_bos_before_each_document_and_its_start_points_at_it() -> None:
    packer = Packer(seq_len=8, eos_id=2, pad_id=2, dtype=np.uint16, bos_id=1)
    for doc_id, length in enumerate([3, 9, 0, 2]):
        packer.add(doc_id, np.full(length, 10 + doc_id))
    rows = packer.finish()
    flat = rows.input_ids.reshape(-1)
    assert packer.num_added_tokens == 3 + 9 + 0 + 2 + 4 * 2 == sum(rows.num_tokens)
    assert flat[:22].tolist() == [1, 10, 10, 10, 2, 1, *[11] * 9, 2, 1, 2, 1, 13, 13, 2]
    lineage = zip(rows.doc_starts, rows.first_doc_offset, strict=True)
    starts = [row * 8 + start for row, (row_starts, offset) in enumerate(lineage)
              for k, start in enumerate(row_starts) if k or not offset]  # not a document begun in an earlier row
    assert starts == [0, 5, 16, 18] and flat[starts].tolist() == [1, 1, 1, 1]


@pytest.mark.filterwarnings("ignore:.*no pad token:UserWarning")
def test_shards_of_a_llama_style_model_start_every_document_with_bos(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    prepare_tokenizer(paths, None, None, model_folder=llama_folder(tmp_path / "model"))
    texts = write_docs_part(paths.root, 0, stdlib_texts(60_000))
    config = PackConfig(seq_len=64, rows_per_shard=50, encode_batch_docs=4)
    for split in ("train", "val"):
        for source in ("lib", "tests"):
            pack_split_source(paths, split, source, config)
    tokenizer = load_tokenizer(paths.tokenizer)
    num_documents = 0
    for info in write_index(paths):
        tokens, doc_ids, doc_starts, offsets = read_rows(paths.root / info.path)
        for row, (ids, starts, offset) in enumerate(zip(doc_ids, doc_starts, offsets, strict=True)):
            for k, (doc_id, start) in enumerate(zip(ids, starts, strict=True)):
                if k == 0 and offset > 0:
                    continue  # began in an earlier row
                assert tokens[row, start] == 1, f"document {doc_id} does not start with BOS"
                following = tokens[row, start + 1:start + 9].tolist()
                expected = tokenizer.encode(texts[doc_id], add_special_tokens=False).ids[:len(following)]
                assert following == expected
                num_documents += 1
    assert num_documents == len(texts)
