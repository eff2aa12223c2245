"""One process of `benchmarks/gpu_check.py`: trains each setting it is given under one strategy on one CUDA GPU
and appends one JSON line per setting to `--out` (the check reads them; a setting that fails is a line with its
error, and the next one still runs).

Per setting: the Trainer (bf16 mixed precision, AdamW, random token ids with no padding) on the llama-3.2-1b config
with random weights, `shardscope.ShardingProfilerCallback` attached, and beside it `Probe`, which measures the same
steps independently of the callback: each optimizer step's CUDA-event span and CUDA's allocator peak
(`torch.cuda.max_memory_allocated` / `max_memory_reserved`, reset at each step's start) less what was allocated
before the model was built. The device's used memory is read from NVML (no CUDA context of its own), so the
memory outside the caching allocator (the CUDA context, NCCL's buffers) is measured too.

Strategies: `plain` (one process, no process group), `fsdp2` (the shipped fsdp_configs/llama_full_shard.json) and
`zero3` (the shipped ds_configs/zero3.json), both at world size 1 under `torchrun --nproc_per_node 1` (NCCL).
`--flight-recorder DIR`: after training, torch's flight-recorder ring of this process is dumped into DIR as torch
writes it on a timeout, and the line says what `shardscope hang`'s reader (`shardscope.measure.hang.read_folder`) made of
it. Run by gpu_check.py; not meant to be run alone.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch  # (importing it makes no CUDA context: NVML's reading before it is the device without this process)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugin"))
MODEL = ROOT / "plugin" / "shardscope" / "model_configs" / "llama-3.2-1b"
CONFIGS = {"fsdp2": ROOT / "fsdp_configs" / "llama_full_shard.json", "zero3": ROOT / "ds_configs" / "zero3.json"}
MEMORY_STEP, COMM_STEP, TIME_STEP = 3, 3, 4  # the callback's defaults: its instrumented steps


def device_used(index: int = 0) -> int | None:
    """Bytes in use on the GPU, every process's, from NVML (makes no CUDA context); None where NVML cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)
    except Exception:  # NVML missing or refused in this sandbox: the outside-allocator figures are left out
        return None


def diff(a, b):
    return None if a is None or b is None else a - b


class Probe:
    """A Trainer callback measuring each optimizer step without the profiler: CUDA events at the step's start and
    end (read after training), and the allocator's peaks over the step (reset at its start). Step 1 starts again
    at its first forward (a pre-hook on the input embedding, which runs after any hook on the model), as the
    profiler's own clock does after it plans the live run there."""

    def __init__(self, base_allocated: int):
        self.base, self.events, self.peaks, self.restart_pending = base_allocated, {}, {}, True
        self.clock = {}  # step -> [begin, end] on the flight recorder's CPU clock (time.time_ns)
        self.before = {}  # step -> the allocator's peak before the optimizer step

    def hook(self):
        from transformers import TrainerCallback

        probe = self

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                model.get_input_embeddings().register_forward_pre_hook(probe.first_forward)

            def on_step_begin(self, args, state, control, **kwargs):
                probe.begin(state.global_step + 1)

            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                probe.before_update(state.global_step + 1)

            def on_step_end(self, args, state, control, **kwargs):
                probe.end(state.global_step)

        return _Callback()

    def first_forward(self, module, args):
        if self.restart_pending and 1 in self.events and torch.is_grad_enabled():
            self.restart_pending = False
            self.events[1][0] = mark()
            self.clock[1][0] = time.time_ns()

    def begin(self, step: int) -> None:
        torch.cuda.reset_peak_memory_stats()
        self.events[step] = [mark(), None]
        self.clock[step] = [time.time_ns(), None]

    def before_update(self, step: int) -> None:
        """The Trainer is about to step the optimizer: the peak so far is forward and backward's (under DeepSpeed
        the engine has stepped inside backward already), and the optimizer step's starts from here."""
        self.before[step] = torch.cuda.max_memory_allocated() - self.base
        torch.cuda.reset_peak_memory_stats()

    def end(self, step: int) -> None:
        if step in self.events:
            self.events[step][1] = mark()
            self.clock[step][1] = time.time_ns()
        after = torch.cuda.max_memory_allocated() - self.base
        before = self.before.get(step)
        self.peaks[step] = {"allocated": max(after, before or 0), "forward_backward": before,
                            "optimizer_step": None if before is None else after,
                            "reserved": torch.cuda.max_memory_reserved()}

    def comm_ms(self) -> dict:
        """Per step, the NCCL durations of the collectives created inside it, read from torch's rings here (the
        flight recorder; {} without a process group)."""
        import torch.distributed as dist

        from shardscope.measure.collective_log import ring_entries

        if not dist.is_initialized():
            return {}
        entries = [e for e in ring_entries() if str(e.get("profiling_name", "")).startswith("nccl:")]
        return {step: sum(float(e.get("duration_ms") or 0) for e in entries if b <= e.get("time_created_ns", -1) < end)
                for step, (b, end) in self.clock.items() if end is not None}

    def spans_s(self) -> dict:
        torch.cuda.synchronize()
        return {step: begin.elapsed_time(end) / 1000 for step, (begin, end) in self.events.items() if end is not None}


