"""What ``tokenmill generate`` checks of its options before the model loads.

Kept apart from :mod:`trainer.model.generate` (torch, transformers): the CLI answers a bad option in the time Python
starts, not after the seconds those imports take.
"""

from __future__ import annotations

import math

from core.errors import ConfigError
from core.seeds import MAX_SEED


def check_sampling(prompt: str, temperature: float, seed: int) -> None:
    """Raise ConfigError naming the option (as ``tokenmill generate`` spells it) when a setting cannot sample.

    The CLI calls it before loading the model. A prompt must be text: a command-line argument that is not
    UTF-8 arrives with its bytes as lone surrogates, which no tokenizer encodes.
    """
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        char = ord(prompt[err.start])
        what = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"character U+{char:04X}"
        raise ConfigError(f"PROMPT is not valid UTF-8 text ({what} at position {err.start}); pass the prompt as "
                          "UTF-8 (check the encoding of the terminal or script that sends it).") from None
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"--temperature {temperature}: give a finite number >= 0 (0 = greedy, 1 = the model's "
                          "own distribution, higher = more varied).")
    if not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"--seed {seed}: give a whole number from 0 to {MAX_SEED}.")
