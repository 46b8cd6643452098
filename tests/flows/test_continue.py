"""configs/continue.yaml: continued pretraining of a trained tokenmill export on a new domain, replaying the old one.

The recipe is the shipped one; only what must be small for a test changes: its model path (a small run trained
here first, as the quick start's would be), its sources' folders (slices of the same corpora) and its sizes.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

from flows.pipeline import data_to_model
from tests.conftest import copy_stdlib_slice
from tests.flows.conftest import write_small_recipe

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
    return name


def eval_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics" / "eval.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_continue_recipe_adapts_the_export_to_a_new_domain_and_keeps_the_old(tmp_path: Path,
                                                                             prefect_server: None) -> None:
    base = tmp_path / "base"
    base_recipe = write_small_recipe(base, max_steps=200, packages=("email", "json"))
    trained = yaml.safe_load(base_recipe.read_text())  # wide enough to learn more than token frequencies
    trained["model"]["dims"].update(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=192)
    trained["train"].update(lr=0.005, warmup_steps=10, checkpoint_every=100, eval_every=100)
    base_recipe.write_text(yaml.safe_dump(trained))
    data_to_model(str(base_recipe))
    export = base / "run" / "model"
    assert json.loads((export / "config.json").read_text())["model_type"] == "llama"

    recipe = yaml.safe_load((REPO_ROOT / "configs" / "continue.yaml").read_text())
    assert "tokenizer" not in recipe and recipe["model"]["from_pretrained"] == "../runs/tiny/model"
    root = tmp_path / "continue"
    root.mkdir()
    recipe["data"]["manifests"] = [
        shipped_manifest("debian-docs.yaml", debian_slice(tmp_path / "debian"), root),
        shipped_manifest("python-stdlib-replay.yaml", copy_stdlib_slice(tmp_path / "stdlib", ("email",)), root)]
    recipe["model"]["from_pretrained"] = str(export)
    recipe["run_dir"] = str(root / "run")
    recipe["pack"] = {"seq_len": 64, "rows_per_shard": 128}
    recipe["dedupe"]["near"]["num_perm"] = 64
    recipe["train"].update(max_steps=60, micro_batch_size=8, warmup_steps=5, checkpoint_every=30, eval_every=30,
                           eval_batches=4)
    (root / "continue.yaml").write_text(yaml.safe_dump(recipe))
    data_to_model(str(root / "continue.yaml"))

    run_dir = root / "run"
    run_yaml = yaml.safe_load((run_dir / "run.yaml").read_text())
    assert run_yaml["mixture"] == {"debian_docs": 0.7, "stdlib": 0.3}
    assert (run_dir / "tokenizer" / "tokenizer.json").read_bytes() == (export / "tokenizer.json").read_bytes()
    rows = eval_rows(run_dir)
    first, last = rows[0], rows[-1]
    print({key: (round(first[key], 3), round(last[key], 3)) for key in first if key.startswith("val_loss")})
    # A trained model: step 0 on the replayed corpus is far below a uniform guess over its vocabulary.
    assert first["step"] == 0 and first["val_loss/stdlib"] < 0.75 * math.log(512)
    assert last["val_loss/debian_docs"] < first["val_loss/debian_docs"] - 0.3  # the new domain is learned
    # ...and the old one is kept: measured +0.08 nats with the 0.3 replay, +0.33 when the replay weight was 0.001.
    assert last["val_loss/stdlib"] < first["val_loss/stdlib"] + 0.15
    exported = json.loads((run_dir / "model" / "config.json").read_text())
    assert exported["model_type"] == "llama" and (run_dir / "model" / "tokenizer.json").is_file()
