"""trainer/eval/downstream.py against the real lm-eval: its numbers equal the ``lm_eval`` command's; bad tasks are
refused.

A tiny local Llama (random weights, a 512-token BPE trained on standard-library source) and the built-in
next-line task made from standard-library files: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import random
import string
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from core.errors import ConfigError
from core.files.atomic import write_text_atomic
from trainer.eval.downstream import TaskResult, check_tasks, run_task, task_texts
from trainer.eval.next_line_task import TASK_NAME, next_line_items, write_next_line_task

STDLIB = Path(sysconfig.get_paths()["stdlib"])
NUM_ITEMS = 40
CLI_TIMEOUT_S = 300


def stdlib_documents(num_files: int = 60) -> list[tuple[str, str]]:
    return [(path.name, path.read_text(encoding="utf-8")) for path in sorted(STDLIB.glob("*.py"))[:num_files]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face Llama folder (2 layers, hidden 32, random weights) with a byte-level BPE tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("model")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text for _, text in stdlib_documents(8)], trainer=trainer)
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    hf_tokenizer.save_pretrained(folder)
    eos_id = hf_tokenizer.eos_token_id
    config = AutoConfig.for_model("llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=2, intermediate_size=64, vocab_size=len(hf_tokenizer),
                                  max_position_embeddings=512, bos_token_id=eos_id, eos_token_id=eos_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def next_line_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tasks")
    write_next_line_task(folder, next_line_items(stdlib_documents(), NUM_ITEMS), write_text_atomic)
    return folder


def lm_eval_command_results(model_dir: Path, include_dir: Path, output_dir: Path, *extra: str,
                            task: str = TASK_NAME) -> dict:
    """The results JSON the ``lm_eval`` command writes for the settings run_task uses."""
    command = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
               f"pretrained={model_dir},dtype=float32", "--tasks", task, "--include_path", str(include_dir),
               "--device", "cpu", "--batch_size", "8", "--output_path", str(output_dir), *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "LMEVAL_LOG_LEVEL": "WARNING"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (results_file,) = output_dir.rglob("results_*.json")
    return json.loads(results_file.read_text(encoding="utf-8"))


def as_task_results(results: dict) -> list[TaskResult]:
    """The command's numbers, read from its JSON by hand (not through trainer.eval.downstream)."""
    metrics, num_samples = results["results"][TASK_NAME], results["n-samples"][TASK_NAME]["effective"]
    return [TaskResult(TASK_NAME, metric, metrics[f"{metric},none"], metrics[f"{metric}_stderr,none"], num_samples)
            for metric in ("acc", "acc_norm")]


@pytest.mark.slow
def test_run_task_gives_the_numbers_of_the_lm_eval_command(model_dir: Path, next_line_folder: Path,
                                                           tmp_path: Path) -> None:
    in_process = run_task(model_dir, TASK_NAME, [next_line_folder])
    command = as_task_results(lm_eval_command_results(model_dir, next_line_folder, tmp_path / "out"))
    assert in_process == command
    assert [result.num_samples for result in in_process] == [NUM_ITEMS, NUM_ITEMS]
    assert all(0.0 <= result.value <= 1.0 and result.stderr and result.stderr > 0 for result in in_process)


@pytest.mark.slow
def test_run_task_with_a_limit_scores_that_many_documents(model_dir: Path, next_line_folder: Path) -> None:
    results = run_task(model_dir, TASK_NAME, [next_line_folder], batch_size=4, limit=5)
    assert [(result.metric, result.num_samples) for result in results] == [("acc", 5), ("acc_norm", 5)]


def test_run_task_counts_the_requests_it_scores_and_draws_no_bar(model_dir: Path, next_line_folder: Path,
                                                                  capfd: pytest.CaptureFixture[str]) -> None:
    # lm-eval's own tqdm bars ("Tokenizing inputs", "Running loglikelihood requests") scrolled above tokenmill's.
    reports: list[tuple[int, int]] = []
    results = run_task(model_dir, TASK_NAME, [next_line_folder], batch_size=4, limit=5,
                       on_progress=lambda done, total: reports.append((done, total)))
    assert [(result.metric, result.num_samples) for result in results] == [("acc", 5), ("acc_norm", 5)]
    total = reports[0][1]
    assert total > 5 and total % 5 == 0, "every choice of every document is a request"
    assert reports == [(done, total) for done in range(total + 1)]
    printed = capfd.readouterr().err
    assert "Running loglikelihood requests" not in printed and "Tokenizing inputs" not in printed


