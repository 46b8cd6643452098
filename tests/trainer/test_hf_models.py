"""Hugging Face causal LMs through the model spec: tiny local architectures (no downloads), one process.

Each architecture is built here with ``AutoConfig.for_model(...)`` + ``save_pretrained``, linked into a run dir by
the model stage, trained a few steps by ``trainer.train``, and exported in its own architecture.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from core.errors import ConfigError
from core.rundir import RunPaths
from tests.trainer.conftest import VOCAB_SIZE, MakeRunDir, exported_weights, metric_steps
from trainer.config import ModelConfig
from trainer.eval.evaluate import fixed_subset
from trainer.loader.batches import PAD_ID, SplitRows, make_batch
from trainer.model.base_model import import_base_model
from trainer.model.hf_model import load_causal_lm_config
from trainer.model.spec import HuggingFaceSpec
from trainer.train import main

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {**TINY, "num_key_value_heads": 2},
    "qwen3": {**TINY, "num_key_value_heads": 2, "head_dim": 8},
    "mistral": {**TINY, "num_key_value_heads": 2, "sliding_window": None},
    "gpt_neox": TINY,
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
}
"""Tiny configs of five architectures; GQA where the architecture has it. GPT-2's config has dropout on by default
(the model's own setting is trained as it is); off here, so 2 processes can equal 1 exactly."""


def save_tiny_model(folder: Path, model_type: str, seed: int = 7, weights: bool = True, **overrides: Any) -> Path:
    """A Hugging Face model folder: config.json (+ model.safetensors) of a tiny ``model_type`` with the test vocab."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {"vocab_size": VOCAB_SIZE, "max_position_embeddings": 128, "bos_token_id": 0, "eos_token_id": 0,
                "pad_token_id": 1, **ARCHITECTURES[model_type], **overrides}
    config = AutoConfig.for_model(model_type, **settings)
    if model_type == "gpt2":
        config.n_positions = 128
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if weights:
        model.save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return folder


def use_hf_model(run_dir: Path, source: Path, key: str = "hf_config", **train: Any) -> None:
    """Point run.yaml's model at ``source`` and run the model stage, as `tokenmill prepare` does."""
    recipe = yaml.safe_load((run_dir / "run.yaml").read_text())
    recipe["model"] = {key: str(source)}
    recipe["train"] = {**recipe["train"], **train}
    (run_dir / "run.yaml").write_text(yaml.safe_dump(recipe))
    import_base_model(RunPaths(run_dir), source, ModelConfig.model_validate(recipe["model"]))


def val_rows(run_dir: Path, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The evaluator's fixed subset of ``num_rows`` val rows (shared among the sources)."""
    rows = SplitRows(run_dir, "val", PAD_ID)
    batch = make_batch(rows.rows(fixed_subset(rows, num_rows)[1]), PAD_ID)
    return batch.input_ids, batch.labels


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_hf_architecture_trains_and_exports_in_its_own_architecture(
        tmp_path: Path, make_run_dir: MakeRunDir, model_type: str) -> None:
    from transformers import AutoModelForCausalLM

    run_dir = make_run_dir()
    use_hf_model(run_dir, save_tiny_model(tmp_path / "src", model_type, weights=False), max_steps=4)
    assert main(["--run-dir", str(run_dir)]) == 0
    assert metric_steps(run_dir, "eval.jsonl") == [0, 4]
    losses = [row["val_loss"] for row in map(json.loads, (run_dir / "metrics/eval.jsonl").read_text().splitlines())]
    assert losses[-1] < losses[0]  # it learned

    config = json.loads((run_dir / "model" / "config.json").read_text())
    assert config["model_type"] == model_type
    loaded, info = AutoModelForCausalLM.from_pretrained(run_dir / "model", output_loading_info=True,
                                                        dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    trained = HuggingFaceSpec(load_causal_lm_config(run_dir / "model"), 64, run_dir / "model").build(seed=0).eval()
    checkpoint = load_file(sorted((run_dir / "checkpoints").glob("step-*"))[-1] / "model.safetensors")
    for name, tensor in loaded.state_dict().items():  # the export holds the trained weights
        if name in checkpoint:
            assert torch.equal(tensor, checkpoint[name]), name
        else:  # a tied output layer is saved once, as the input embedding
            assert name == "lm_head.weight" and loaded.config.tie_word_embeddings
    loaded.save_pretrained(tmp_path / "resaved")  # the export's names are the ones save_pretrained writes
    assert set(exported_weights(run_dir)) == set(load_file(tmp_path / "resaved" / "model.safetensors"))
    input_ids, _ = val_rows(run_dir, 2)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids).logits, trained(input_ids).logits)


def test_hf_config_init_is_seeded(tmp_path: Path) -> None:
    config = load_causal_lm_config(save_tiny_model(tmp_path / "src", "llama", weights=False))
    first, again = (HuggingFaceSpec(config, 64).build(seed=3).state_dict() for _ in range(2))
    other = HuggingFaceSpec(config, 64).build(seed=4).state_dict()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])


