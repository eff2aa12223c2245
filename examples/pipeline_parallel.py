"""Pipeline parallelism with `torch.distributed.pipelining`: a tiny Llama split into 2 stages, GPipe schedule.

Pipeline parallelism (PP) cuts a model between layers into stages, one stage per GPU (rank): each rank
holds only its stage's parameters, gradients and optimizer state, and activations flow rank to rank
(send/recv of the hidden states forward, of their gradients backward). To keep every rank busy the batch
is cut into m micro-batches. GPipe runs all m forwards through the p stages, then all m backwards, and
accumulates gradients over the micro-batches before one optimizer step; each rank idles while the pipeline
fills and drains, a "bubble" of (p-1)/(m+p-1) of the step (p=2, m=4: 1/5). More micro-batches, smaller
bubble; 1F1B and interleaved schedules (ScheduleInterleaved1F1B, ...) also cap the activations kept alive.

Design choice: the stages are built by hand (`PipelineStage` over a module holding embedding + first half of
the decoder layers, then the second half + norm + lm_head) rather than with `pipeline()` + `SplitPoint`.
On torch 2.13 + transformers 5, tracing `LlamaForCausalLM` either fails (the DynamicCache in its outputs) or,
with use_cache=False, yields a split graph that breaks at run time (the rotary-embedding submodule loses its
inputs). The manual split runs the decoder layers exactly as `LlamaModel.forward` does (same causal mask
helper, same rotary embeddings), which the single-process mode checks against the HF model's own logits.
Every rank builds the whole tiny model from one seed and keeps its stage; for a large model you would
build on the meta device / load only your stage's weights. Embeddings are untied (tied ones span stages).

    torchrun --nproc_per_node 2 examples/pipeline_parallel.py --losses_out pp.json   # 2 stages (gloo on CPU)
    python examples/pipeline_parallel.py --losses_out ref.json                       # whole model, one process

The loss is a mean over tokens per micro-batch; equal-sized micro-batches and the schedule dividing the
accumulated gradients by m (scale_grads=True) make the step the same as the full-batch mean loss, so both
modes print the same losses up to float rounding. The optimizer is SGD with momentum, whose update is
proportional to the gradient: AdamW's is nearly scale-free, so it would hide gradients off by a factor m.
"""
import argparse
import json
import os
import resource
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import create_causal_mask

from shardscope import end_of_run


class Stage(torch.nn.Module):
    """Decoder layers `layers` of a LlamaForCausalLM, plus the embedding (first stage) or norm + lm_head (last)."""

    def __init__(self, model, layers, first, last):
        super().__init__()
        self.config, self.rotary = model.config, model.model.rotary_emb  # rotary: buffers only, no parameters
        self.embed = model.model.embed_tokens if first else None
        self.layers = torch.nn.ModuleList(model.model.layers[i] for i in layers)
        self.norm, self.head = (model.model.norm, model.lm_head) if last else (None, None)

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        pos = torch.arange(h.shape[1], device=h.device)[None]
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                  past_key_values=None, position_ids=pos)
        rope = self.rotary(h, position_ids=pos)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=pos)
        return self.head(self.norm(h)) if self.head is not None else h


def loss_fn(logits, targets):  # mean over the tokens of one (micro-)batch
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def memory(module, optimizer):
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"param_bytes": nbytes(module.parameters()), "grad_bytes": nbytes(p.grad for p in module.parameters()),
            "optimizer_bytes": nbytes(state),  # SGD momentum: one buffer per parameter
            # ru_maxrss is KiB on Linux: peak of the whole process (torch, Python, buffers), noisy, never lower
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--no-pipeline", dest="pipeline", action="store_false", help="whole model, one process")
    parser.add_argument("--losses_out", help="JSON file for the per-step losses and per-stage memory")
    parser.add_argument("--output_dir", help="if --losses_out is not given, write <output_dir>/losses.json")
    args = parser.parse_args()
    pipelined = args.pipeline and "WORLD_SIZE" in os.environ
    cuda = torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # a GPU per rank, else CPU
    if pipelined:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo")
    else:
        rank, world, device = 0, 1, torch.device("cuda:0" if cuda else "cpu")

    torch.manual_seed(0)  # same init and same data on every rank and in both modes
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False, use_cache=False)
    model = LlamaForCausalLM(config).to(device)
    tokens = torch.randint(0, config.vocab_size, (args.batch_size, 33)).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # next-token prediction on fixed synthetic data
    per_stage = config.num_hidden_layers // world
    assert per_stage * world == config.num_hidden_layers, "layers must split evenly over the ranks"
    assert args.batch_size % args.microbatches == 0, "equal micro-batches: mean of their means = batch mean"
    first, last = rank == 0, rank == world - 1

    if pipelined:
        module = Stage(model, range(rank * per_stage, (rank + 1) * per_stage), first, last)
        del model  # this rank keeps only its stage's parameters
        schedule = ScheduleGPipe(PipelineStage(module, rank, world, device), n_microbatches=args.microbatches,
                                 loss_fn=loss_fn)  # scale_grads=True: accumulated grads divided by m
    else:
        module = model
        half = config.num_hidden_layers // 2
        stages = [Stage(model, range(half), True, False), Stage(model, range(half, 2 * half), False, True)]
        with torch.no_grad():  # the hand-made split is the HF model: same logits
            torch.testing.assert_close(stages[1](stages[0](inputs)), model(input_ids=inputs).logits)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)  # a step proportional to the grads

    losses = []
    for step in range(1, args.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        if pipelined:
            mb_losses = []
            schedule.step(*([inputs] if first else []), **({"target": targets, "losses": mb_losses} if last else {}))
            loss = torch.stack(mb_losses).mean().item() if last else None  # = full-batch mean (equal micro-batches)
        else:
            out = loss_fn(module(input_ids=inputs).logits, targets)
            out.backward()
            loss = out.item()
        optimizer.step()
        mem = memory(module, optimizer)
        losses.append(loss)
        print(f"[{f'rank {rank}, stage {rank + 1}/{world}' if pipelined else 'single process'}] step {step}"
              + (f" loss {loss:.6f}" if loss is not None else "")
              + " | params {param_bytes:,} B, grads {grad_bytes:,} B, optimizer {optimizer_bytes:,} B,"
                " peak RSS {rss:.0f} MiB (process-wide)".format(**mem, rss=mem["peak_rss_bytes"] / 2**20), flush=True)

    reports = [{"rank": rank, "stage": rank, "layers": per_stage, **mem, "losses": losses}]
    if pipelined:  # the losses live on the last stage and rank 0 writes: gather every stage's report
        reports = reports * world
        dist.all_gather_object(reports, reports[0])
    out_path = args.losses_out or (args.output_dir and Path(args.output_dir) / "losses.json")
    if rank == 0 and out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        result = {"mode": "pipeline" if pipelined else "single", "world_size": world,
                  "microbatches": args.microbatches if pipelined else 1, "losses": reports[-1]["losses"],
                  "stages": [{k: v for k, v in r.items() if k != "losses"} for r in reports]}
        Path(out_path).write_text(json.dumps(result, indent=2))
    end_of_run()


if __name__ == "__main__":
    main()