def mark():
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class TokenRows:
    """Random token ids of one length: every token real (no padding), labels = inputs."""

    def __init__(self, rows: int, seq_len: int, vocab: int):
        self.ids = torch.randint(0, vocab, (rows, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "labels": ids, "attention_mask": ids.new_ones(ids.shape)}


def training_args(strategy: str, out: Path, micro_batch: int, steps: int, checkpointing: bool):
    from transformers import TrainingArguments

    extra = {}
    if strategy == "fsdp2":
        extra = {"fsdp": "full_shard auto_wrap", "fsdp_config": str(CONFIGS["fsdp2"])}
    elif strategy == "zero3":
        extra = {"deepspeed": str(CONFIGS["zero3"])}
    return TrainingArguments(output_dir=str(out), per_device_train_batch_size=micro_batch, max_steps=steps,
                             learning_rate=1e-5, bf16=True, gradient_checkpointing=checkpointing,
                             logging_steps=steps, save_strategy="no", report_to=[], disable_tqdm=True,
                             dataloader_num_workers=0, seed=0, **extra)  # the Trainer's default optimizer


def build_model(config, strategy: str):
    """Random fp32 weights (the Trainer's bf16 is autocast over them), made on the GPU; under ZeRO-3 made where
    DeepSpeed's zero.Init puts them (partitioned as they are made, as `from_pretrained` does there)."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    if strategy == "zero3":
        return AutoModelForCausalLM.from_config(config, **kwargs)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(config, **kwargs)


def run_setting(strategy: str, setting: dict, out: Path, steps: int) -> dict:
    """Train one setting; what the profiler's summary and the probe measured."""
    from transformers import AutoConfig, Trainer

    from shardscope import ShardingProfilerCallback

    mb, seq, ckpt = setting["micro_batch"], setting["seq_len"], setting["checkpointing"]
    folder = out / f"{strategy}-{mb}x{seq}{'-ckpt' if ckpt else ''}"
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    args = training_args(strategy, folder, mb, steps, ckpt)  # before the model: ZeRO-3 builds it partitioned
    config = AutoConfig.from_pretrained(MODEL)
    model = build_model(config, strategy)
    probe = Probe(base)
    callback = ShardingProfilerCallback(every_n_steps=10 * steps, memory_step=MEMORY_STEP, comm_step=COMM_STEP,
                                        time_step=TIME_STEP)
    trainer = Trainer(model=model, args=args, train_dataset=TokenRows(mb * steps, seq, config.vocab_size),
                      callbacks=[callback, probe.hook()])
    trainer.train()
    spans, comm = probe.spans_s(), probe.comm_ms()
    summary = json.loads((folder / "shardscope_summary.json").read_text())
    row = {"strategy": strategy, **setting, "steps": steps, "base_allocated": base, "spans_s": spans, "comm_ms": comm,
           "peaks": probe.peaks, "device_used_end": device_used(), "reserved_end": torch.cuda.memory_reserved(),
           "summary": summary}
    del trainer, model, callback
    gc.collect()
    torch.cuda.empty_cache()
    return row


def flight_recorder(folder: Path) -> dict:
    """This process's rings as each dumper returns them; what shardscope reads of them (`collective_log`'s
    `ring_entries` and `recent`, a hang record's collectives); and the ring dumped as torch does on a timeout (a
    pickle named for the rank) read by `shardscope hang`'s reader."""
    from torch._C import _distributed_c10d as c10d

    from shardscope.measure import hang
    from shardscope.measure import collective_log

    out = {"dumpers": {}}
    for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
        if hasattr(c10d, name):
            entries = json.loads(getattr(c10d, name)(True, False)).get("entries") or []
            out["dumpers"][name] = {"entries": len(entries), "with_duration": sum("duration_ms" in e for e in entries),
                                    "kinds": sorted({str(e.get("profiling_name")) for e in entries})}
    read = collective_log.ring_entries()
    out["shardscope_entries"] = {"entries": len(read), "with_duration": sum("duration_ms" in e for e in read)}
    out["recent"] = collective_log.recent()
    pickled = next((n for n in ("_dump_nccl_trace", "_dump_fr_trace") if hasattr(c10d, n)), None)
    out["pickle_dumper"] = pickled
    if pickled:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "torch_fr_rank_0").write_bytes(getattr(c10d, pickled)(True, False, False))
        records, unreadable = hang.read_folder(folder)
        out.update(records=[{"event": r.get("event"), "rank": r.get("rank"), "collectives": r.get("collectives")}
                            for r in records], unreadable=unreadable)
    return out


