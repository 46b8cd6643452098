#!/usr/bin/env bash
# The checks CPU CI cannot make, on one NVIDIA GPU (docs/parallelism.md, "GPU-only and untested paths"):
# MFU of the 125m preset (seq 1024, bf16; goal >= 45%), fp16 loss scaling on CUDA, NVML energy per token
# and the GPU peak table in train_metrics. Downloads nothing: install first, with a CUDA build of torch,
#   pip install -e ".[test,gpu]"
# then, from the repo root (estimated 3-5 minutes on one H100/H200):
#   bash benchmarks/gpu_check.sh 2>&1 | tee gpu_check.log
set -euo pipefail

PYTHON="${PYTHON:-.venv/bin/python}"
BENCH=(-m benchmarks.train_step --preset 125m --seq-len 1024 --precision bf16 --vocab-size 32000)
TESTS=tests/trainer
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

echo "== 1/5 the GPU"
nvidia-smi -L
"$PYTHON" -c 'import torch; assert torch.cuda.is_available(), "torch sees no CUDA GPU: install a CUDA build of torch"
print("torch", torch.__version__, "cuda", torch.version.cuda, "->", torch.cuda.get_device_name())'
"$PYTHON" -c 'import pynvml' || { echo 'nvidia-ml-py is not installed: pip install -e ".[gpu]" first'; exit 1; }

echo "== 2/5 MFU: 125m preset, seq 1024, bf16, eager (goal >= 45%; both variants on the GPU)"
"$PYTHON" "${BENCH[@]}"

echo "== 3/5 fp16 on CUDA: GradScaler skips an overflowing step, halves and regrows the scale, checkpoints it"
"$PYTHON" -m pytest -q -p no:cacheprovider \
    "$TESTS/test_precision.py::test_fp16_overflow_skips_the_step_halves_the_scale_then_grows_it_back" \
    "$TESTS/test_precision.py::test_bf16_computes_in_bf16_but_keeps_fp32_master_weights_and_optimizer_state"

echo "== 4/5 train_metrics on CUDA: energy_j_per_token (NVML) not null, peak from the GPU table"
"$PYTHON" -m pytest -q -p no:cacheprovider --basetemp "$scratch/pytest" \
    "$TESTS/test_telemetry.py::test_train_metrics_tensorboard_and_profile_trace"
"$PYTHON" - "$scratch/pytest" <<'EOF'
import json, pathlib, sys

for path in {p.resolve() for p in pathlib.Path(sys.argv[1]).glob("*/run/metrics/train.jsonl")}:  # + a symlink
    for row in map(json.loads, path.read_text().splitlines()):
        print({key: row[key] for key in ("step", "energy_j_per_token", "mfu", "device_peak_tflops",
                                         "peak_memory_bytes")})
EOF

echo "== 5/5 MFU as in 2/5, each decoder block torch.compile'd"
"$PYTHON" "${BENCH[@]}" --compile
