"""A masked pair -> the pair as it fits one row of ``pack.seq_len`` tokens (both sides together), or the rejection.

A packed row holds whole pairs (:mod:`core.shards.preference`), so what must fit is the two sides together:
``len(chosen) + len(rejected) <= seq_len``. With ``chat.truncation: error`` a pair that does not fit is rejected as
``too_many_tokens``. With ``truncate`` each side keeps its whole prompt and its completion is cut at the end so that
the pair fits: the ``seq_len - 2 * prompt`` completion tokens are shared so that the shorter completion keeps what it
has up to half of them and the longer one gets the rest (a short answer is never cut to make room for a long one).
A pair still rejected under ``truncate``: a prompt too long to leave each side one completion token
(``too_many_tokens``), or two sides that are the same once cut (``identical_sides``: the cut removed what told them
apart). A cut side loses its end-of-turn token, as a truncated SFT conversation does.
"""

from __future__ import annotations

from tokenization.chat.masks import MaskedConversation, Truncation
from tokenization.chat.records import Rejection
from tokenization.preference.masks import MaskedPair


def fit_pair(pair: MaskedPair, seq_len: int, truncation: Truncation) -> MaskedPair | Rejection:
    """``pair`` unchanged when its two sides fit ``seq_len`` tokens together, else cut (``truncate``) or rejected."""
    num_chosen, num_rejected = len(pair.chosen.input_ids), len(pair.rejected.input_ids)
    if num_chosen + num_rejected <= seq_len:
        return pair
    if truncation == "error":
        return Rejection(f"the pair is {num_chosen} + {num_rejected} = {num_chosen + num_rejected} tokens (chosen + "
                         f"rejected), longer than {seq_len} (seq_len) with truncation: error", "too_many_tokens")
    prompt = pair.num_prompt_tokens
    budget = seq_len - 2 * prompt
    if budget < 2:
        return Rejection(f"the prompt is {prompt} tokens: two sides of it leave no room for an answer in {seq_len} "
                         "(seq_len) tokens, even cut", "too_many_tokens")
    chosen_keep, rejected_keep = completion_budgets(num_chosen - prompt, num_rejected - prompt, budget)
    chosen, rejected = _cut(pair.chosen, prompt + chosen_keep), _cut(pair.rejected, prompt + rejected_keep)
    if chosen.input_ids == rejected.input_ids:
        return Rejection(f"'chosen' and 'rejected' are the same once cut to fit {seq_len} (seq_len) tokens: what "
                         "told them apart is past the cut", "identical_sides")
    return MaskedPair(chosen, rejected, prompt)


def completion_budgets(num_chosen: int, num_rejected: int, budget: int) -> tuple[int, int]:
    """Completion tokens each side keeps, ``budget`` in all: the shorter keeps up to half, the longer the rest."""
    shorter = min(num_chosen, num_rejected, budget // 2)
    longer = min(max(num_chosen, num_rejected), budget - shorter)
    return (shorter, longer) if num_chosen <= num_rejected else (longer, shorter)


def _cut(side: MaskedConversation, num_tokens: int) -> MaskedConversation:
    return MaskedConversation(side.input_ids[:num_tokens], side.loss_mask[:num_tokens], side.method)
