"""Preference data for DPO: ``{prompt or messages, chosen, rejected}`` records -> a pair of masked token sequences.

Input: one record in TRL's preference formats (conversational, plain, or with the prompt implicit in both sides)
and a model's chat template. Output: ``MaskedPair`` (both sides rendered, the shared prompt identical on both, loss
only on each side's completion) or a ``Rejection`` with its reason, for ``rejects``. Pure functions built on the
chat code (:mod:`tokenization.chat`): ``records`` parses and validates (:mod:`core.preference_pairs`, which ingest
reads too), ``masks`` renders and masks, ``fit`` fits a pair to one row, ``pack`` packs pairs into rows; ``stage``
(the preference data stage) wires them between the documents of a ``records: preference`` source and its shards.
"""
