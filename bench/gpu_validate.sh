#!/usr/bin/env bash
# GPU validation of oomless in one command, under 9 minutes: a short table printed last, the
# details (each part's JSON and log, summary.md) under $OUT (a temporary directory when unset).
#
# On a GPU machine, from the repository root: `bash bench/gpu_validate.sh` (one command, 600 s
# is enough). Without network there, put the wheels into .whl/ first: the script installs them
# from .whl/ into /tmp/site itself when deepspeed is missing.
#
# Parts, in this order, each under its own `timeout` and all under one deadline
# (GPU_VALIDATE_BUDGET_S, 520 s; a part that would start with under 20 s left is skipped):
#   estimate       estimator accuracy: `python -m bench.estimate_gpu --only 0,2,7,9,11` (estimate
#                  vs torch.cuda.max_memory_allocated over real runs; GPU_VALIDATE_ESTIMATE_RUNS
#                  picks others of the 13; all 13 take ~8 min alone); "missing" if absent
#   escalation     the CUDA allocator capped below what `single` needs: `oomless train` runs out
#                  of memory for real, climbs the ladder and completes
#   levers         chunked loss and activation offload on `single` against neither: peak
#                  max_memory_allocated and step time, Llama-3.2-1B's shape, seq 4096, micro 1
#   single, fsdp   tokens/s and MFU of `single` and `fsdp` (world 1) vs hand-written loops on the
#                  same GPU: a 1.1B Llama shape, bf16, seq 2048
#   zero3_offload  the largest shape the planner fits on `zero3_offload` vs DeepSpeed driven by
#                  hand, and the measured pinned host<->device bandwidth as the transfer floor
#   long_context   Llama-3.1-8B-shaped layers (2 of them) at 32k, 64k and 128k tokens on one GPU
#                  with full checkpointing, chunked loss and the tiled MLP: measured peak vs the
#                  estimate, tokens/s (`python -m bench.long_context_gpu`)
#   stream         optional, only with GPU_VALIDATE_ONLY naming it: `stream` vs
#                  `zero3_offload_params` on a 3B-shaped bf16 2,048-token job, tokens/s, device
#                  and host peaks, the pinned host-to-device rate and host AdamW's
#                  (`python -m bench.stream_vs_zero3`)
#   expert         optional, only with GPU_VALIDATE_ONLY naming it, and on 2 or more GPUs:
#                  `parallel.expert=2` vs plain `fsdp` on a 16-expert top-4 Qwen3-MoE in bf16,
#                  s/step and the losses' largest difference (`python -m bench.expert_parallel`)
#
# CPU smoke of the same code paths (a 0.6M-parameter shape, a few steps; tests/test_bench.py):
#     GPU_VALIDATE_CPU_SMOKE=1 OUT=/tmp/smoke bash bench/gpu_validate.sh
# GPU_VALIDATE_ONLY=levers,single (part names, comma-separated) runs only those parts.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
BUDGET_S=${GPU_VALIDATE_BUDGET_S:-520}
OUT=${OUT:-$(mktemp -d /tmp/gpu_validate.XXXXXX)}
mkdir -p "$OUT"
: >"$OUT/parts.tsv"
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi

if ! "$PY" -c "import deepspeed, datasets, pydantic" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site
    else
        echo "deepspeed/datasets/pydantic missing and no .whl/: run ../shared/device/stage.sh" \
            "here and carry .whl (see the top of this script)" >&2
    fi
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONWARNINGS=ignore

if [ -n "${GPU_VALIDATE_CPU_SMOKE:-}" ]; then
    # fp32: CPUs without AVX512-BF16 run bf16 matmuls an order of magnitude slower
    DEVICE=cpu PRECISION=fp32 MODEL=llama-tiny SEQ=64 ROUNDS=1 CANDIDATES=llama-tiny
    # process start-up and imports dominate on a small shared CPU: three times the GPU limits
    CAP_SCALE=3 BUDGET_S=${GPU_VALIDATE_BUDGET_S:-1500}
    ESCALATION=(--model llama-tiny --steps 4 --global-batch 2 --seq 64)
    LEVERS=(--model llama-tiny --seq 64 --rounds 1 --steps 1)
else
    DEVICE=cuda PRECISION=bf16 MODEL=llama-1b SEQ=2048 ROUNDS=3 CAP_SCALE=1
    CANDIDATES=llama-1b,llama-3b,llama-8b
    ESCALATION=(--model llama-1b --steps 4 --global-batch 4 --seq 1024)
    LEVERS=(--model llama3-1b --seq 4096 --rounds 3 --steps 2)
    if ! "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
        echo "no CUDA device here; GPU_VALIDATE_CPU_SMOKE=1 runs the CPU smoke path" >&2
        exit 2
    fi
    # DeepSpeed builds its CPU Adam on first use (nvcc, ninja): build it while the first parts run
    timeout 300 "$PY" -c "from deepspeed.ops.op_builder import CPUAdamBuilder as B; B().load()" \
        >"$OUT/cpu_adam_build.log" 2>&1 &
