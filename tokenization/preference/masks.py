"""A ``PreferencePair`` -> both sides rendered by the model's chat template, with the loss mask of each completion.

Each side is the prompt followed by that side's messages, rendered and masked exactly as an SFT conversation with
loss on the completion's assistant turns (:func:`tokenization.chat.masks.mask_conversation`): the mask comes from
the template's ``{% generation %}`` markers or from prefix renderings, each assistant turn's end-of-turn token
carries loss and what the template writes after it does not, and a template that rewrites a turn's content is
refused rather than masked mid-content.

On top of that, a pair must share its prompt: the tokens before the first loss token are the same on both sides
(DPO compares the two completions given one context; a template whose rendering of the prompt depends on the answer
that follows would compare them under different contexts). Both sides rendering to the same tokens is a rejection
too (a template may trim the whitespace that told them apart). With ``truncation="error"`` a side longer than
``max_tokens`` rejects the pair.

Compared with TRL 1.16's ``DPOTrainer`` tokenization (prompt, prompt + side, completion where they diverge): the
token ids are the same; TRL's completion mask also covers what the template writes after the end-of-turn token
(ChatML's and Gemma's newline), and starts earlier where the generation prompt's last whitespace tokenizes
differently alone than before the answer (Llama-3's ``\\n\\n``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenization.chat.masks import MaskedConversation, Truncation, mask_conversation
from tokenization.chat.records import Rejection
from tokenization.chat.template import ChatTemplate
from tokenization.preference.records import SIDES, PreferencePair


@dataclass(frozen=True)
class MaskedPair:
    """Both sides of a pair as token ids and loss masks; ``input_ids[:num_prompt_tokens]`` is the same on both."""

    chosen: MaskedConversation
    rejected: MaskedConversation
    num_prompt_tokens: int
    """Tokens before the first loss token of each side: the rendered prompt with the generation prompt."""

    @property
    def prompt_ids(self) -> list[int]:
        return self.chosen.input_ids[:self.num_prompt_tokens]


def mask_pair(template: ChatTemplate, pair: PreferencePair, max_tokens: int | None = None,
              truncation: Truncation = "error") -> MaskedPair | Rejection:
    """Render and mask both sides of ``pair`` with ``template``; each side is at most ``max_tokens`` tokens."""
    masked: dict[str, MaskedConversation] = {}
    for side in SIDES:
        result = mask_conversation(template, pair.conversation(side), "assistant", max_tokens, truncation)
        if isinstance(result, Rejection):
            return Rejection(f"'{side}': {result.reason}", result.code)
        masked[side] = result
    chosen, rejected = masked["chosen"], masked["rejected"]
    if chosen.input_ids == rejected.input_ids:
        return Rejection("'chosen' and 'rejected' render to the same tokens with this template (it trims or drops "
                         "what tells them apart): the pair prefers nothing", "identical_sides")
    chosen_prompt, rejected_prompt = _num_prompt_tokens(chosen), _num_prompt_tokens(rejected)
    if chosen_prompt != rejected_prompt or chosen.input_ids[:chosen_prompt] != rejected.input_ids[:rejected_prompt]:
        return Rejection(f"the prompt renders to different tokens before 'chosen' ({chosen_prompt} tokens) than "
                         f"before 'rejected' ({rejected_prompt} tokens): the template's prompt depends on the answer",
                         "prompt_mismatch")
    return MaskedPair(chosen, rejected, chosen_prompt)


def _num_prompt_tokens(masked: MaskedConversation) -> int:
    """Tokens before the first one that carries loss (a masked side always has one: the chat checks saw to it)."""
    return masked.loss_mask.index(1)
