"""Preference records -> ``PreferencePair`` or ``Rejection``: :mod:`core.preference_pairs`, re-exported here beside
the code that renders and packs them (ingest reads the same parser, and ``pipeline`` cannot import ``tokenization``)."""

from core.preference_pairs import (
    PREFERENCE_REJECT_REASONS,
    SIDES,
    PairFormat,
    PreferencePair,
    Side,
    parse_pair,
)

__all__ = ["PREFERENCE_REJECT_REASONS", "SIDES", "PairFormat", "PreferencePair", "Side", "parse_pair"]
