"""trainer/model/llama.py and trainer/model/export.py: HF names, float64 gradient checks, deterministic init,
HF-loadable export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.rundir import RunPaths
from tests.trainer.conftest import SEQ_LEN, TEST_DIMS, VOCAB_SIZE, Corpus, write_corpus_shards
from trainer.config import ModelDims, TrainConfig
from trainer.loader.batches import PAD_ID, SplitRows, make_batch
from trainer.model.export import export_model, exported_step, hf_llama_config
from trainer.model.llama import IGNORE_INDEX, ModelShape, RMSNorm, build_model, next_token_loss, rotary_cos_sin
from trainer.model.spec import BuiltinSpec
from trainer.parallel.accelerator import apply_model_options


def shape_for(tied: bool = True) -> ModelShape:
    return ModelShape(ModelDims(**TEST_DIMS, tie_word_embeddings=tied), VOCAB_SIZE, SEQ_LEN)


def expected_hf_names(num_layers: int, tied: bool) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"} | ({"lm_head.weight"} if not tied else set())
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        names |= {prefix + part + ".weight" for part in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    return names


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_names_are_hf_llama_names(tied: bool) -> None:
    model = build_model(shape_for(tied), seed=0)
    assert set(model.state_dict()) == expected_hf_names(TEST_DIMS["num_layers"], tied)
    assert model.state_dict()["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 8, 32)  # kv heads * head_dim


def test_init_is_deterministic_from_the_seed() -> None:
    first, again, other = (build_model(shape_for(), seed).state_dict() for seed in (7, 7, 8))
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert torch.equal(first["model.norm.weight"], torch.ones(TEST_DIMS["hidden_size"]))


def test_loss_skips_padding_labels() -> None:
    logits = torch.randn(2, 5, 11)
    labels = torch.tensor([[3, 4, 5, 6, 7], [3, 4, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]])
    kept = [(0, 0, 4), (0, 1, 5), (0, 2, 6), (0, 3, 7), (1, 0, 4)]
    manual = torch.stack([torch.nn.functional.cross_entropy(logits[b, t][None], torch.tensor([y]))
                          for b, t, y in kept]).mean()
    assert torch.allclose(next_token_loss(logits, labels), manual)


def test_make_batch_masks_pad_in_labels_only() -> None:
    batch = make_batch(torch.tensor([[5, 0, PAD_ID, PAD_ID]]).numpy(), PAD_ID)
    assert batch.input_ids.dtype == torch.int64
    assert batch.labels.tolist() == [[5, 0, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch.num_tokens == 2


@pytest.fixture
def real_rows(tmp_path: Path, stdlib_corpus: Corpus) -> torch.Tensor:
    write_corpus_shards(tmp_path / "run", stdlib_corpus, SEQ_LEN)
    rows = SplitRows(tmp_path / "run", "val", PAD_ID)
    return make_batch(rows.rows(torch.arange(3).numpy()), PAD_ID).input_ids


@pytest.mark.parametrize("tied", [True, False])
def test_export_loads_in_transformers_with_equal_logits(tmp_path: Path, real_rows: torch.Tensor, tied: bool,
                                                        stdlib_corpus: Corpus) -> None:
    from transformers import AutoModelForCausalLM

    shape = shape_for(tied)
    model = build_model(shape, seed=3).eval()
    tokenizer_json = tmp_path / "tokenizer.json"
    tokenizer_json.write_text(stdlib_corpus.tokenizer_json, encoding="utf-8")
    out = export_model(model.state_dict(), hf_llama_config(shape), RunPaths(tmp_path), tokenizer_json, {"step": 5})
    hf_model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        ours, theirs = model(real_rows), hf_model.eval()(real_rows).logits
    assert (ours - theirs).abs().max().item() < 1e-5
    assert (out / "tokenizer.json").read_text(encoding="utf-8") == stdlib_corpus.tokenizer_json
    assert exported_step(out) == 5


def test_export_config_and_weights(tmp_path: Path) -> None:
    shape = shape_for(tied=True)
    model = build_model(shape, seed=1)
    out = export_model(model.state_dict(), hf_llama_config(shape), RunPaths(tmp_path))
    config = json.loads((out / "config.json").read_text())
    assert config == hf_llama_config(shape)
    assert (config["architectures"], config["model_type"], config["max_position_embeddings"]) == (
        ["LlamaForCausalLM"], "llama", SEQ_LEN)
    assert (config["num_key_value_heads"], config["head_dim"], config["tie_word_embeddings"]) == (2, 8, True)
    saved = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in saved
    assert torch.equal(saved["model.layers.1.mlp.down_proj.weight"],
                       model.state_dict()["model.layers.1.mlp.down_proj.weight"])
    assert not (out / "tokenizer.json").exists()


def test_export_replaces_an_older_export_whole(tmp_path: Path) -> None:
    shape = shape_for()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "stale.txt").write_text("from an old export")
    export_model(build_model(shape, seed=1).state_dict(), hf_llama_config(shape), RunPaths(tmp_path), None, {"step": 1})
    newer = build_model(shape, seed=2).state_dict()
    export_model(newer, hf_llama_config(shape), RunPaths(tmp_path), None, {"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temp folders left behind
    assert not (tmp_path / "model" / "stale.txt").exists()
    assert exported_step(tmp_path / "model") == 2
    assert torch.equal(load_file(tmp_path / "model" / "model.safetensors")["model.norm.weight"],
                       newer["model.norm.weight"])


GRADCHECK_SHAPE = ModelShape(ModelDims(hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                                       intermediate_size=12), vocab_size=16, max_seq_len=5)
"""Small enough for finite differences in float64; 2 query heads over 1 kv head keeps GQA in the check."""


def gradcheck_module(module: torch.nn.Module, *inputs: torch.Tensor) -> bool:
    """torch.autograd.gradcheck of ``module`` in float64 w.r.t. its input and every parameter."""
    module = module.double()
    names = [name for name, _ in module.named_parameters()]
    params = [param.detach().clone().requires_grad_(True) for _, param in module.named_parameters()]
    x = inputs[0].double().requires_grad_(True)

    def run(x: torch.Tensor, *flat: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(module, dict(zip(names, flat, strict=True)), (x, *inputs[1:]))

    return torch.autograd.gradcheck(run, (x, *params), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_gradients_of_rmsnorm_rotary_attention_and_swiglu_match_finite_differences() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, GRADCHECK_SHAPE.max_seq_len, 8, generator=generator, dtype=torch.float64)
    norm = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(8, generator=generator) + 0.5)  # not all ones: the gain's gradient counts
    assert gradcheck_module(norm, x)
    cos, sin = rotary_cos_sin(GRADCHECK_SHAPE.max_seq_len, GRADCHECK_SHAPE.head_dim, 10000.0, torch.device("cpu"))
    attention = build_model(GRADCHECK_SHAPE, seed=0).model.layers[0].self_attn
    assert gradcheck_module(attention, x, cos.double(), sin.double())
    mlp = build_model(GRADCHECK_SHAPE, seed=1).model.layers[0].mlp
    assert gradcheck_module(mlp, x)


def test_activation_checkpointing_gives_the_same_loss_and_gradients() -> None:
    shape = shape_for()
    tokens = torch.randint(0, VOCAB_SIZE, (3, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    results = []
    for recompute in (False, True):
        model = apply_model_options(build_model(shape, seed=4), TrainConfig(activation_checkpointing=recompute),
                                    BuiltinSpec(shape))
        loss = model(tokens, tokens)
        loss.backward()
        results.append((loss.detach(), {name: p.grad for name, p in model.named_parameters()}))
    (plain_loss, plain_grads), (recomputed_loss, recomputed_grads) = results
    assert torch.equal(plain_loss, recomputed_loss)
    assert all(torch.allclose(plain_grads[name], recomputed_grads[name], rtol=0, atol=1e-7) for name in plain_grads)
    with torch.no_grad():  # no backward coming: the flag is ignored and nothing is recomputed
        assert torch.equal(model(tokens), build_model(shape, seed=4)(tokens))


@pytest.mark.slow
def test_compile_flag_compiles_each_block_in_place_and_trains_like_eager() -> None:
    model = apply_model_options(build_model(shape_for(), seed=0), TrainConfig(compile=True), BuiltinSpec(shape_for()))
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    assert set(model.state_dict()) == expected_hf_names(TEST_DIMS["num_layers"], tied=True)  # names unchanged
    tokens = torch.randint(0, VOCAB_SIZE, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    eager = build_model(shape_for(), seed=0)
    results = []
    for candidate in (eager, model):  # a real inductor forward and backward through every compiled block
        loss = candidate(tokens, tokens)
        loss.backward()
        results.append((loss.detach(), {name: p.grad for name, p in candidate.named_parameters()}))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    assert torch.allclose(compiled_loss, eager_loss, rtol=0, atol=1e-5)
    assert all(torch.allclose(compiled_grads[name], eager_grads[name], rtol=1e-3, atol=1e-5) for name in eager_grads)
