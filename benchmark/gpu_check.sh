#!/usr/bin/env bash
# One-shot check on a CUDA machine (under 8 minutes on one H200: each part has its own timeout), run from the repository root:
#   bash benchmark/gpu_check.sh
# 1. every Triton kernel test natively on CUDA (fp32, fp16, bf16)
# 2. the engine end to end on tiny models on CUDA, greedy-compared with transformers
# 3. kernel throughput: decode attention GB/s, fused MoE TFLOP/s vs the unfused torch twin
# 4. offline throughput of the default model on CUDA
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET

part() {
    local name=$1
    shift
    echo "=== ${name}"
    local start=$SECONDS
    "$@"
    echo "=== ${name}: $((SECONDS - start)) s"
}

python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
part "kernel tests (CUDA)" timeout 150 python -m pytest tests -q -x -m triton -p no:cacheprovider
part "engine vs transformers (CUDA)" env LMDEPLOY_TEST_DEVICE=cuda timeout 150 python -m pytest -q -x \
    -p no:cacheprovider tests/test_engine_correctness.py tests/test_bad_input.py
part "kernel throughput" timeout 90 python benchmark/kernel_bench.py --device cuda
part "offline throughput (default model, CUDA)" timeout 90 python benchmark/throughput.py --skip-hf --device cuda \
    || echo "offline throughput did not run: the default model must already be in ~/.cache/lmdeploy/models"
