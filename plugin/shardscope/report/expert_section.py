"""`report`/`compare`'s expert-load section: for a mixture of experts, the load each run's ranks logged
(the summary's per-rank `expert_load`, measure/expert_load.py): the worst max over mean tokens per expert over ranks
and steps, where it was (rank, step, layer, busiest expert and its tokens), and the auxiliary loss of the last step."""
from __future__ import annotations


def row_facts(ranks: list[dict]) -> dict:
    """{"expert_load": {max_over_mean, rank, step, layer, expert, tokens, steps, aux_loss}} of the worst rank and
    step, or {"expert_load": None} for a run without MoE layers."""
    worst, steps, aux = None, set(), []
    for rank, entry in enumerate(ranks):
        load = entry.get("expert_load") if isinstance(entry.get("expert_load"), dict) else {}
        per_step = load.get("steps") if isinstance(load.get("steps"), dict) else {}
        for step, record in per_step.items():
            steps.add(step)
            if worst is None or record["max_over_mean"] > worst["max_over_mean"]:
                worst = {"max_over_mean": record["max_over_mean"], "rank": rank, "step": int(step),
                         "layer": load["layers"][record["busiest_layer"]], "expert": record["busiest_expert"],
                         "tokens": record["busiest_tokens"]}
        last = per_step.get(max(per_step, key=int)) if per_step else None
        if last and last.get("aux_loss") is not None:
            aux.append(last["aux_loss"])
    if worst is None:
        return {"expert_load": None}
    return {"expert_load": {**worst, "steps": len(steps), "aux_loss": sum(aux) / len(aux) if aux else None}}


def markdown_lines(runs: list[dict]) -> list[str]:
    rows = [r for r in runs if r.get("expert_load")]
    if not rows:
        return []
    lines = ["## Expert load (mixture of experts)", "",
             "Tokens routed to each expert per MoE layer, per step and rank (the summary's `expert_load`): the worst "
             "max over mean over ranks and steps, where it was, and the auxiliary loss of the last step (mean over "
             "ranks). Under the rows planned today each rank runs every expert on its own tokens, so the spread "
             "changes no rank's peak; it would set an expert-parallel rank's (docs/planner.md).", "",
             "| run | steps | max / mean | rank, step | layer | busiest expert (tokens) | aux loss |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        load = row["expert_load"]
        aux = "-" if load["aux_loss"] is None else f"{load['aux_loss']:.4g}"
        lines.append(f"| {row['run']} | {load['steps']} | {load['max_over_mean']:.2f} | {load['rank']}, "
                     f"{load['step']} | {load['layer']} | {load['expert']} ({load['tokens']}) | {aux} |")
    return [*lines, ""]
