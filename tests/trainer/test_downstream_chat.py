"""A supervised fine-tuning run's downstream tasks through the model's chat template: the numbers equal what
``lm_eval --apply_chat_template`` prints for the same model folder, few-shot examples included (they become earlier
turns, ``fewshot_as_multiturn``, which that flag turns on).

The model folder is a tiny local Llama (random weights) whose tokenizer carries the worked example's template
(configs/sft-chat.jinja), as an SFT run's export does; the task asks for each next line of standard-library files
after two examples, scored by perplexity (a number every token of the prompt moves, where a random model's accuracy
hardly does). One ``lm_eval`` command runs (about 20 s): the zero-shot path is the same code without the examples.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.trainer.quick_start_model import SFT_TEMPLATE
from tests.trainer.test_downstream import lm_eval_command_results, stdlib_documents
from trainer.eval.downstream import TaskResult, run_task
from trainer.eval.next_line_task import next_line_items

TASK = "next_line_ppl"
NUM_ITEMS = 16
NUM_FEWSHOT = 2


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face Llama folder (2 layers, hidden 32) whose tokenizer has the example's chat template."""
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("chat-model")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|pad|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text for _, text in stdlib_documents(8)], trainer=trainer)
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                           pad_token="<|pad|>")
    hf_tokenizer.chat_template = SFT_TEMPLATE.read_text(encoding="utf-8")
    hf_tokenizer.save_pretrained(folder)
    eos_id = hf_tokenizer.eos_token_id
    config = AutoConfig.for_model("llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=2, intermediate_size=64, vocab_size=len(hf_tokenizer),
                                  max_position_embeddings=1024, bos_token_id=eos_id, eos_token_id=eos_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    assert (folder / "chat_template.jinja").is_file()
    return folder


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``next_line_ppl``: the built-in task's items as a loglikelihood task (context -> its true next line)."""
    folder = tmp_path_factory.mktemp("tasks")
    items = next_line_items(stdlib_documents(), NUM_ITEMS)
    data = folder / "next_line_ppl.jsonl"
    data.write_text("".join(json.dumps({"context": item["context"], "target": item["choices"][item["gold"]]}) + "\n"
                            for item in items), encoding="utf-8")
    config = {"task": TASK, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
              "test_split": "test", "fewshot_split": "test", "num_fewshot": NUM_FEWSHOT,
              "output_type": "loglikelihood", "doc_to_text": "context", "doc_to_target": "target",
              "target_delimiter": "\n",
              "metric_list": [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False}],
              "metadata": {"version": 1.0}}
    (folder / "next_line_ppl.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    return folder


def command_results(results: dict) -> list[TaskResult]:
    """The command's numbers, read from its JSON by hand (not through trainer.eval.downstream)."""
    metrics, num_samples = results["results"][TASK], results["n-samples"][TASK]["effective"]
    stderr = metrics["perplexity_stderr,none"]
    return [TaskResult(TASK, "perplexity", metrics["perplexity,none"], None if stderr == "N/A" else stderr,
                       num_samples)]


@pytest.mark.slow
def test_chat_template_scores_equal_the_lm_eval_commands(chat_model_dir: Path, task_folder: Path,
                                                         tmp_path: Path) -> None:
    with_template = run_task(chat_model_dir, TASK, [task_folder], chat_template=True)
    command = command_results(lm_eval_command_results(chat_model_dir, task_folder, tmp_path / "out",
                                                      "--apply_chat_template", task=TASK))
    assert with_template == command
    assert with_template[0].num_samples == NUM_ITEMS and with_template[0].value > 1
    (without,) = run_task(chat_model_dir, TASK, [task_folder])
    assert without.value != pytest.approx(with_template[0].value, rel=1e-3), "the template moves every score"
