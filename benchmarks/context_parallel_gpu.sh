#!/usr/bin/env bash
# torch context parallelism (accelerate_configs/fsdp_cp.yaml) on a machine with 2 or more CUDA GPUs: what cannot run
# on CPU (torch's context-parallel attention handles the CUDA SDPA kernels only; on CPU the first attention call fails
# with "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered").
#
# Trains the SFT recipe on a small random Llama at SEQ tokens twice: under fsdp_cp.yaml with cp_size 2 on 2 GPUs
# (one data-parallel replica, each GPU holding half of every sequence) and under fsdp_full_shard.yaml on 1 GPU
# (the whole sequences), same data, seed and micro-batch, bf16. Then writes RESULT: the two runs' losses, each
# rank's counted collectives beside the planner's terms (fsdp_full_shard/cp2: param_all_gather, grad_reduce_scatter,
# cp_ring) and the measured peak (CUDA max allocated) beside the planned one (`plan --cp 2 --json`).
#
#   benchmarks/context_parallel_gpu.sh                   # ~2 minutes on 2 GPUs -> benchmarks/results/context_parallel_gpu.md
#   SEQ=4096 STEPS=4 RESULT=/tmp/cp.md benchmarks/context_parallel_gpu.sh
# Not run by the suite (no GPU there); docs/configs.md says what was run where.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD/plugin:${PYTHONPATH:-}"
OUT=${OUT:-${TMPDIR:-/tmp}/shardscope_cp_gpu}
SEQ=${SEQ:-8192}
STEPS=${STEPS:-8}
RESULT=${RESULT:-benchmarks/results/context_parallel_gpu.md}
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt 2 ]; then echo "context_parallel_gpu.sh: needs 2 CUDA GPUs, found $GPUS" >&2; exit 2; fi

python -c "from shardscope.recipes.tiny import make_sft_assets; make_sft_assets('$OUT/assets', 'llama', n=4096, \
hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, \
max_position_embeddings=$((2 * SEQ)))" > /dev/null
ARGS=(--config recipes/llama/demo_tiny.yaml --model_name_or_path "$OUT/assets/tiny-llama" --dataset "$OUT/assets/alpaca.json"
      --max_seq_length "$SEQ" --packing true --per_device_train_batch_size 1 --max_steps "$STEPS" --bf16 true
      --attn_implementation sdpa)
accelerate launch --config_file accelerate_configs/fsdp_cp.yaml --num_processes 2 --parallelism_config_dp_shard_size 1 \
  --parallelism_config_cp_size 2 --main_process_port 29531 recipes/causal_lm_sft.py "${ARGS[@]}" --output_dir "$OUT/cp"
accelerate launch --config_file accelerate_configs/fsdp_full_shard.yaml --num_processes 1 --main_process_port 29532 \
  recipes/causal_lm_sft.py "${ARGS[@]}" --output_dir "$OUT/whole"
python -m shardscope plan --model "$OUT/assets/tiny-llama" --gpus 2 --gpu-memory 80GB --precision bf16-mixed \
  --seq-len "$SEQ" --cp 2 --json > "$OUT/plan.json"

python - "$OUT" "$RESULT" "$SEQ" <<'EOF'
import json, sys
from pathlib import Path

out, result, seq = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
losses = {name: [h["loss"] for h in json.loads((out / name / "trainer_state.json").read_text())["log_history"]
                 if "loss" in h] for name in ("cp", "whole")}
summary = json.loads((out / "cp" / "shardscope_summary.json").read_text())
row = next(r for r in json.loads((out / "plan.json").read_text())["rows"] if r["strategy"] == "fsdp_full_shard/cp2")
lines = [f"# torch context parallelism on {summary['device']} (benchmarks/context_parallel_gpu.sh)", "",
         f"{seq} tokens, cp 2 on 2 GPUs vs the whole sequences on 1, bf16; mesh {summary['mesh']}, "
         f"split {summary['strategy_detail'].get('sequence_parallel')}", "",
         "| step | loss, cp 2 | loss, whole | difference |", "| --- | --- | --- | --- |"]
lines += [f"| {i + 1} | {a:.6f} | {b:.6f} | {a - b:+.2e} |" for i, (a, b) in enumerate(zip(*losses.values()))]
lines += ["", "| rank | counted all_gather sent B | counted reduce_scatter sent B | planned terms (B) | "
          "peak (CUDA max allocated) | planned peak |", "| --- | --- | --- | --- | --- | --- |"]
for rank in summary["ranks"]:
    comm = rank.get("comm") or {}
    lines.append(f"| {rank['rank']} | {comm.get('all_gather', {}).get('sent_bytes')} | "
                 f"{comm.get('reduce_scatter', {}).get('sent_bytes')} | {row['comm']} | "
                 f"{rank.get('peak_memory_bytes')} | {row['peak_bytes']} |")
result.write_text("\n".join(lines) + "\n")
print(result.read_text())
EOF
