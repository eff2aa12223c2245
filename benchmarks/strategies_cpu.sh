#!/usr/bin/env bash
# DDP vs FSDP vs ZeRO-1/2/3 on 2 CPU ranks with `shardscope compare`; writes benchmarks/results/strategies_cpu.md
# and its plots under docs/img/. About 5 minutes on 2 idle cores.
#
# The model (~7.5M-parameter random Llama, hidden 384, 4 layers) is large enough that a step is compute
# (a few hundred ms) rather than launch overhead, and every weight matrix is above ZeRO-3's persistence
# threshold (1e5 elements), so ZeRO-3 really partitions it.
# FSDP: accelerate runs an FSDP config as plain DDP on CPU; tests/cpu_shim (test-only) makes it run real
# torch FSDP2. It is on PYTHONPATH for the whole comparison and patches nothing in the DDP/ZeRO runs.
#
# A smaller run (checks the script works, writes elsewhere):
#   CONFIGS=ddp STEPS=4 SKIP=1 RESULT=/tmp/s.md IMG=/tmp/img OUT=/tmp/out benchmarks/strategies_cpu.sh
# COMPARED=1: OUT already holds a `shardscope compare` output (its model in OUT/assets/tiny-llama): the table and
# plots from it, no launch (tests/test_compare.py runs it so on its own comparison).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-${TMPDIR:-/tmp}/shardscope_strategies_cpu}
CONFIGS=${CONFIGS:-ddp fsdp_full_shard zero1 zero2 zero3}
STEPS=${STEPS:-30}
SKIP=${SKIP:-5}
RESULT=${RESULT:-benchmarks/results/strategies_cpu.md}
IMG=${IMG:-docs/img}

if [ -z "${COMPARED:-}" ]; then
  python -c "from shardscope.recipes.tiny import make_sft_assets; make_sft_assets('$OUT/assets', 'llama', n=1024, \
  hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6)" > /dev/null

  # shellcheck disable=SC2206  # CONFIGS is a list of names
  cmd=(shardscope compare --recipe recipes/causal_lm_sft.py --configs $CONFIGS
       --output-dir "$OUT" --launcher-args "--num_processes 2 --mixed_precision no" --
       --config recipes/llama/demo_tiny.yaml --model_name_or_path "$OUT/assets/tiny-llama"
       --dataset "$OUT/assets/alpaca.json" --packing true --max_seq_length 128 --per_device_train_batch_size 2
       --learning_rate 3e-4 --max_steps "$STEPS" --logging_steps 1)
  { printf "PYTHONPATH=tests/cpu_shim"; printf " %q" "${cmd[@]}"; echo; } > "$OUT/command.txt"
  PYTHONPATH=tests/cpu_shim${PYTHONPATH:+:$PYTHONPATH} "${cmd[@]}"
fi

python benchmarks/strategies_cpu.py "$OUT" --skip "$SKIP" > "$RESULT"
mkdir -p "$IMG"
cp "$OUT/memory.png" "$IMG/strategies_cpu_memory.png"
cp "$OUT/throughput.png" "$IMG/strategies_cpu_throughput.png"
cp "$OUT/time.png" "$IMG/strategies_cpu_time.png"
cp "$OUT/peak.png" "$IMG/strategies_cpu_peak.png"
echo "wrote $RESULT"
