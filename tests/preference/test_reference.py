"""trainer/preference/reference.py: reference log-probs stored per pair equal the recomputed ones, are refused when
computed with another model, and training on them gives the loss of a reference computed on the fly."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import duckdb
import pytest
import torch

from core.errors import ShardFormatError
from core.rundir import RunPaths
from tests.preference.pairs import RECORDS
from tests.preference.trl_dpo import tiny_llama
from tokenization.chat.template import load_chat_template
from tokenization.preference.masks import MaskedPair, mask_pair
from tokenization.preference.records import parse_pair
from trainer.preference.dpo_loss import PairLogps, dpo_loss
from trainer.preference.pair_batch import PairBatch, pack_pairs, pad_pairs, pair_logps
from trainer.preference.reference import compute_reference_logps, reference_logps_for, store_reference_logps
from trainer.preference.reference_store import PairKey, read_reference_logps, reference_model_sha256

SOURCE = "tiny-prefs"


@pytest.fixture(scope="module")
def pairs(preference_model_dirs: dict[str, Path]) -> list[MaskedPair]:
    """Six pairs: the shared records with Mistral's template, twice (each twice as a different doc id)."""
    template = load_chat_template(preference_model_dirs["mistral"])
    masked = [mask_pair(template, parse_pair(record)) for record in RECORDS] * 2
    assert all(isinstance(pair, MaskedPair) for pair in masked)
    return masked


@pytest.fixture(scope="module")
def vocab_size(preference_model_dirs: dict[str, Path]) -> int:
    return len(load_chat_template(preference_model_dirs["mistral"]).tokenizer)


def keys(count: int) -> list[PairKey]:
    return [PairKey(100 + index, "train", SOURCE) for index in range(count)]


def saved_reference(folder: Path, vocab_size: int, seed: int) -> tuple[torch.nn.Module, str]:
    model = tiny_llama(vocab_size, seed)
    model.save_pretrained(str(folder))
    return model, reference_model_sha256(folder)


def packed_batches(pairs: list[MaskedPair]) -> list[PairBatch]:
    """As the stage would batch them: four pairs, then two, packed into rows of 128 tokens."""
    return [pack_pairs(pairs[:4], 128, pad_id=0), pack_pairs(pairs[4:], 128, pad_id=0)]


def precompute(reference: torch.nn.Module, pairs: list[MaskedPair], sha256: str, run_dir: Path) -> Path:
    """The stored file of every pair's reference log-probs, in ``run_dir``."""
    path = run_dir / "reference_logps.parquet"
    logps = compute_reference_logps(reference, packed_batches(pairs))
    store_reference_logps(RunPaths(run_dir), path, keys(len(pairs)), logps, sha256)
    return path


def test_stored_values_equal_recomputed_ones_and_sql_reads_them(pairs: list[MaskedPair], vocab_size: int,
                                                                tmp_path: Path) -> None:
    reference, sha256 = saved_reference(tmp_path / "reference", vocab_size, seed=1)
    path = precompute(reference, pairs, sha256, tmp_path / "run")
    assert [item.name for item in path.parent.iterdir()] == [path.name]  # no temporary file left
    table = read_reference_logps(path, sha256)
    same_layout = compute_reference_logps(reference, packed_batches(pairs))
    in_order = reference_logps_for(table, keys(len(pairs)))
    assert torch.equal(in_order.chosen, same_layout.chosen) and torch.equal(in_order.rejected, same_layout.rejected)
    stored = reference_logps_for(table, list(reversed(keys(len(pairs)))))
    with torch.no_grad():
        recomputed = pair_logps(reference, pad_pairs(list(reversed(pairs)), pad_id=0))
    torch.testing.assert_close(stored.chosen, recomputed.chosen, atol=1e-5, rtol=0)
    torch.testing.assert_close(stored.rejected, recomputed.rejected, atol=1e-5, rtol=0)
    assert stored.chosen[0] != stored.chosen[1]  # the lookup follows the keys, not the file's order
    rows = duckdb.execute("SELECT doc_id, rejected_logp, reference_sha256 FROM read_parquet(?) ORDER BY doc_id",
                          [str(path)]).fetchall()
    assert [row[0] for row in rows] == [key.doc_id for key in keys(len(pairs))]
    assert rows[0][1] == pytest.approx(recomputed.rejected[-1].item(), abs=1e-5) and rows[0][2] == sha256


