#!/usr/bin/env bash
# vLLM's batch-invariant mode on a GPU node, as GPU users quote its cost: the mode off and on at batch 1, 8
# and 32 on the shipped model's float export (configs/cluster/vllm-batch-invariant.yaml: two loads, 90
# generations), timed against its 8-minute budget on an H100-class node, start-ups included. Prints the
# throughput and the mode's slowdown (with start-up s off / on), TTFT / ITL / TPOT percentiles, the
# per-setting verdicts (a mode on by flag whose batched runs depart is `mode_ineffective`) and the mode's
# evidence per cell (what vLLM reported in force). scripts/gpu_acceptance.sh runs it first on a GPU.
#
#   scripts/gpu_vllm_batch_invariant.sh [OUT]      default OUT: results/vllm-batch-invariant
#   VLLM_CONFIG=FILE                               another experiment in its place (a model of your own)
#   VLLM_BUDGET_S=900                              its hard limit (results so far are kept; rerun resumes)
#   HARNESS="python -m harness"                    how to call the harness (default: harness)
#
# Exit code: 0 when doctor passed, every cell ran and every rule held, else 1.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-results/vllm-batch-invariant}"
config="${VLLM_CONFIG:-configs/cluster/vllm-batch-invariant.yaml}"
read -r -a harness <<<"${HARNESS:-harness}"
mkdir -p "$out"
if ! "${harness[@]}" doctor "$config" >"$out/doctor.txt" 2>&1; then
    echo "vLLM batch-invariant part skipped: doctor says this node cannot run it ($out/doctor.txt):"
    grep -E '^ *MISSING' "$out/doctor.txt" | cut -c1-240
    exit 1
fi
rc=0
began=$SECONDS
timeout "${VLLM_BUDGET_S:-900}" "${harness[@]}" run "$config" --out "$out" || rc=1
echo "vLLM batch-invariant part: $((SECONDS - began)) s for $config, start-ups included (budget for the default: 480 s on an H100-class node)" \
    | tee "$out/elapsed.txt"
"${harness[@]}" check "$out" --junit "$out/junit.xml" || rc=1
{
    "${harness[@]}" summarize "$out" --what slowdown
    "${harness[@]}" summarize "$out" --what latency
    "${harness[@]}" summarize "$out" --what settings
} 2>&1 | tee "$out/summary.txt"
python3 scripts/vllm_mode_evidence.py "$out" 2>&1 | tee "$out/evidence.txt"
exit "$rc"
