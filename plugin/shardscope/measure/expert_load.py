"""Expert load of a mixture of experts: the tokens each MoE layer's router sends to each expert, per step, on this
rank; the model's auxiliary (load-balancing) loss where it returns one.

Read from the router's own output through a guarded forward hook (measure/guard.py): transformers 5's MoE routers
(Qwen3-MoE's and Mixtral's `gate`, gpt-oss's `router`: the child of the block that holds `experts`) return
(router logits, top-k weights, top-k expert indices); the indices of the training forward are counted with
`bincount`. A forward that runs again inside backward (activation checkpointing's recompute) is not counted twice,
nor is a forward in eval mode. The busiest expert's tokens set the MoE layer's activation peak (its expert's
input, hidden and output rows), so each step records max over mean tokens per expert, per layer and the worst.
"""
from __future__ import annotations

import torch

ROUTER_NAMES = ("gate", "router")


def routers(model) -> list[tuple[str, torch.nn.Module, int]]:
    """(qualified name, router module, experts) of each MoE layer: the `gate`/`router` beside a module named
    `experts` that knows its expert count."""
    found = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        router = next((getattr(module, r) for r in ROUTER_NAMES if isinstance(getattr(module, r, None),
                                                                               torch.nn.Module)), None)
        count = getattr(experts, "num_experts", None) or getattr(router, "num_experts", None)
        if experts is not None and router is not None and count:
            found.append((name, router, int(count)))
    return found


def load_summary(tokens: list[list[int]]) -> dict:
    """Per layer max over mean tokens per expert; the worst layer's, and its busiest expert."""
    ratios = [max(layer) * len(layer) / sum(layer) if sum(layer) else 0.0 for layer in tokens]
    worst = max(range(len(tokens)), key=ratios.__getitem__) if tokens else 0
    expert = max(range(len(tokens[worst])), key=tokens[worst].__getitem__) if tokens else 0
    return {"max_over_mean": max(ratios, default=0.0), "max_over_mean_by_layer": ratios,
            "busiest_layer": worst, "busiest_expert": expert,
            "busiest_tokens": tokens[worst][expert] if tokens else 0}


class ExpertLoad:
    """A profiler instrument (`start(step)`, `stop(step)`, `result()`; guard.py's `CallerInstruments`) counting each
    step's routed tokens: `result()` = {"layers", "num_experts", "steps": {step: {"tokens": [[per expert] per
    layer], "aux_loss", load_summary's keys}}}. `instrument`: the guard.Instrument its hooks go in through."""

    name = "expert_load"

    def __init__(self, model, instrument):
        self.found = routers(model)
        self.current_step: int | None = None
        self.tokens: list[list[int]] = []
        self.aux: list[float] = []
        self.steps: dict[int, dict] = {}
        for index, (_, router, experts) in enumerate(self.found):
            instrument.hook(router.register_forward_hook, self._counter(index, experts))
        instrument.hook(model.register_forward_hook, self._aux_loss)

    def _counter(self, index: int, experts: int):
        def count(module, args, output):
            if self.current_step is None or not module.training or torch._C._current_graph_task_id() != -1:
                return  # outside a step, in eval, or recomputed inside backward (checkpointing)
            indices = output[-1]
            counts = torch.bincount(indices.detach().reshape(-1).to(torch.long), minlength=experts).tolist()
            self.tokens[index] = [a + b for a, b in zip(self.tokens[index], counts)]
        return count

    def _aux_loss(self, module, args, output):
        aux = getattr(output, "aux_loss", None)
        if self.current_step is not None and isinstance(aux, torch.Tensor) and torch._C._current_graph_task_id() == -1:
            self.aux.append(float(aux.detach().float()))

    def start(self, step: int) -> None:
        self.current_step, self.aux = step, []
        self.tokens = [[0] * experts for _, _, experts in self.found]

    def stop(self, step: int) -> None:
        if self.current_step is not None and any(map(any, self.tokens)):
            self.steps[step] = {"tokens": self.tokens, "aux_loss": sum(self.aux) / len(self.aux) if self.aux else None,
                                **load_summary(self.tokens)}
        self.current_step = None

    def result(self) -> dict:
        return {"layers": [name for name, _, _ in self.found], "num_experts": [n for _, _, n in self.found],
                "steps": self.steps}


def expert_load_instruments(model, instruments) -> tuple:
    """The profiler's expert-load instrument when `model` has MoE routers (else none); `instruments`: the profiler's
    `guard.Instruments`, which report and remove its hooks."""
    if not routers(model):
        return ()
    return (ExpertLoad(model, instruments.add("expert load")),)
