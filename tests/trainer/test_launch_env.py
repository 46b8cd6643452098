"""The environment a flow launches the trainer with: tokenmill's own `trainer` package, whatever the cwd."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trainer.launch import PARENT_PID_ENV, launched_env


def test_a_trainer_package_in_the_working_folder_is_not_imported_by_the_launched_module(tmp_path: Path) -> None:
    decoy = tmp_path / "trainer"
    decoy.mkdir()
    (decoy / "__init__.py").write_text('raise SystemExit("decoy: the working folder\'s trainer package")\n')
    argv = [sys.executable, "-m", "trainer.checkpoint_layout"]  # what `accelerate launch -m trainer.train` runs
    plain = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, env=dict(os.environ), check=False)
    assert plain.returncode == 1 and "decoy: the working folder's trainer" in plain.stderr  # the hazard is real
    launched = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, check=False,
                              env={**os.environ, **launched_env()})
    assert launched.returncode == 0, launched.stderr
    assert launched_env()[PARENT_PID_ENV] == str(os.getpid())
