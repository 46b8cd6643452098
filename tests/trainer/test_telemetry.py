"""trainer/metrics/telemetry.py, trainer/callbacks.py, trainer/metrics/sink.py: the train_metrics columns, TensorBoard
events, profiler traces."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch

from core.rundir import RunPaths
from tests.trainer.conftest import MakeRunDir
from trainer.metrics.sink import read_metric_rows
from trainer.metrics.telemetry import (
    EnergyMeter,
    device_peak,
    energy_unavailable_message,
    gpu_table_peak,
    peak_memory_bytes,
    probe_matmul_tflops,
    warn_once,
)
from trainer.model.llama import ModelShape, flops_per_token
from trainer.train import main

TELEMETRY_COLUMNS = {"step", "loss", "lr", "grad_norm", "tokens_seen", "tokens_per_s", "step_time_s", "data_wait_s",
                     "fwd_bwd_s", "optimizer_s", "peak_memory_bytes", "model_tflops_per_s", "mfu",
                     "device_peak_tflops", "energy_j_per_token", "skipped_steps", "loss_scale", "epoch"}


def test_train_metrics_tensorboard_and_profile_trace(make_run_dir: MakeRunDir) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # Also run on a GPU by benchmarks/gpu_check.sh: there NVML (nvidia-ml-py) must report the energy.
    on_gpu = torch.cuda.is_available()
    measures_energy = on_gpu and importlib.util.find_spec("pynvml") is not None
    run_dir = make_run_dir(train={"max_steps": 4, "log_every": 2, "profile_steps": [3]})
    assert main(["--run-dir", str(run_dir)]) == 0
    rows = read_metric_rows(run_dir / "metrics" / "train.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 4]
    for row in rows:
        assert set(row) == TELEMETRY_COLUMNS
        assert row["step_time_s"] == pytest.approx(row["data_wait_s"] + row["fwd_bwd_s"] + row["optimizer_s"])
        assert row["mfu"] == pytest.approx(row["model_tflops_per_s"] / row["device_peak_tflops"])
        # A GPU counts the tiny model's tensors only; a CPU the process's resident set (interpreter, torch).
        assert 0 < row["mfu"] < 1 and row["peak_memory_bytes"] > (0 if on_gpu else 10 * 2**20)
        assert (row["energy_j_per_token"] is not None) == measures_energy and row["loss_scale"] is None  # fp32

    event_files = list((run_dir / "metrics" / "tensorboard" / "train").glob("events.out.tfevents.*"))
    assert len(event_files) == 1
    events = EventAccumulator(str(event_files[0].parent)).Reload()
    assert {"train/loss", "train/mfu", "train/tokens_per_s", "eval/val_loss"} <= set(events.Tags()["scalars"])
    assert [event.step for event in events.Scalars("train/loss")] == [1, 2, 4]
    assert events.Scalars("train/loss")[-1].value == pytest.approx(rows[-1]["loss"])

    trace = json.loads((run_dir / "metrics" / "profile" / "step-0000003-rank-0.json").read_text())
    assert any("aten::mm" in str(event.get("name")) for event in trace["traceEvents"])
    assert sorted(p.name for p in (run_dir / "metrics" / "profile").iterdir()) == ["step-0000003-rank-0.json"]


def test_device_peak_comes_from_the_recipe_a_gpu_table_or_a_cached_probe(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    assert device_peak(cpu, "fp32", 123.0, None).tflops == 123.0
    assert gpu_table_peak("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert gpu_table_peak("NVIDIA H100 PCIe", "bf16") == 756.0
    assert gpu_table_peak("NVIDIA H200", "fp32") == 67.0 and gpu_table_peak("NVIDIA A100-SXM4-40GB", "fp16") == 312
    assert gpu_table_peak("Tesla T4", "fp16") is None
    paths = RunPaths(tmp_path)
    cache = paths.device_peak
    probed = device_peak(cpu, "fp32", None, paths)
    assert probed.source.startswith("probe") and probed.tflops > 0 and cache.is_file()
    cache.write_text(json.dumps({**json.loads(cache.read_text()), "tflops": 1.5}))
    assert device_peak(cpu, "fp32", None, paths) == type(probed)(1.5, "probe (cached)")  # the run's number is kept


def test_the_device_probe_leaves_trainings_random_state_alone() -> None:
    """How many sizes the probe tries depends on timing: drawing from the global RNG made dropout differ from run to
    run (seen as a LoRA run with dropout that did not resume bitwise, tests/trainer/test_lora.py)."""
    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert probe_matmul_tflops("fp32", max_size=512, num_trials=2) > 0
    assert torch.equal(torch.get_rng_state(), before)


def test_flops_per_token_counts_attention_and_memory_is_measured() -> None:
    from trainer.config import MODEL_PRESETS

    shape = ModelShape(MODEL_PRESETS["125m"], vocab_size=32_000, max_seq_len=2048)
    num_params = 110_000_000
    assert flops_per_token(shape, num_params) == 6 * num_params + 12 * 12 * 768 * 2048
    assert peak_memory_bytes(torch.device("cpu")) > 0
    assert EnergyMeter(torch.device("cpu")).joules() is None


def test_energy_meter_warns_on_a_gpu_without_nvml_and_stays_silent_on_a_cpu() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert EnergyMeter(torch.device("cpu")).joules() is None
    missing = ImportError("No module named 'pynvml'", name="pynvml")
    assert energy_unavailable_message("cpu", missing) is None
    assert energy_unavailable_message("cuda", None) is None  # NVML works: nothing to say
    assert 'pip install -e ".[gpu]"' in energy_unavailable_message("cuda", missing)
    no_counter = energy_unavailable_message("cuda", RuntimeError("NVMLError_NotSupported: Not Supported"))
    assert "Volta or newer" in no_counter and "NotSupported" in no_counter
    with pytest.warns(UserWarning) as record:
        for _ in range(3):  # every TrainingLoop built in a process makes an EnergyMeter
            warn_once("energy_j_per_token will be null: test_telemetry's own message")
    assert len(record) == 1