def test_continued_pretraining_starts_at_the_loaded_models_loss(tmp_path: Path, make_run_dir: MakeRunDir) -> None:
    """Step 0's val loss is the loss transformers computes for the loaded model on the same rows; then it falls."""
    from transformers import AutoModelForCausalLM

    run_dir = make_run_dir(train={"eval_batches": 2, "micro_batch_size": 4})
    source = save_tiny_model(tmp_path / "src", "qwen3")
    use_hf_model(run_dir, source, key="from_pretrained", max_steps=8, lr=1e-2)
    assert main(["--run-dir", str(run_dir)]) == 0

    rows = [json.loads(line) for line in (run_dir / "metrics/eval.jsonl").read_text().splitlines()]
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    input_ids, labels = val_rows(run_dir, 8)  # eval_batches * micro_batch_size rows, as the evaluator scores
    with torch.no_grad():
        loss = reference(input_ids, labels=labels).loss.item()
    print(f"step-0 val_loss tokenmill {rows[0]['val_loss']:.6f} vs transformers {loss:.6f}")
    assert rows[0]["step"] == 0 and math.isclose(rows[0]["val_loss"], loss, rel_tol=1e-5)
    assert rows[-1]["val_loss"] < rows[0]["val_loss"]


def test_a_killed_continued_run_resumes_from_its_own_checkpoint(tmp_path: Path, make_run_dir: MakeRunDir) -> None:
    """Once a checkpoint exists the initial weights are never loaded again (even if they changed on disk)."""
    run_dir = make_run_dir()
    source = save_tiny_model(tmp_path / "src", "llama")
    use_hf_model(run_dir, source, key="from_pretrained", max_steps=4)
    assert main(["--run-dir", str(run_dir), "--until-step", "4"]) == 0
    straight = exported_weights(run_dir)
    for name in ("model", "metrics"):
        for path in sorted((run_dir / name).rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
    (run_dir / "base_model" / "model.safetensors").unlink()  # the initial weights are gone: only resume can work
    assert main(["--run-dir", str(run_dir), "--until-step", "4"]) == 0
    assert all(torch.equal(straight[name], tensor) for name, tensor in exported_weights(run_dir).items())


def test_a_bigger_tokenizer_than_the_embedding_is_refused(tmp_path: Path, make_run_dir: MakeRunDir,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = make_run_dir()
    use_hf_model(run_dir, save_tiny_model(tmp_path / "src", "llama", weights=False, vocab_size=300))
    assert main(["--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"tokenizer has {VOCAB_SIZE} ids" in err and "has only 300 rows" in err


def test_missing_base_model_says_to_prepare(make_run_dir: MakeRunDir, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = make_run_dir()
    recipe = yaml.safe_load((run_dir / "run.yaml").read_text())
    recipe["model"] = {"hf_config": "nowhere"}
    (run_dir / "run.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["--run-dir", str(run_dir)]) == 2
    assert "tokenmill prepare" in capsys.readouterr().err


# ---- bad model folders: one clear line each, nothing built -------------------------------------------------


def test_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"holds no config.json"):
        load_causal_lm_config(tmp_path / "empty")


def test_encoder_config_is_not_a_causal_lm(tmp_path: Path) -> None:
    from transformers import AutoConfig

    AutoConfig.for_model("bert", vocab_size=VOCAB_SIZE, architectures=["BertForMaskedLM"]).save_pretrained(
        tmp_path / "bert")
    with pytest.raises(ConfigError, match=r"model_type 'bert'.*not a causal"):
        load_causal_lm_config(tmp_path / "bert")


def test_remote_code_needs_trust_remote_code(tmp_path: Path) -> None:
    folder = save_tiny_model(tmp_path / "src", "llama", weights=False)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"model.trust_remote_code"):
        load_causal_lm_config(folder)


def test_pickled_weights_are_refused_unread(tmp_path: Path, make_run_dir: MakeRunDir) -> None:
    folder = save_tiny_model(tmp_path / "src", "llama", weights=False)
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not even opened")
    with pytest.raises(ConfigError, match=r"pickle \(pytorch_model.bin\).*save_pretrained"):
        use_hf_model(make_run_dir(), folder, key="from_pretrained")


def test_missing_and_corrupt_shards(tmp_path: Path, make_run_dir: MakeRunDir) -> None:
    folder = save_tiny_model(tmp_path / "src", "llama")
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"model-00002-of-00002.safetensors"):
        use_hf_model(make_run_dir("a"), folder, key="from_pretrained")
    (folder / "model.safetensors.index.json").unlink()
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:100])
    with pytest.raises(ConfigError, match=r"not a readable safetensors file"):
        use_hf_model(make_run_dir("b"), folder, key="from_pretrained")


def test_weights_that_do_not_fit_the_config(tmp_path: Path, make_run_dir: MakeRunDir,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    folder = save_tiny_model(tmp_path / "src", "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    run_dir = make_run_dir()
    use_hf_model(run_dir, folder, key="from_pretrained")
    assert main(["--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "mlp." in err and "(32, 64) in the weights, the config builds (32, 96)" in err


def test_only_one_model_source(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model.preset and model.from_pretrained"):
        ModelConfig(preset="tiny", from_pretrained="x")


def test_checkpoint_of_another_model_is_refused(tmp_path: Path, make_run_dir: MakeRunDir,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = make_run_dir()
    use_hf_model(run_dir, save_tiny_model(tmp_path / "a", "llama", weights=False), max_steps=2)
    assert main(["--run-dir", str(run_dir)]) == 0
    use_hf_model(run_dir, save_tiny_model(tmp_path / "b", "mistral", weights=False), max_steps=4)
    assert main(["--run-dir", str(run_dir)]) == 2
    assert "differs from the recipe" in capsys.readouterr().err
