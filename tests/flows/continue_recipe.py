"""configs/continue.yaml: continued pretraining of the quick start's export on a new domain, replaying the old one.

The test that runs it lives with the quick start (tests/test_readme_commands.py), whose ``runs/tiny/model`` the
shipped recipe continues; this module makes the recipe small: only its data and sizes change.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import copy_stdlib_slice

REPO_ROOT = Path(__file__).resolve().parents[2]
DEBIAN_DOCS = Path("/usr/share/doc")


def debian_slice(target: Path, num_packages: int = 80) -> Path:
    """The copyright files of the first ``num_packages`` documented packages (real English prose)."""
    for copyright_file in sorted(DEBIAN_DOCS.glob("*/copyright"))[:num_packages]:
        destination = target / copyright_file.parent.name / "copyright"
        destination.parent.mkdir(parents=True)
        shutil.copyfile(copyright_file, destination)
    return target


def shipped_manifest(name: str, folder: Path, root: Path) -> str:
    """A shipped manifest with its source's path pointed at ``folder`` (names, weights, formats kept)."""
    manifest = yaml.safe_load((REPO_ROOT / "data_manifests" / name).read_text())
    for source in manifest["sources"]:
        source["path"] = str(folder)
    (root / name).write_text(yaml.safe_dump(manifest))
    return str(root / name)


def continue_recipe_for_test(tmp_path: Path, shipped: Path) -> dict[str, Any]:
    """The shipped recipe with slices of its corpora (Debian copyright texts, the stdlib's email package), a
    run dir under ``tmp_path`` and a test's sizes; the model path, mixture and learning rate are kept."""
    recipe = yaml.safe_load(shipped.read_text())
    assert "tokenizer" not in recipe, "the shards are packed with the model's own tokenizer"
    root = tmp_path / "continue"
    root.mkdir()
    recipe["data"]["manifests"] = [
        shipped_manifest("debian-docs.yaml", debian_slice(tmp_path / "debian"), root),
        shipped_manifest("python-stdlib-replay.yaml", copy_stdlib_slice(tmp_path / "stdlib", ("email",)), root)]
    recipe["run_dir"] = str(root / "run")
    recipe["pack"] = {"seq_len": 64, "rows_per_shard": 128}
    recipe["dedupe"]["near"]["num_perm"] = 64
    recipe["train"].update(max_steps=60, micro_batch_size=8, warmup_steps=5, checkpoint_every=30, eval_every=30,
                           eval_batches=4)
    return recipe
