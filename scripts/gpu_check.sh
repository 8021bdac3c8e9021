#!/usr/bin/env bash
# What a CUDA machine runs to show that the pipeline works on it and how fast PPO runs there (under
# 8 minutes on one recent GPU):
#
#   1. the whole tiny pipeline (`rlhf run`, configs/tiny.yaml) in bf16 on the GPU: data preparation,
#      SFT, reward model, PPO-max, registration, with a temporary Prefect server and a SQLite MLflow
#      store in a scratch directory (nothing of yours is touched);
#   2. the PPO throughput benchmark (benchmarks/ppo_throughput.py) on SmolLM2-135M in bf16: samples/s,
#      generated tokens/s, the time split, peak GPU memory and model FLOP utilisation (MFU), with the
#      default rollout engine (`ppo.rollout.engine: lean`), generation against its memory-bandwidth
#      bound and a rollout-batch sweep of replies per second;
#   3. the rollout engines side by side (benchmarks/rollout_engines.py): hf `generate` against the lean
#      engine (float32 and bf16 weights) on SmolLM2, seconds per rollout, whether the lean engine draws
#      hf's tokens, and each engine's log-prob gap to the float32 scoring pass.
#
#   scripts/gpu_check.sh                     # on a CUDA machine
#   scripts/gpu_check.sh --dry-run           # the same steps on the CPU, tiny model, 2 benchmark iterations (CI)
#
# Options:
#   --dry-run            CPU only (CUDA hidden), the tiny model in the benchmarks too, 2 iterations
#   --data FILE          preference pairs for the pipeline and the benchmark's prompts
#                        (default: ../shared/data/hh-rlhf-harmless/pairs-1800.jsonl.gz beside the checkout)
#   --iterations N       measured benchmark iterations (default 5; dry run 2)
#   --peak-tflops X      the accelerator's peak TFLOP/s for MFU (default: from the GPU's name, for the
#                        GPUs peak_tflops_of knows; without it MFU is not computed)
#   --work-dir DIR       where runs, stores and the benchmark JSON go (default: a new temporary directory,
#                        kept and printed at the end)
#
# Exit status: 0 when every step passed; 1 after saying which step failed; 2 for a bad option.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dry_run=false
data="$repo/../shared/data/hh-rlhf-harmless/pairs-1800.jsonl.gz"
iterations=""
peak_tflops=""
work_dir=""

# Seconds each step may take on a GPU: together well under 8 minutes (the first run also converts the
# packaged SmolLM2 into its cache, about 30 s). A dry run has no limit (0): a busy CI machine is slow,
# and the test that runs it has its own.
pipeline_timeout_s=300
benchmark_timeout_s=150
engines_timeout_s=120
# Benchmark shape on the GPU: a rollout batch and lengths that keep an H100-class GPU busy without
# making the check long.
gpu_batch_size=64
gpu_mini_batch_size=16
gpu_prompt_length=128
gpu_response_length=128
gpu_sweep=16,64
gpu_engine_shape=(--model smollm2 --batch-sizes 16,64 --prompt-length 128 --response-length 64 --repeats 2)

usage() {
    sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) dry_run=true; shift ;;
        --data) data="$2"; shift 2 ;;
        --iterations) iterations="$2"; shift 2 ;;
        --peak-tflops) peak_tflops="$2"; shift 2 ;;
        --work-dir) work_dir="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

section() {
    printf '\n== %s ==\n' "$1"
}

fail() {
    echo "gpu_check: FAILED: $1" >&2
    exit 1
}

# Peak dense bf16 tensor-core TFLOP/s from NVIDIA's datasheets (SXM parts), for the MFU figure.
peak_tflops_of() {
    case "$1" in
        *H200*|*H100*) echo 989 ;;
        *A100*) echo 312 ;;
        *L40S*) echo 362 ;;
        *) echo "" ;;
    esac
}

[[ -f "$data" ]] || fail "no preference data at $data (pass --data FILE)"
data="$(cd "$(dirname "$data")" && pwd)/$(basename "$data")"
work_dir="${work_dir:-$(mktemp -d -t rlhf-gpu-check-XXXXXX)}"
mkdir -p "$work_dir"
work_dir="$(cd "$work_dir" && pwd)"

if $dry_run; then
    export CUDA_VISIBLE_DEVICES=""
    device=cpu
    pipeline_timeout_s=0
    benchmark_timeout_s=0
    engines_timeout_s=0
    iterations="${iterations:-2}"
    benchmark_shape=(--config "$repo/configs/tiny.yaml" --warmup-iterations 0 --sweep 2,4)
    engine_shape=(--config "$repo/configs/tiny.yaml" --batch-sizes 4 --prompt-length 32 --response-length 8 --repeats 1)
else
    device=cuda
    iterations="${iterations:-5}"
    benchmark_shape=(--model smollm2 --bf16 on --warmup-iterations 1 --batch-size "$gpu_batch_size"
        --mini-batch-size "$gpu_mini_batch_size" --micro-batch-size "$gpu_mini_batch_size"
        --prompt-length "$gpu_prompt_length" --response-length "$gpu_response_length" --sweep "$gpu_sweep")
    engine_shape=("${gpu_engine_shape[@]}")
fi

section "device"
gpu_name="$(python - "$device" <<'EOF'
import sys

import torch

