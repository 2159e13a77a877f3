#!/usr/bin/env bash
# Download, here, the wheels the GPU check needs that the GPU machine's image lacks, into ./.whl (ignored by git):
# zstandard (PULSE patches), cryptography with cffi and pycparser (the run's signed contract). The image already
# holds torch, transformers, safetensors, tokenizers, numpy and xxhash (docs/gpu.md). Its python is 3.12;
# PY_VERSION=3.11 (say) fetches for another. The wheels travel with the working tree (carry `.whl`, ~10 MB).
set -euo pipefail
cd "$(dirname "$0")/.." || exit 2
PYV=${PY_VERSION:-3.12}
WHEELS=(zstandard==0.25.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12)
mkdir -p .whl
for w in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$w"
done
ls -la .whl
echo "gpu_wheels: $(find .whl -type f -name '*.whl' | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl (carry it: .whl)"
