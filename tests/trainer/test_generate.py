"""trainer.model.generate: an export (built-in Llama or a HF architecture) loads back and samples deterministically."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.errors import CheckpointError, ConfigError
from core.rundir import RunPaths
from tests.conftest import STDLIB
from tokenization.train_tokenizer import train_tokenizer
from trainer.config import ModelDims
from trainer.model.export import export_model, hf_llama_config
from trainer.model.generate import generate_text, load_exported_model
from trainer.model.llama import ModelShape, build_model

DIMS = ModelDims(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    texts = [path.read_text() for path in sorted((STDLIB / "json").glob("*.py"))]
    tokenizer = train_tokenizer(texts, vocab_size=400)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    shape = ModelShape(DIMS, tokenizer.get_vocab_size(), 32)
    return export_model(build_model(shape, seed=3).state_dict(), hf_llama_config(shape), RunPaths(tmp_path),
                        tmp_path / "tokenizer.json")


def test_export_round_trips_into_the_same_weights(model_dir: Path) -> None:
    model, _, special, context_len = load_exported_model(model_dir)
    fresh = build_model(ModelShape(DIMS, model.config.vocab_size, 32), seed=3)
    loaded = model.state_dict()
    for name, original in fresh.state_dict().items():
        assert torch.equal(loaded[name], original), name
    assert (special.eos_id, special.pad_id, special.bos_id, context_len) == (0, 1, None, 32)
    ids = torch.tensor([[5, 9, 2, 7]])
    assert torch.equal(fresh(ids), model(ids).logits)  # the built-in model and its export compute alike


def test_sampling_is_deterministic_per_seed_and_continues_the_prompt(model_dir: Path) -> None:
    model, tokenizer, special, context_len = load_exported_model(model_dir)

    def sample(**options: float) -> str:
        return generate_text(model, tokenizer, special, context_len, "def main(", max_new_tokens=40, **options)

    first, again, other = sample(seed=1), sample(seed=1), sample(seed=2)
    assert first == again and first.startswith("def main(")
    assert other != first  # a random model spreads probability over the vocab: seeds differ
    assert sample(temperature=0, seed=9) == sample(temperature=0, seed=5)


def test_a_hugging_face_architecture_export_generates(tmp_path: Path, model_dir: Path) -> None:
    from tests.trainer.test_hf_models import save_tiny_model

    folder = save_tiny_model(tmp_path / "gpt2", "gpt2", vocab_size=400)
    shutil.copyfile(model_dir / "tokenizer.json", folder / "tokenizer.json")
    model, tokenizer, special, context_len = load_exported_model(folder)
    assert type(model).__name__ == "GPT2LMHeadModel" and context_len == 128
    text = generate_text(model, tokenizer, special, context_len, "import ", max_new_tokens=10, temperature=0)
    assert text.startswith("import ")


def test_incomplete_export_is_a_clear_error(model_dir: Path) -> None:
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_exported_model(model_dir)


def test_a_tiny_temperature_samples_as_greedy(model_dir: Path) -> None:
    model, tokenizer, special, context_len = load_exported_model(model_dir)

    def sample(temperature: float) -> str:
        return generate_text(model, tokenizer, special, context_len, "def main(", max_new_tokens=20,
                             temperature=temperature, seed=4)

    assert sample(1e-300) == sample(5e-324) == sample(0)  # a float32 division by 1e-300 gave NaN probabilities


def test_a_tiny_temperature_through_the_cli_prints_the_greedy_text(model_dir: Path) -> None:
    tokenmill = str(Path(sys.executable).parent / "tokenmill")

    def generate(temperature: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([tokenmill, "generate", str(model_dir.parent), "def main(", "--max-new-tokens", "20",
                               "--temperature", temperature], capture_output=True, text=True, timeout=120)

    tiny, greedy = generate("1e-300"), generate("0")
    assert tiny.returncode == 0 and "Traceback" not in tiny.stderr, tiny.stderr
    assert tiny.stdout == greedy.stdout and tiny.stdout.startswith("def main(")


@pytest.mark.parametrize(("options", "named"), [
    ({"temperature": float("nan")}, "--temperature nan"), ({"temperature": float("inf")}, "--temperature inf"),
    ({"temperature": -0.5}, "--temperature -0.5"), ({"seed": -1}, "--seed -1"), ({"seed": 2**64}, "--seed 1844"),
    ({"prompt": "caf\udcc3("}, "PROMPT is not valid UTF-8 text (byte 0xc3 at position 3)"),
    ({"prompt": "x\ud800"}, "PROMPT is not valid UTF-8 text (character U+D800 at position 1)"),
])
def test_settings_that_cannot_sample_are_a_config_error_naming_the_option(model_dir: Path, options: dict,
                                                                         named: str) -> None:
    model, tokenizer, special, context_len = load_exported_model(model_dir)
    settings = {"prompt": "def main(", "temperature": 0.8, "seed": 0, **options}
    prompt = settings.pop("prompt")
    with pytest.raises(ConfigError) as raised:
        generate_text(model, tokenizer, special, context_len, prompt, max_new_tokens=3, **settings)
    assert str(raised.value).startswith(named) and "\n" not in str(raised.value)
