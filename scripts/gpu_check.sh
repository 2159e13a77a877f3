#!/usr/bin/env bash
# FSDP2 trainer-step figures on this machine's GPUs, in under 10 minutes: `stoa bench dist` at world size 1 and on
# every visible GPU (FSDP2, compared bit for bit with the world-size-1 run), for SmolLM2-135M (when its cache or
# wheel is at hand) and a random ~1.1B Llama built locally. Prints the tables; with $OUT set, also writes
# $OUT/gpu_check.jsonl (one row per setting) and $OUT/gpu_check.log.
#
# Usage: scripts/gpu_check.sh            (from anywhere; PYTHON=python3 by default)
# Needs: torch with CUDA, transformers, safetensors, tokenizers, xxhash, numpy. Nothing is downloaded: stoa runs
# from this checkout (PYTHONPATH); a missing package can be put as wheels in ./.whl (see the device notes).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if ! "$PY" -c "import stoa.cli, stoa.bench.dist, torch, transformers, safetensors, tokenizers, xxhash" 2>/tmp/gpu_check_import.err; then
  echo "gpu_check: cannot import stoa's trainer side: $(tail -1 /tmp/gpu_check_import.err); install it (pip install -e '.[trainer]') or put the missing wheels in .whl/" >&2
  exit 2
fi
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "${GPUS:-0}" -lt 1 ]; then
  echo "gpu_check: no CUDA device visible (torch.cuda.device_count() is 0); run this on a machine with a GPU" >&2
  exit 2
fi
LOG=/dev/null JSONL=()
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; LOG="$OUT/gpu_check.log"; JSONL=(--out "$OUT/gpu_check.jsonl"); fi
nvidia-smi -L 2>/dev/null | tee -a "$LOG"
echo "gpu_check: $GPUS GPU(s); torch $("$PY" -c 'import torch; print(torch.__version__)')" | tee -a "$LOG"

bench() {  # bench SECONDS ARGS...: one `stoa bench dist` at world size 1 and, with several GPUs, FSDP2 on all
  local secs=$1; shift
  local world=(--nproc 1)
  [ "$GPUS" -gt 1 ] && world=(--nproc "$GPUS" --compare)
  echo "== stoa bench dist $* ${world[*]}" | tee -a "$LOG"
  timeout "$secs" "$PY" -m stoa bench dist --device cuda --dtype bf16 "${world[@]}" "${JSONL[@]}" "$@" 2>&1 \
    | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || echo "gpu_check: the run above exited $rc (124: over its ${secs}s)" | tee -a "$LOG"
  return "$rc"
}

status=0
cache=${STOA_CACHE:-$HOME/.cache/stoa}/models/smollm2-135m
if [ -f "$cache/model.safetensors" ] || [ -n "${GPU_CHECK_PULL:-}" ]; then
  bench 180 --model smollm2-135m --groups 8 --n 8 --prompt-tokens 128 --tokens 128 --repeats 3 || status=1
else
  echo "gpu_check: skipping smollm2-135m (not in $cache; GPU_CHECK_PULL=1 tries \`stoa model pull\`)" | tee -a "$LOG"
fi
bench 360 --model llama-1b --groups 8 --n 8 --prompt-tokens 128 --tokens 256 --repeats 3 --mode packed \
  --micro-batch 16 || status=1
[ "$GPUS" -gt 1 ] || echo "gpu_check: one GPU, so no FSDP2 row (world size 1 only)" | tee -a "$LOG"
exit "$status"