fi
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node 1)

part() { # part NAME CAP_S COMMAND...: run under `timeout` within the deadline; log and status
    local name=$1 cap=$2 left limit begin rc
    shift 2
    cap=$((cap * CAP_SCALE))
    if [ -n "${GPU_VALIDATE_ONLY:-}" ] && [[ ",$GPU_VALIDATE_ONLY," != *",$name,"* ]]; then
        return
    fi
    left=$((BUDGET_S - (SECONDS - START)))
    limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 20 ]; then
        printf '%s\tskipped\t0\n' "$name" >>"$OUT/parts.tsv"
        return
    fi
    echo "== $name (limit ${limit} s)"
    begin=$SECONDS
    PART_LIMIT_S=$limit timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    tail -n 2 "$OUT/$name.log"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - begin))" >>"$OUT/parts.tsv"
}

# In order of what a CPU can least stand in for; each part alone on the GPU (the estimate reads
# the device's used memory, the others time steps). The CPU smoke times nothing: two parts at a
# time there, the table in this order all the same.
ORDER=(estimate escalation levers single fsdp zero3_offload long_context stream expert)
run_part() {
    if [ "$DEVICE" != cpu ]; then
        part "$@"
        return
    fi
    while [ "$(jobs -rp | wc -l)" -ge 2 ]; do wait -n; done
    part "$@" &
}

if [ ! -f bench/estimate_gpu.py ]; then
    printf 'estimate\tmissing\t0\n' >>"$OUT/parts.tsv"
elif [ "$DEVICE" = cpu ]; then # its own --cpu-smoke takes minutes here; check that it loads
    run_part estimate 60 bash -c '"$@" >/dev/null && echo "bench.estimate_gpu loads (--help)"' _ \
        "$PY" -m bench.estimate_gpu --help
else
    # five of the grid's 13 runs (~40 s each on an H200): every strategy kind and both sizes
    part estimate 240 env OUT="$OUT" "$PY" -m bench.estimate_gpu \
        --only "${GPU_VALIDATE_ESTIMATE_RUNS:-0,2,7,9,11}"
fi

# `oomless train` gets 15 s less than the part, so that escalation.json is written on a timeout
run_part escalation 210 bash -c '"$@" --timeout "$((PART_LIMIT_S - 15))"' _ \
    "$PY" -m bench.escalation --device "$DEVICE" "${ESCALATION[@]}" --out "$OUT"

run_part levers 120 "$PY" -m bench.levers --device "$DEVICE" --precision "$PRECISION" --micro 1 \
    --accum 2 "${LEVERS[@]}" --json "$OUT/levers.json"

SAME=(--device "$DEVICE" --precision "$PRECISION" --seq "$SEQ" --rounds "$ROUNDS")
run_part single 70 "$PY" -m bench.engine_vs_plain "${SAME[@]}" --model "$MODEL" --micro 4 --accum 2 \
    --steps 2 --no-trainer --json "$OUT/single.json"

run_part fsdp 80 "${TORCHRUN[@]}" -m bench.fsdp_vs_plain "${SAME[@]}" --model "$MODEL" --micro 4 \
    --accum 2 --json "$OUT/fsdp.json"

if [ "$DEVICE" != cpu ]; then wait; fi # for the CPU Adam build
run_part zero3_offload 100 "${TORCHRUN[@]}" -m bench.zero3_vs_deepspeed "${SAME[@]}" \
    --rounds "$((ROUNDS < 3 ? ROUNDS : 3))" --model largest --candidates "$CANDIDATES" \
    --micro 2 --accum 2 --bandwidth --json "$OUT/zero3_offload.json"

if [ "$DEVICE" = cpu ]; then LONG=(--cpu-smoke); else LONG=(--seqs 32768,65536,131072); fi
run_part long_context 120 "$PY" -m bench.long_context_gpu "${LONG[@]}" --json "$OUT/long_context.json"

if [[ ",${GPU_VALIDATE_ONLY:-}," == *",stream,"* ]]; then # optional: only when asked for
    if [ "$DEVICE" = cpu ]; then STREAM=(--cpu-smoke); else STREAM=(); fi
    run_part stream 240 "$PY" -m bench.stream_vs_zero3 "${STREAM[@]}" --json "$OUT/stream.json"
fi

if [[ ",${GPU_VALIDATE_ONLY:-}," == *",expert,"* ]]; then # optional: only when asked for
    if [ "$DEVICE" = cpu ]; then EXPERT=(--cpu-smoke --rounds 1); else EXPERT=(--rounds 1); fi
    run_part expert 180 "$PY" -m bench.expert_parallel "${EXPERT[@]}" --json "$OUT/expert.json"
fi

wait
for name in "${ORDER[@]}"; do grep -P "^$name\t" "$OUT/parts.tsv" || true; done >"$OUT/parts.sorted"
mv "$OUT/parts.sorted" "$OUT/parts.tsv"
echo
"$PY" -m bench.gpu_report "$OUT" --wall-s "$((SECONDS - START))"
