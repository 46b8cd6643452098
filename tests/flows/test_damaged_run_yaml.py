"""A damaged ``run.yaml`` (invalid YAML, a scalar, nested too deeply) is one line naming it and how to write it
again, from every reader: ``tokenmill eval`` and the trainer that ``accelerate launch`` starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOKENMILL = str(Path(sys.executable).parent / "tokenmill")
DAMAGED = {
    "invalid-yaml": ("name: [unclosed\n", "run.yaml:2: invalid YAML"),
    "a-scalar": ("42\n", "run.yaml: a run recipe must be a YAML mapping of keys (key: value lines), got a number"),
    "empty": ("", "got an empty file"),
    "nested-too-deeply": ("[" * 5000 + "]" * 5000 + "\n", "run.yaml: invalid YAML (nested too deeply to read)"),
}
FIX = "tokenmill wrote this file: delete it and re-run `tokenmill prepare` with the run's recipe"


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DAMAGED))
def test_a_damaged_run_yaml_is_one_line_for_eval_and_the_trainer(tmp_path: Path, name: str) -> None:
    content, says = DAMAGED[name]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.yaml").write_text(content)
    evaluate = subprocess.run([TOKENMILL, "eval", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    trainer = subprocess.run([sys.executable, "-m", "trainer.train", "--run-dir", str(tmp_path / "run")],
                             capture_output=True, text=True, timeout=300)
    for result in (evaluate, trainer):
        line = one_error_line(result)
        assert says in line and FIX in line
