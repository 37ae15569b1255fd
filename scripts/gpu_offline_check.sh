#!/bin/bash
# `make test-gpu`'s first line on a bare CUDA machine with no package index (docs/gpu-runs.md).
# Put the wheels the image lacks in .whl/ first (here: pydantic + pydantic-core, annotated-types,
# typing-inspection, megatron-core 0.16.1, openai with httpx2/httpcore2/jiter/sniffio/truststore),
# downloaded for the machine's Python with `pip download --no-deps --only-binary=:all:`.
# Usage: OUT=/some/dir [T=seconds] scripts/gpu_offline_check.sh [pytest args, default: tests]
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -3
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . -e ./spec \
    -e ./adapters/fsdp -e ./adapters/megatron -e ./adapters/sglang -e ./adapters/vllm 2>&1 | tail -5
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee -a "$OUT/env.txt"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
[ $# -gt 0 ] || set -- tests
timeout "${T:-450}" python3 -m pytest -m gpu "$@" -p no:cacheprovider --continue-on-collection-errors \
    --timeout=150 -rA -q --durations=15 --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/log.txt" | grep -v -E "^(PASSED|SKIPPED)" | tail -150