def test_log_probs_of_another_reference_model_or_pair_are_refused(pairs: list[MaskedPair], vocab_size: int,
                                                                  tmp_path: Path) -> None:
    reference, sha256 = saved_reference(tmp_path / "reference", vocab_size, seed=1)
    _, other_sha256 = saved_reference(tmp_path / "other", vocab_size, seed=2)
    assert other_sha256 != sha256 and reference_model_sha256(tmp_path / "reference") == sha256
    path = precompute(reference, pairs, sha256, tmp_path / "run")
    with pytest.raises(ShardFormatError, match=f"{path}: computed with reference model {sha256[:12]}, not "
                                               f"{other_sha256[:12]}; recompute"):
        read_reference_logps(path, other_sha256)
    with pytest.raises(ShardFormatError, match=r"no reference log-probs for pair \(doc id 109\) of split 'train', "
                                               "source 'tiny-prefs'"):
        reference_logps_for(read_reference_logps(path, sha256), [PairKey(109, "train", SOURCE)])
    with pytest.raises(ShardFormatError, match="of split 'val'"):  # the same doc id in another split is another pair
        reference_logps_for(read_reference_logps(path, sha256), [PairKey(100, "val", SOURCE)])


def test_training_on_stored_reference_log_probs_equals_computing_them_on_the_fly(pairs: list[MaskedPair],
                                                                                 vocab_size: int,
                                                                                 tmp_path: Path) -> None:
    """Three optimizer steps of two pairs each: the reference's log-probs read from the file (computed in another
    layout) or computed every step by the reference model give the same losses and the same weights."""
    reference, sha256 = saved_reference(tmp_path / "reference", vocab_size, seed=1)
    path = precompute(reference, pairs, sha256, tmp_path / "run")
    stored = read_reference_logps(path, sha256)
    start = tiny_llama(vocab_size, seed=0)
    on_the_fly, from_file = copy.deepcopy(start), copy.deepcopy(start)

    def reference_on_the_fly(batch: PairBatch, _: list[PairKey]) -> PairLogps:
        with torch.no_grad():
            return pair_logps(reference, batch)

    def reference_from_file(_: PairBatch, batch_keys: list[PairKey]) -> PairLogps:
        return reference_logps_for(stored, batch_keys)

    losses = {"on_the_fly": train(on_the_fly, pairs, reference_on_the_fly),
              "from_file": train(from_file, pairs, reference_from_file)}
    assert losses["from_file"] == pytest.approx(losses["on_the_fly"], abs=1e-6)
    assert len(set(losses["on_the_fly"])) == 3
    for trained, other in zip(on_the_fly.parameters(), from_file.parameters(), strict=True):
        torch.testing.assert_close(trained, other, atol=1e-6, rtol=0)
    assert not torch.equal(next(on_the_fly.parameters()), next(start.parameters()))


def train(policy: torch.nn.Module, pairs: list[MaskedPair],
          reference_of: Callable[[PairBatch, list[PairKey]], PairLogps]) -> list[float]:
    """Three AdamW steps of two padded pairs each; the loss of each step."""
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        batch = pad_pairs(pairs[2 * step:2 * step + 2], pad_id=0)
        result = dpo_loss(pair_logps(policy, batch), reference_of(batch, keys(len(pairs))[2 * step:2 * step + 2]),
                          beta=0.5)
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()
        losses.append(result.loss.item())
    return losses


def test_the_stored_file_and_the_pair_records_need_no_torch() -> None:
    """A stage declares and ``tokenmill status`` reads these without importing torch."""
    code = ("import sys; import trainer.preference.reference_store, tokenization.preference.records; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