def near_tie_task(folder: Path) -> list[dict]:
    """Items whose choices are single letters: the model's scores for them differ by hundredths of a nat."""
    rng = random.Random(0)
    lines = [line for line in (STDLIB / "textwrap.py").read_text(encoding="utf-8").splitlines()
             if len(line.strip()) > 20][:40]
    items = [{"context": line, "choices": rng.sample(string.ascii_lowercase, 4), "gold": rng.randrange(4)}
             for line in lines]
    data = folder / "near_ties.jsonl"
    folder.mkdir()
    data.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
    write_task_yaml(folder, "near_ties", f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                    f"test_split: test\n{MULTIPLE_CHOICE}target_delimiter: \"\\n\"\n")
    return items


def float32_choice_scores(model_dir: Path, items: list[dict]) -> list[list[float]]:
    """log P("\\n" + choice | context) by transformers in float32, with lm-eval's split of the tokens.

    One forward per item: its four continuations are two tokens each ("\\n", a letter), so no padding.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    scores = []
    for item in items:
        num_context_tokens = len(tokenizer(item["context"], add_special_tokens=False).input_ids)
        ids = torch.tensor([tokenizer(item["context"] + "\n" + choice, add_special_tokens=False).input_ids
                            for choice in item["choices"]])
        with torch.inference_mode():
            log_probs = torch.log_softmax(model(ids[:, :-1]).logits, dim=-1)[:, num_context_tokens - 1:]
        scores.append(log_probs.gather(2, ids[:, num_context_tokens:, None]).sum(dim=(1, 2)).tolist())
    return scores


@pytest.mark.slow
def test_run_task_scores_in_float32(model_dir: Path, tmp_path: Path) -> None:
    """Near ties: lower precision (bfloat16 rounds these log-likelihoods to 1/32 of a nat) picks other letters."""
    items = near_tie_task(tmp_path / "tasks")
    scores = float32_choice_scores(model_dir, items)
    margins = [sorted(item_scores)[-1] - sorted(item_scores)[-2] for item_scores in scores]
    assert min(margins) > 1e-4 and sorted(margins)[len(margins) // 2] < 0.1  # close calls, but float32-stable
    expected = sum(item_scores.index(max(item_scores)) == item["gold"]
                   for item, item_scores in zip(items, scores, strict=True)) / len(items)
    (acc,) = [result for result in run_task(model_dir, "near_ties", [tmp_path / "tasks"]) if result.metric == "acc"]
    assert (acc.value, acc.num_samples) == (expected, len(items))


def test_run_task_refuses_a_folder_that_is_no_model(next_line_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        run_task(tmp_path, TASK_NAME, [next_line_folder])


def copy_task(source_folder: Path, target_folder: Path) -> Path:
    """The next-line task in a folder of its own, its YAML reading the copied JSONL."""
    target_folder.mkdir()
    data = target_folder / f"{TASK_NAME}.jsonl"
    data.write_bytes((source_folder / f"{TASK_NAME}.jsonl").read_bytes())
    yaml_text = (source_folder / f"{TASK_NAME}.yaml").read_text(encoding="utf-8")
    (target_folder / f"{TASK_NAME}.yaml").write_text(yaml_text.replace(str(source_folder.resolve()),
                                                                       str(target_folder.resolve())))
    return data


def test_the_fingerprint_follows_the_data_and_the_yaml(next_line_folder: Path, tmp_path: Path) -> None:
    data = copy_task(next_line_folder, tmp_path / "tasks")
    first = check_tasks([TASK_NAME], [tmp_path / "tasks"])
    assert check_tasks([TASK_NAME], [tmp_path / "tasks"]) == first
    rows = data.read_text(encoding="utf-8").splitlines(keepends=True)
    data.write_text("".join(rows[:-1]), encoding="utf-8")
    fewer_rows = check_tasks([TASK_NAME], [tmp_path / "tasks"])
    assert fewer_rows[TASK_NAME] != first[TASK_NAME]
    yaml_path = tmp_path / "tasks" / f"{TASK_NAME}.yaml"
    yaml_path.write_text(yaml_path.read_text(encoding="utf-8").replace("version: 1.0", "version: 2.0"))
    assert check_tasks([TASK_NAME], [tmp_path / "tasks"])[TASK_NAME] not in (first[TASK_NAME], fewer_rows[TASK_NAME])


def test_task_texts_are_each_context_followed_by_each_choice(next_line_folder: Path) -> None:
    items = [json.loads(line) for line in (next_line_folder / f"{TASK_NAME}.jsonl").read_text().splitlines()]
    assert task_texts(TASK_NAME, [next_line_folder]) == [item["context"] + "\n" + choice
                                                         for item in items for choice in item["choices"]]


def write_task_yaml(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(f"task: {name}\n{body}", encoding="utf-8")
    return path


def assert_one_line_error(excinfo: pytest.ExceptionInfo[ConfigError], *parts: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message
    for part in parts:
        assert part in message


MULTIPLE_CHOICE = "output_type: multiple_choice\ndoc_to_text: context\ndoc_to_choice: choices\ndoc_to_target: gold\n"


def test_a_hub_dataset_is_refused_before_lm_eval_loads_it(tmp_path: Path) -> None:
    write_task_yaml(tmp_path / "tasks", "my_hellaswag", "dataset_path: hellaswag\nvalidation_split: validation\n"
                    + MULTIPLE_CHOICE)
    with pytest.raises(ConfigError) as excinfo:
        check_tasks(["my_hellaswag"], [tmp_path / "tasks"])
    assert_one_line_error(excinfo, "'my_hellaswag'", "'hellaswag'", "dataset_kwargs.data_files", "offline")


def test_hub_data_files_are_refused(tmp_path: Path) -> None:
    write_task_yaml(tmp_path / "tasks", "remote_json", "dataset_path: json\ndataset_kwargs:\n  data_files:\n"
                    "    test: hf://datasets/EleutherAI/arithmetic/data/two_digit_addition.jsonl\ntest_split: test\n"
                    + MULTIPLE_CHOICE)
    with pytest.raises(ConfigError) as excinfo:
        task_texts("remote_json", [tmp_path / "tasks"])
    assert_one_line_error(excinfo, "'remote_json'", "hf://datasets/EleutherAI", "not a local file", "data_files")


def test_a_builtin_lm_eval_task_is_refused_with_its_hub_dataset(tmp_path: Path) -> None:
    (tmp_path / "tasks").mkdir()
    with pytest.raises(ConfigError) as excinfo:
        check_tasks(["hellaswag"], [tmp_path / "tasks"])
    assert_one_line_error(excinfo, "'hellaswag'", "built-in", "Rowan/hellaswag", "dataset_kwargs.data_files")


def test_an_unknown_task_names_close_matches_and_eval_include(next_line_folder: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        check_tasks(["tokenmill_next_lines"], [next_line_folder])
    assert_one_line_error(excinfo, "'tokenmill_next_lines'", f"did you mean {TASK_NAME}", "eval.include")


def test_a_yaml_that_does_not_parse_is_named(next_line_folder: Path, tmp_path: Path) -> None:
    broken = write_task_yaml(tmp_path / "tasks", "broken", "dataset_path: json\ndataset_kwargs: {data_files: [\n")
    with pytest.raises(ConfigError) as excinfo:
        check_tasks([TASK_NAME], [next_line_folder, tmp_path / "tasks"])
    assert_one_line_error(excinfo, str(broken), "does not load")


def test_a_yaml_lm_eval_cannot_build_is_named(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"context": "a", "choices": ["b", "c"], "gold": 0}) + "\n")
    yaml_path = write_task_yaml(tmp_path / "tasks", "typo", f"dataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                f"    test: {data}\ntest_split: test\n{MULTIPLE_CHOICE}doc_to_txet: context\n")
    with pytest.raises(ConfigError) as excinfo:
        check_tasks(["typo"], [tmp_path / "tasks"])
    assert_one_line_error(excinfo, "'typo'", str(yaml_path), "doc_to_txet")


def test_a_missing_data_file_is_named_with_its_task(tmp_path: Path) -> None:
    missing = tmp_path / "gone.jsonl"
    write_task_yaml(tmp_path / "tasks", "lost", f"dataset_path: json\ndataset_kwargs:\n  data_files:\n"
                    f"    test: {missing}\ntest_split: test\n{MULTIPLE_CHOICE}")
    with pytest.raises(ConfigError) as excinfo:
        check_tasks(["lost"], [tmp_path / "tasks"])
    assert_one_line_error(excinfo, "'lost'", str(missing), "does not exist")


def test_a_metric_lm_eval_would_download_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"context": "a", "choices": ["b", "c"], "gold": 0}) + "\n")
    write_task_yaml(tmp_path / "tasks", "rouge_task", f"dataset_path: json\ndataset_kwargs:\n  data_files:\n"
                    f"    test: {data}\ntest_split: test\n{MULTIPLE_CHOICE}metric_list:\n  - metric: rouge\n")
    with pytest.raises(ConfigError) as excinfo:
        check_tasks(["rouge_task"], [tmp_path / "tasks"])
    assert_one_line_error(excinfo, "'rouge_task'", "'rouge'", "evaluate hub")


def test_a_missing_include_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        check_tasks([TASK_NAME], [tmp_path / "no-such-folder"])
    assert_one_line_error(excinfo, str(tmp_path / "no-such-folder"), "eval.include")


def test_a_group_of_local_tasks_is_checked_member_by_member(next_line_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "tasks"
    copy_task(next_line_folder, folder)
    (folder / "lines.yaml").write_text(f"group: lines\ntask:\n  - {TASK_NAME}\n  - hub_member\n")
    write_task_yaml(folder, "hub_member", "dataset_path: piqa\nvalidation_split: validation\n" + MULTIPLE_CHOICE)
    with pytest.raises(ConfigError) as excinfo:
        check_tasks(["lines"], [folder])
    assert_one_line_error(excinfo, "'hub_member'", "'piqa'", "data_files")
    (folder / "hub_member.yaml").unlink()
    (folder / "lines.yaml").write_text(f"group: lines\ntask:\n  - {TASK_NAME}\n")
    assert set(check_tasks(["lines"], [folder])) == {"lines"}


def test_the_eval_tasks_stage_builds_the_tasks_again_only_when_a_file_they_read_changed(
        next_line_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer.eval.downstream as downstream
    from core.rundir import RunPaths
    from trainer.config import EvalConfig
    from trainer.eval.tasks import prepare_eval_tasks

    folder = tmp_path / "tasks"
    data = copy_task(next_line_folder, folder)
    (folder / "lines.yaml").write_text(f"group: lines\ntask:\n  - {TASK_NAME}\n")
    checks: list[list[str]] = []
    real_check = downstream.checked_tasks
    monkeypatch.setattr(downstream, "checked_tasks",
                        lambda names, dirs, *args, **options: checks.append(names) or real_check(names, dirs, *args,
                                                                                                 **options))
    paths, config = RunPaths(tmp_path / "run"), EvalConfig(tasks=["lines"], include=["tasks"])
    first = prepare_eval_tasks(paths, config, tmp_path)
    assert prepare_eval_tasks(paths, config, tmp_path) == {**first, "skipped": True}
    assert len(checks) == 1  # the second call read the recorded summary: lm-eval built nothing
    data.write_text("".join(data.read_text(encoding="utf-8").splitlines(keepends=True)[:-1]), encoding="utf-8")
    changed = prepare_eval_tasks(paths, config, tmp_path)
    assert len(checks) == 2 and changed["tasks"]["lines"] != first["tasks"]["lines"]
    assert changed["num_items"]["lines"] < first["num_items"]["lines"]