device = sys.argv[1]
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}", file=sys.stderr)
if device == "cuda":
    if not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch (driver, CUDA build of torch, CUDA_VISIBLE_DEVICES?)")
    properties = torch.cuda.get_device_properties(0)
    print(f"{torch.cuda.device_count()} GPU(s); using {properties.name}, {properties.total_memory / 2**30:.0f} GiB, "
          f"bf16 supported: {torch.cuda.is_bf16_supported()}", file=sys.stderr)
    print(properties.name)
else:
    print("dry run: CPU only (CUDA hidden)", file=sys.stderr)
    print("cpu")
EOF
)" || fail "device check"
peak_tflops="${peak_tflops:-$(peak_tflops_of "$gpu_name")}"
echo "work directory: $work_dir"

section "1/3 tiny pipeline (rlhf run, configs/tiny.yaml, bf16 on $device)"
# A scratch Prefect home and no configured servers: `rlhf run` starts a temporary Prefect server (given
# more than its default 20 s to come up: a busy CI machine needs it), and MLflow tracks to mlflow.db +
# mlruns/ in the work directory.
pipeline_started=$SECONDS
(
    cd "$work_dir"
    env -u PREFECT_API_URL -u PREFECT_API_AUTH_STRING -u MLFLOW_TRACKING_URI \
        PREFECT_HOME="$work_dir/prefect-home" PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120 \
        timeout --kill-after=30 "$pipeline_timeout_s" rlhf run \
        --params "$repo/params.yaml" --config "$repo/configs/tiny.yaml" -s distributed.bf16=on \
        --data "$data" --runs-dir "$work_dir/runs"
) | tee "$work_dir/pipeline.log" || fail "tiny pipeline (log: $work_dir/pipeline.log)"
pipeline_s=$((SECONDS - pipeline_started))
grep -q "^registered: rlhf-policy version" "$work_dir/pipeline.log" || fail "the pipeline registered no policy"

section "2/3 PPO throughput benchmark ($device, $iterations iterations)"
benchmark_json="$work_dir/ppo_throughput.json"
benchmark_started=$SECONDS
timeout --kill-after=30 "$benchmark_timeout_s" python "$repo/benchmarks/ppo_throughput.py" \
    --device "$device" --iterations "$iterations" --data "$data" "${benchmark_shape[@]}" \
    ${peak_tflops:+--peak-tflops "$peak_tflops"} --json "$benchmark_json" || fail "PPO throughput benchmark"
benchmark_s=$((SECONDS - benchmark_started))

section "3/3 rollout engines ($device): hf generate against the lean engine"
engines_json="$work_dir/rollout_engines.json"
engines_started=$SECONDS
timeout --kill-after=30 "$engines_timeout_s" python "$repo/benchmarks/rollout_engines.py" \
    --device "$device" --data "$data" "${engine_shape[@]}" --json "$engines_json" \
    | tee "$work_dir/rollout_engines.log" || fail "rollout engines"
engines_s=$((SECONDS - engines_started))

section "summary$($dry_run && echo ' (dry run: CPU, tiny model)')"
echo "device               $gpu_name"
echo "tiny pipeline        passed in ${pipeline_s} s ($(grep -m1 '^run directory:' "$work_dir/pipeline.log"))"
echo "benchmark            passed in ${benchmark_s} s ($benchmark_json)"
echo "rollout engines      passed in ${engines_s} s ($engines_json)"
python - "$benchmark_json" "$engines_json" <<'EOF'
import json
import sys

report = json.load(open(sys.argv[1]))
settings, flops, share = report["settings"], report["flops"], report["time_share"]
print(f"model                {settings['model']} ({flops['parameters']:,} parameters), batch {settings['batch_size']}, "
      f"prompt {settings['prompt_length']} + response {settings['response_length']} tokens"
      f"{', bf16' if settings['bf16'] else ''}")
print(f"samples/s            {report['samples_per_s']:.3f}")
print(f"tokens/s             {report['generated_tokens_per_s']:.1f}")
print("time split           " + ", ".join(f"{phase} {100 * share[phase]:.1f} %" for phase in ("generate", "score", "train", "other")))
print(f"peak memory          {report['peak_memory_bytes'] / 2**20:.1f} MiB ({report['peak_memory_measure']})")
print(f"model TFLOP/s        {flops['model_tflops_per_s']:.4f}")
if flops["mfu"] is None:
    print("MFU                  not computed (pass --peak-tflops)")
else:
    print(f"MFU                  {100 * flops['mfu']:.2f} % of {flops['peak_tflops']:g} TFLOP/s")
generation = report["generation"]
print(f"generation           engine {generation['engine']}, {100 * generation['share_of_iteration']:.1f} % of the "
      f"iteration, {generation['measured_tokens_per_s']:.1f} tokens/s ({100 * generation['bound_over_measured']:.0f} % "
      f"of the {generation['memory_bandwidth_gbs']:.0f} GB/s bandwidth bound's speed)")
for row in generation["sweep"]:
    print(f"sweep batch {row['batch_size']:<8} {row['replies_per_s']:.2f} replies/s")
for batch, engines in json.load(open(sys.argv[2]))["batches"].items():
    hf = engines["hf"]["seconds"]
    print(f"engines batch {batch:<6} " + ", ".join(
        f"{name} {row['seconds']:.3f} s ({hf / row['seconds']:.2f}x hf, same tokens {row['same_tokens_as_hf']}, "
        f"log-prob gap {row['logprob_gap_mean']:.1e})" for name, row in engines.items()))
EOF
echo "gpu_check: PASSED"
