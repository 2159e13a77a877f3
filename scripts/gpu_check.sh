#!/usr/bin/env bash
# The GPU check in one command, on a fresh GPU machine with only its image's torch and transformers and the wheels
# scripts/gpu_wheels.sh put in ./.whl: `stoa bench gpu` (trainer step and MFU, preflight vs peak, decode vs HF
# generate, PULSE from GPU tensors, a fleet that learns), a verdict line per item, in under 8 minutes on one H200.
# With $OUT set, also writes $OUT/gpu_check.jsonl (one row per item) and $OUT/gpu_check.log; then the FSDP2 rows
# of `stoa bench dist` when several GPUs are visible. Steps: docs/gpu.md.
#
# Usage: scripts/gpu_check.sh [stoa bench gpu flags]     (PYTHON=python3 by default)
#        GPU_CHECK_DEVICE=cpu scripts/gpu_check.sh --quick (a rehearsal on a machine without a GPU)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export STOA_CACHE=${STOA_CACHE:-/tmp/stoa-gpu-cache}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
need="stoa.cli, stoa.bench.gpu, stoa.trainer.loop, stoa.worker, torch, transformers, safetensors, tokenizers, xxhash, zstandard, cryptography"
if ! "$PY" -c "import ${need}" 2>/tmp/gpu_check_import.err; then
  echo "gpu_check: cannot import stoa's trainer and worker: $(tail -1 /tmp/gpu_check_import.err); run scripts/gpu_wheels.sh here and carry .whl (docs/gpu.md)" >&2
  exit 2
fi
LOG=/dev/null JSONL=()
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; LOG="$OUT/gpu_check.log"; JSONL=(--out "$OUT/gpu_check.jsonl"); fi
{ nvidia-smi -L 2>/dev/null; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null; } | tee -a "$LOG"
"$PY" -m stoa bench gpu --device "$DEVICE" "${JSONL[@]}" "$@" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${GPUS:-0}" -gt 1 ]; then
  echo "== FSDP2 on $GPUS GPUs" | tee -a "$LOG"
  timeout 300 "$PY" -m stoa bench dist --device cuda --dtype bfloat16 --nproc "$GPUS" --compare --model llama-1b \
    --groups 8 --n-samples 8 --prompt-tokens 128 --max-new-tokens 256 --repeats 3 --mode packed --micro-batch 16 \
    2>&1 | tee -a "$LOG" || status=1
fi
exit "$status"
