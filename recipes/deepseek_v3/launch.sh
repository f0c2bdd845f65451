#!/usr/bin/env bash
# Launch this recipe's train.py. Extra arguments pass through to train.py and override the defaults below.
#
#   bash recipes/<this folder>/launch.sh [train.py flags ...]
#
# No GPU:       prepares the demo data if missing (the Python standard library's sources, with a
#               sentencepiece tokenizer trained locally), trains the tiny config on 4 CPU ranks for 300 steps:
#               DualPipeV over 2 pipeline ranks (pp=2), its 8 experts split over 2 (ep=2); then prints where the
#               TensorBoard logs and checkpoints are.
# GPUs:         one process per GPU with the released config.json; with no PP or EP (nor --pp/--ep/--cp/--dp)
#               the layout (pp, cp, ep, micro-batch, recompute) is the fastest that fits by tools/plan.py, and
#               launch.sh prints why; with PP and/or EP set: pp = PP (1), ep = EP (GPUs per node, at most 8).
#               Set HF_CHECKPOINT=/path/to/DeepSeek-V3 (or R1, Kimi K2, Moonlight-16B-A3B; FP8 blocks dequantised)
#               to start from the released weights (the demo data is then tokenized with its tokenizer), or
#               DATA=/path/to/shards for data made by `python -m tools.prepare_data`.
# Multi-node:   run the same command on every node (torchrun c10d rendezvous on node 0):
#                 NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<host of node 0> MASTER_PORT=29500 bash .../launch.sh
# Slurm:        inside an allocation the script starts itself once per node with srun and takes the node
#               count, node rank and rendezvous host from Slurm:
#                 sbatch --nodes=4 --gpus-per-node=8 --wrap "bash recipes/<this folder>/launch.sh --steps 1000"
#                 salloc --nodes=2 --gpus-per-node=8  then  bash recipes/<this folder>/launch.sh
#
# Restarts:     a failed rank (crash, lost node, watchdog timeout of a hung step, --step-timeout) makes torchrun
#               restart every rank, up to MAX_RESTARTS times; train.py then resumes from the newest complete
#               checkpoint by itself. Bad input (a wrong flag, missing data) stops at once with one `error:` line.
#               A second launch into an OUT that holds checkpoints asks for --resume auto (continue) or a new OUT.
#
# Environment: NPROC (processes per node; default: GPUs, or 4 on CPU), EP (expert-parallel ranks; default
# NPROC up to 8 on GPU, 2 on CPU), PP (pipeline ranks; default 1 on GPU, 2 on CPU; on GPU with neither set: planned), NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, HF_CHECKPOINT, DATA, OUT (default runs/<this folder>), MAX_RESTARTS (default 3).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
RECIPE="$(basename "$HERE")"  # a copied folder trains its own model.py: the module path follows the folder name
cd "$ROOT"

# ---- Slurm: one srun task per node, each running this file with the node's rank
if [[ -n "${SLURM_JOB_ID:-}" && -z "${LAUNCH_IN_SRUN:-}" ]]; then
  exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 env LAUNCH_IN_SRUN=1 bash "$HERE/launch.sh" "$@"
fi
if [[ -n "${LAUNCH_IN_SRUN:-}" ]]; then
  NNODES="$SLURM_NNODES"
  NODE_RANK="$SLURM_NODEID"
  MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
fi

# ---- machine: GPUs or the CPU demo
GPUS=0
if command -v nvidia-smi >/dev/null 2>&1; then GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"; fi
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_PORT="${MASTER_PORT:-29500}"
OUT="${OUT:-runs/$RECIPE}"

