"""A model folder like the quick start's export (runs/tiny/model), built in a second: a byte-level BPE trained by
tokenmill on standard-library source (``<|endoftext|>`` and ``<|pad|>`` its only special tokens, no chat template)
and the built-in Llama with random weights, written by the trainer's own export."""

from __future__ import annotations

from pathlib import Path

from core.rundir import RunPaths
from tests.conftest import STDLIB
from tokenization.train_tokenizer import train_tokenizer
from trainer.config import ModelDims
from trainer.model.export import export_model, hf_llama_config
from trainer.model.llama import ModelShape, build_model

REPO = Path(__file__).resolve().parents[2]
SFT_TEMPLATE = REPO / "configs" / "sft-chat.jinja"
"""The worked example's chat template (configs/sft.yaml names it)."""
DIMS = ModelDims(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
CONTEXT = 128


def quick_start_like_export(run_dir: Path, with_template: bool = False, seed: int = 3, scale: float = 1.0) -> Path:
    """``run_dir/model``: the export, with ``configs/sft-chat.jinja`` as its ``chat_template.jinja`` when asked (what
    an SFT run's export carries). ``scale`` multiplies every weight matrix: at the usual small init the tied
    embeddings make a random model repeat its last token, so greedy text tells nothing apart; x15 it varies."""
    texts = [path.read_text(encoding="utf-8") for path in sorted((STDLIB / "json").glob("*.py"))]
    tokenizer = train_tokenizer(texts, vocab_size=400)
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(run_dir / "tokenizer.json"))
    shape = ModelShape(DIMS, tokenizer.get_vocab_size(), CONTEXT)
    weights = {name: tensor * scale if tensor.dim() == 2 else tensor
               for name, tensor in build_model(shape, seed=seed).state_dict().items()}
    folder = export_model(weights, hf_llama_config(shape), RunPaths(run_dir), run_dir / "tokenizer.json")
    if with_template:
        (folder / "chat_template.jinja").write_text(SFT_TEMPLATE.read_text(encoding="utf-8"), encoding="utf-8")
    return folder
