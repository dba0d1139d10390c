#!/usr/bin/env bash
# Acceptance run on a GPU node: harness doctor, then the small versions of the source experiments
# (configs/cluster/acceptance.yaml), the CI gate on what the sources found, vLLM's forced-decode
# replay of the batch-8 runs (GPU only), and the HTML report.
# Without a GPU it says so and runs the CPU subset (configs/acceptance-cpu.yaml).
#
#   scripts/gpu_acceptance.sh [RESULTS_ROOT]        results go to RESULTS_ROOT/acceptance-<GPU or cpu>
#   ENGINES=llamacpp scripts/gpu_acceptance.sh      only these engines' cells (comma-separated)
#   ENGINES=transformers scripts/gpu_acceptance.sh  only the transformers run (it needs no build)
#   ENGINES=vllm scripts/gpu_acceptance.sh          vLLM's batch-invariant part, then the acceptance's vLLM cells
#   VLLM_BUDGET_S=900                               the vLLM part's hard limit (its results so far are kept)
#   HARNESS="python -m harness" ...                 how to call the harness (default: harness)
#
# Exit code: 0 when every cell ran and every rule held, else 1.
set -uo pipefail
cd "$(dirname "$0")/.."
root="${1:-results}"
read -r -a harness <<<"${HARNESS:-harness}"

gpu=""
if command -v nvidia-smi >/dev/null 2>&1; then
    gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)"
fi
if [ -n "$gpu" ]; then
    config=configs/cluster/acceptance.yaml
    out="$root/acceptance-$(echo "$gpu" | tr -c 'A-Za-z0-9.\n-' '-')"
    echo "GPU: $gpu -> $config"
else
    config=configs/acceptance-cpu.yaml
    out="$root/acceptance-cpu"
    echo "no GPU found (nvidia-smi absent or lists none): running the CPU subset $config"
fi
where=()
if [ -n "${ENGINES:-}" ]; then
    IFS=, read -r -a engines <<<"$ENGINES"
    for e in "${engines[@]}"; do where+=(--where "engine=$e"); done
    [ "${#engines[@]}" -gt 1 ] && { echo "ENGINES: give one engine (a cell has one)" >&2; exit 2; }
fi

# First, on a GPU: the transformers engine, which needs nothing but the node's torch and transformers
# (no llama.cpp build, no vLLM wheels): bf16 and f32, batch 1, 8 and 32, padded and continuous.
tf_rc=0
tf_out=""
if [ -n "$gpu" ] && { [ -z "${ENGINES:-}" ] || [ "${ENGINES}" = transformers ]; }; then
    tf_out="$root/transformers-$(echo "$gpu" | tr -c 'A-Za-z0-9.\n-' '-')"
    mkdir -p "$tf_out"
    "${harness[@]}" run configs/cluster/transformers-gpu.yaml --out "$tf_out" || tf_rc=1
    "${harness[@]}" check "$tf_out" --junit "$tf_out/junit.xml" || tf_rc=1
    "${harness[@]}" summarize "$tf_out" -f csv --what probes >"$tf_out/probes.csv" 2>&1
    "${harness[@]}" summarize "$tf_out" 2>&1 | tee "$tf_out/summary.txt"
    [ "${ENGINES:-}" = transformers ] && exit "$tf_rc"
fi

# Then, where vLLM is there: its batch-invariant mode off and on at batch 1, 8 and 32 on the shipped model,
# timed (scripts/gpu_vllm_batch_invariant.sh).
vl_rc=0
vl_out=""
if [ -n "$gpu" ] && { [ -z "${ENGINES:-}" ] || [ "${ENGINES}" = vllm ]; }; then
    vl_out="$root/vllm-batch-invariant-$(echo "$gpu" | tr -c 'A-Za-z0-9.\n-' '-')"
    bash scripts/gpu_vllm_batch_invariant.sh "$vl_out" || vl_rc=1
fi

mkdir -p "$out"
"${harness[@]}" doctor "$config" 2>&1 | tee "$out/doctor.txt"
doctor_rc=${PIPESTATUS[0]}
[ "$doctor_rc" -eq 0 ] || echo "doctor: a piece this experiment needs is missing (above); its cells will fail or be skipped"
"${harness[@]}" run "$config" --out "$out" "${where[@]}"
run_rc=$?
"${harness[@]}" check "$out" --junit "$out/junit.xml"
check_rc=$?
if [ -n "$gpu" ] && [ "${ENGINES:-vllm}" = vllm ]; then
    # forced-decode replay on the GPU (vLLM's forcing logits processor): the batch-8 runs, each in its
    # own batch; no step should split, and the deltas say how far a replay moves the log-probabilities
    "${harness[@]}" replay "$out" --where engine=vllm --where batch_size=8 \
        || echo "replay: vLLM's forced decoding failed on this GPU (above)"
fi
"${harness[@]}" report "$out"
echo "another GPU type: run this script on its node, then: harness compare $out $root/acceptance-<other GPU>"

# A summary to paste into an issue as it is (also kept as $out/acceptance-summary.md)
{
    echo '```'
    echo "gpu_acceptance.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname) ($(nproc) cores)"
    if [ -n "$gpu" ]; then
        nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv,noheader 2>/dev/null \
            | sed 's/^/gpu: /'
    else
        echo "gpu: none (CPU subset)"
    fi
    echo "config: $config${ENGINES:+ (ENGINES=$ENGINES)}; HARNESS_NATIVE_PRELOAD=${HARNESS_NATIVE_PRELOAD:-auto}"
    echo "exit codes: ${tf_out:+transformers $tf_rc, }${vl_out:+vllm batch-invariant $vl_rc, }doctor $doctor_rc, run $run_rc, check $check_rc"
    grep -E '^ *(MISSING|ok|GPU:|llamacpp|llama-server|vllm)' "$out/doctor.txt" | cut -c1-240
    [ -n "$vl_out" ] && cat "$vl_out/elapsed.txt" "$vl_out/evidence.txt" 2>/dev/null
    "${harness[@]}" status "$out" 2>&1 | head -n 12
    "${harness[@]}" summarize "$out" 2>/dev/null | grep -E '^(batch_size|[a-z_]+=)' | cut -c1-240
    echo '```'
} | tee "$out/acceptance-summary.md"
[ "$run_rc" -eq 0 ] && [ "$check_rc" -eq 0 ] && [ "$tf_rc" -eq 0 ] && [ "$vl_rc" -eq 0 ]