def outside_allocator(used_before: int | None) -> dict:
    """The CUDA context (a first tensor made), then NCCL's (a process group and one all_reduce): device memory
    in use less the caching allocator's reserved bytes, each step's increase (None where NVML cannot say)."""
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    context = diff(diff(device_used(), used_before), torch.cuda.memory_reserved())
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    out = {"context_bytes": context, "device": {"name": props.name, "sms": props.multi_processor_count,
                                                "capability": f"{props.major}.{props.minor}",
                                                "total_bytes": props.total_memory}}
    if "LOCAL_RANK" in os.environ:
        import torch.distributed as dist

        before = diff(device_used(), torch.cuda.memory_reserved())
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(torch.ones(1, device="cuda"))
        torch.cuda.synchronize()
        out["nccl_bytes"] = diff(diff(device_used(), torch.cuda.memory_reserved()), before)
    return out


def failure(error: Exception) -> dict:
    return {"error": f"{type(error).__name__}: {error}"[:600], "traceback": traceback.format_exc()[-2500:]}


def write(path: Path, line: dict) -> None:
    """One JSON line appended and flushed: what finished is there even if a later setting kills the process."""
    with path.open("a") as sink:
        sink.write(json.dumps(line, default=str) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("plain", "fsdp2", "zero3"), required=True)
    parser.add_argument("--settings", required=True, help="JSON list of {micro_batch, seq_len, checkpointing}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True, help="JSON lines file to append to")
    parser.add_argument("--flight-recorder", type=Path)
    args = parser.parse_args()
    used_before = device_used()  # before this process's CUDA context
    from shardscope.measure.collective_log import record_by_default

    record_by_default()  # as the profiler's import does: the flight recorder and NCCL timing on, before the group

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    write(args.out, {"strategy": args.strategy, "device_used_before": used_before, **outside_allocator(used_before)})
    for setting in json.loads(args.settings):
        try:
            write(args.out, run_setting(args.strategy, setting, args.out.parent, args.steps))
        except Exception as error:  # one setting failing leaves the others measured: the error is the finding
            write(args.out, {"strategy": args.strategy, **setting, **failure(error)})
    if args.flight_recorder:
        try:
            found = flight_recorder(args.flight_recorder)
        except Exception as error:
            found = failure(error)
        write(args.out, {"strategy": args.strategy, "flight_recorder": found})
    return 0


if __name__ == "__main__":
    sys.exit(main())
