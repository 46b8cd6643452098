"""trainer/preference/dpo_loss.py: the loss and reward metrics of a batch equal TRL's DPOTrainer on the same tiny
model, reference and records (fp32, 1e-5), cDPO's label smoothing and SimPO equal TRL's own code, padded or packed."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from trl.experimental.cpo import CPOTrainer

from tests.preference.pairs import RECORDS, as_conversational
from tests.preference.trl_dpo import dpo_trainer, tiny_llama, trl_loss
from tokenization.chat.template import load_chat_template
from tokenization.preference.masks import MaskedPair, mask_pair
from tokenization.preference.records import parse_pair
from trainer.preference.dpo_loss import PairLogps, dpo_loss, mean_logps, simpo_loss
from trainer.preference.pair_batch import num_loss_tokens, pack_pairs, pad_pairs, pair_logps

TOLERANCE = 1e-5
BETA = 0.3


def masked_pairs(model_dir: Path) -> list[MaskedPair]:
    """The shared records rendered with Mistral's template, whose masks are TRL's token for token (test_masks)."""
    template = load_chat_template(model_dir)
    pairs = [mask_pair(template, parse_pair(record)) for record in RECORDS]
    assert all(isinstance(pair, MaskedPair) for pair in pairs)
    return pairs


@pytest.fixture(scope="module")
def mistral_models(preference_model_dirs: dict[str, Path]) -> tuple[torch.nn.Module, torch.nn.Module]:
    vocab_size = len(load_chat_template(preference_model_dirs["mistral"]).tokenizer)
    return tiny_llama(vocab_size, seed=0), tiny_llama(vocab_size, seed=1)


def test_sigmoid_dpo_loss_and_rewards_equal_trls_dpo_trainer_padded_and_packed(
        preference_model_dirs: dict[str, Path], mistral_models: tuple[torch.nn.Module, torch.nn.Module],
        tmp_path: Path) -> None:
    policy, reference = mistral_models
    trainer = dpo_trainer(preference_model_dirs["mistral"], [as_conversational(r) for r in RECORDS], tmp_path,
                          policy, reference, beta=BETA)
    expected_loss, expected = trl_loss(trainer, list(range(len(RECORDS))))
    pairs = masked_pairs(preference_model_dirs["mistral"])
    for batch in (pad_pairs(pairs, pad_id=0), pack_pairs(pairs, seq_len=256, pad_id=0)):
        with torch.no_grad():
            reference_logps = pair_logps(reference, batch)
        result = dpo_loss(pair_logps(policy, batch), reference_logps, beta=BETA)
        metrics = result.metrics()
        assert result.loss.item() == pytest.approx(expected_loss, abs=TOLERANCE)
        for name in ("chosen", "rejected"):
            assert metrics[f"rewards/{name}"] == pytest.approx(expected[f"rewards/{name}"], abs=TOLERANCE)
        assert metrics["rewards/accuracy"] == expected["rewards/accuracies"]
        assert metrics["rewards/margin"] == pytest.approx(expected["rewards/margins"], abs=TOLERANCE)
    assert abs(expected["rewards/margins"]) > 100 * TOLERANCE  # the policy and the reference differ
    assert batch.input_ids.shape[0] < 2 * len(pairs)  # the packed batch did pack


def test_label_smoothing_is_conservative_dpo_as_trls_aot_loss_gives_it_for_one_pair(
        preference_model_dirs: dict[str, Path], mistral_models: tuple[torch.nn.Module, torch.nn.Module],
        tmp_path: Path) -> None:
    """TRL 1.16's ``sigmoid`` ignores ``label_smoothing``; its ``aot`` loss is the cDPO expression, sorted over the
    batch, which for a batch of one pair is cDPO itself."""
    policy, reference = mistral_models
    trainer = dpo_trainer(preference_model_dirs["mistral"], [as_conversational(r) for r in RECORDS], tmp_path,
                          policy, reference, beta=BETA, loss_type="aot", label_smoothing=0.2)
    pairs = masked_pairs(preference_model_dirs["mistral"])
    for index, pair in enumerate(pairs):
        batch = pad_pairs([pair], pad_id=0)
        with torch.no_grad():
            reference_logps = pair_logps(reference, batch)
        smoothed = dpo_loss(pair_logps(policy, batch), reference_logps, beta=BETA, label_smoothing=0.2)
        assert smoothed.loss.item() == pytest.approx(trl_loss(trainer, [index])[0], abs=TOLERANCE)
        plain = dpo_loss(pair_logps(policy, batch), reference_logps, beta=BETA)
        assert abs(smoothed.loss.item() - plain.loss.item()) > 100 * TOLERANCE


def test_simpo_equals_trls_cpo_code_on_mean_log_probs(preference_model_dirs: dict[str, Path],
                                                      mistral_models: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    """TRL's ``CPOTrainer`` with ``loss_type="simpo"`` (``cpo_alpha=0`` is SimPO): its ``get_batch_logps`` and
    ``cpo_loss``, called with the settings it reads from the trainer."""
    policy, _ = mistral_models
    batch = pad_pairs(masked_pairs(preference_model_dirs["mistral"]), pad_id=0)
    logits = policy(input_ids=batch.input_ids).logits
    labels = batch.input_ids.masked_fill(batch.loss_mask == 0, -100)
    trl_means = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    settings = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=0.5, beta=2.0, label_smoothing=0.1,
                               accelerator=SimpleNamespace(device="cpu"))
    trl_losses, trl_chosen, trl_rejected = CPOTrainer.cpo_loss(settings, *trl_means.chunk(2))
    result = simpo_loss(mean_logps(pair_logps(policy, batch), num_loss_tokens(batch)), beta=2.0, gamma=0.5,
                        label_smoothing=0.1)
    torch.testing.assert_close(result.per_pair, trl_losses, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(result.chosen_rewards, trl_chosen, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(result.rejected_rewards, trl_rejected, atol=TOLERANCE, rtol=0)


def test_micro_batch_losses_over_the_steps_pairs_add_up_to_the_steps_mean() -> None:
    policy = PairLogps(torch.tensor([-3.0, -5.0, -2.0]), torch.tensor([-4.0, -4.0, -6.0]))
    reference = PairLogps(torch.tensor([-3.5, -4.0, -2.5]), torch.tensor([-3.0, -4.5, -5.0]))
    whole = dpo_loss(policy, reference, beta=0.5)
    parts = [dpo_loss(PairLogps(policy.chosen[part], policy.rejected[part]),
                      PairLogps(reference.chosen[part], reference.rejected[part]), beta=0.5, step_pairs=3)
             for part in (slice(0, 2), slice(2, 3))]
    assert sum(part.loss for part in parts).item() == pytest.approx(whole.loss.item(), abs=1e-7)
    assert whole.metrics()["rewards/accuracy"] == pytest.approx(2 / 3)  # pair 1 prefers the rejected side