if [[ "$GPUS" -gt 0 ]]; then
  NPROC="${NPROC:-$GPUS}"
  DEFAULTS=(--config "$HERE/config.json" --seq-len 4096 --global-batch $((NPROC * NNODES * 8))
            --lr 3e-4 --warmup-steps 100 --steps 1000 --ckpt-every 200)
  if [[ -n "${HF_CHECKPOINT:-}" ]]; then
    DEFAULTS+=(--hf-checkpoint "$HF_CHECKPOINT")
    DATA="${DATA:-data/stdlib-$RECIPE}"
    TOKENIZE=(--hf-tokenizer "$HF_CHECKPOINT")
  fi
  if [[ -z "${PP:-}${EP:-}" ]] && ! printf '%s\n' "$@" | grep -qE '^--(pp|dp|cp|ep|expert-placement)(=|$)'; then
    # no layout given: the fastest that fits, by the planner (tools/plan.py, reasons printed); its GPU rates are
    # measured ones once tools/gpu_check.py has written runs/calibration_gpu.json (one node: other nodes may
    # not share the file, and every node must pick the same layout)
    CALIBRATION=()
    if [[ "$NNODES" == 1 && -f runs/calibration_gpu.json ]]; then CALIBRATION=(--calibration runs/calibration_gpu.json); fi
    LAYOUT="$(python -m tools.plan "$RECIPE" --gpus $((NPROC * NNODES)) --gpus-per-node "$NPROC" \
              --gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)" ${CALIBRATION[@]+"${CALIBRATION[@]}"} \
              --launch-flags -- "${DEFAULTS[@]}" "$@")"
    read -r -a LAYOUT <<< "$LAYOUT"
    DEFAULTS+=("${LAYOUT[@]}")
  else
    DEFAULTS+=(--pp "${PP:-1}" --ep "${EP:-$((NPROC < 8 ? NPROC : 8))}" --micro-batch 1)
  fi
else
  NPROC="${NPROC:-4}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one core per rank
  DEFAULTS=(--pp "${PP:-2}" --ep "${EP:-2}" --seq-len 256 --global-batch 8 --micro-batch 1 --lr 3e-3 --warmup-steps 20 --steps 300
            --ckpt-every 100)
  # aux-loss-free balancing on where the model has it (Model.features; a variant may decline it): with the aux
  # loss alone, near-uniform router probabilities hide a collapsed top-k
  if python -c "import sys; from core.training import declared; from recipes.$RECIPE import model as m
sys.exit('expert_bias' not in declared(m.Model, m.load_config(m.tiny_config_path())).features)"; then
    DEFAULTS+=(--expert-bias-rate 1e-2)
  fi
fi
DATA="${DATA:-data/stdlib}"

# ---- demo data, once (node 0 only writes; other nodes need a shared filesystem or their own DATA)
if [[ ! -f "$DATA/meta.json" && "$NODE_RANK" == 0 ]]; then
  python -m tools.prepare_data --default --out "$DATA" ${TOKENIZE[@]+"${TOKENIZE[@]}"}
fi

if [[ "$NNODES" -gt 1 ]]; then
  : "${MASTER_ADDR:?set MASTER_ADDR to the host of node 0 for a multi-node run}"
  RDZV=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
        --rdzv-id "${SLURM_JOB_ID:-$RECIPE}")
else
  RDZV=(--standalone --nnodes 1)
fi

# ---- the flags, config, layout and data checked once, in one process, before torchrun starts any rank: a user
# error costs one `error:` line and a few seconds (train.py --dry-run runs the checks every rank runs first)
WORLD_SIZE=$((NPROC * NNODES)) python -m "recipes.$RECIPE.train" --data "$DATA" --out "$OUT" "${DEFAULTS[@]}" "$@" --dry-run

export MOE_TRAIN_STOP_FILE="${TMPDIR:-/tmp}/moe-train-stop-$$"  # the error that stopped the run (core/reliability.py)
rm -f "$MOE_TRAIN_STOP_FILE"
set -x +e
torchrun "${RDZV[@]}" --nproc-per-node "$NPROC" --max-restarts "${MAX_RESTARTS:-3}" -m "recipes.$RECIPE.train" \
  --data "$DATA" --out "$OUT" "${DEFAULTS[@]}" "$@"
{ rc=$?; set +x; } 2>/dev/null
if [[ -f "$MOE_TRAIN_STOP_FILE" ]]; then  # repeated after torchrun's failure report, so that it is the last line
  echo "error: $(cat "$MOE_TRAIN_STOP_FILE")" >&2
  rm -f "$MOE_TRAIN_STOP_FILE"
fi
exit $rc
