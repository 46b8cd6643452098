"""flows/runtime/settings.py: the environment every process tokenmill starts runs in (other libraries' bars off)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# What the CLI does first (configure_environment), then the libraries' own bars, as a launched process meets them.
LIBRARIES_DRAW_BARS = textwrap.dedent("""
    import sys
    from flows.runtime.settings import configure_environment, show_library_progress
    configure_environment()
    if "--debug" in sys.argv:
        show_library_progress()
    from tqdm.auto import tqdm
    for _ in tqdm(range(3), desc="a tqdm bar"):
        pass
    import datasets
    datasets.Dataset.from_dict({"a": list(range(5))}).map(lambda row: row, desc="a datasets bar")
    from transformers.utils import logging
    for _ in logging.tqdm(range(3), desc="a transformers bar"):
        pass
""")
BARS = ("a tqdm bar", "a datasets bar", "a transformers bar")
SWITCHES = ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE")
"""The libraries' own switches (flows.runtime.settings.LIBRARY_PROGRESS_OFF): the child starts without any of them."""


@pytest.mark.parametrize("debug", [False, True], ids=["default", "--debug"])
def test_other_libraries_draw_no_bars_unless_debug(debug: bool) -> None:
    # datasets ("Generating test split"), transformers ("Loading weights") and lm-eval bars reached tokenmill's
    # terminal and logs. The child starts without the variables, as from a user's shell.
    env = {key: value for key, value in os.environ.items() if key not in SWITCHES}
    command = [sys.executable, "-c", LIBRARIES_DRAW_BARS, *(["--debug"] if debug else [])]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    shown = [bar for bar in BARS if bar in done.stderr]
    assert shown == (list(BARS) if debug else []), done.stderr[-2000:]
