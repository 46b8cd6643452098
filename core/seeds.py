"""The range of a random seed a user gives (a recipe's ``train.seed``, ``--seed`` on the command line)."""

MAX_SEED = 2**63 - 1
"""The largest seed: torch's generators take 64 bits, numpy's seeds must not be negative, and a seed fits int64.

Kept apart from ``core.config`` so the command line can name the range without importing pydantic."""
