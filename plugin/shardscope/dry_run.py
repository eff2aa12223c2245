"""`shardscope plan --dry-run`: the real FSDP2 sharding of a model, on the meta device, for any world size.

What is *built* and what is *computed*:

- Built: the model from its config on the meta device (no weight memory), in the dtype FSDP keeps
  its sharded parameters in (fp32 under `*-mixed`: accelerate upcasts under FSDP mixed precision;
  bf16 under `bf16-pure`), a fake process group of the requested world size (torch's test backend
  `"fake"` from `torch.testing._internal.distributed.fake_pg`: collectives are no-ops, nothing is
  sent), the device mesh (1-D for full shard / shard-grad-op; 2-D `("replicate", "shard")` =
  `(nodes, gpus_per_node)` for HSDP, as `fsdp_hybrid_shard.yaml`'s `parallelism_config` says),
  and the real `fully_shard` on every decoder layer (the model's `_no_split_modules`, as
  `TRANSFORMER_BASED_WRAP` does) then the root, with `reshard_after_forward` from the config
  (true: full shard, false: shard-grad-op). This is done as rank 0 and as the last rank (two
  process-group initialisations), the sample ranks.
- Counted on the built ranks, from the DTensor local shards: params = the bytes of the storage
  behind each `to_local()` (FSDP2 allocates every rank a padded shard of ceil(dim0 / n) rows and
  views the unpadded rows into it, so the storage includes the padding; the same walk as
  `state_bytes`, which skips meta storages, so here the meta storage's `nbytes()` is read).
  Grads: FSDP2's reduce-scatter writes each rank's gradient into a padded buffer of the same
  shard sizes, in the parameters' dtype: grads = params bytes (every parameter is trainable).
  Optimizer (AdamW): `torch.zeros_like(param)` on each DTensor (what AdamW does for exp_avg and
  exp_avg_sq), measured: the moments follow the *unpadded* local shard, 2 x local numel x dtype,
  plus a 4-byte fp32 `step` tensor per parameter. SGD holds nothing, SGD with momentum 1 x.
- Computed for every other rank, from the placements: a tensor of dim0 rows sharded over n ranks
  gives each shard coordinate c the rows max(0, min(k, dim0 - c*k)), k = ceil(dim0 / n), in a
  storage of k rows (padded). Ranks are laid out row-major over the mesh (rank = node * gpus + c).
  The computed numbers are checked against the two built ranks (`computed_matches_built`).

DeepSpeed ZeRO-3 is not dry-run: `deepspeed.zero.Init` partitions parameters by allocating each
rank's `ds_tensor` as real memory on the accelerator (or CPU) and runs its collectives through
`deepspeed.comm` over a real backend; there is no meta-device path, so a 70B model cannot be
partitioned here without allocating its shard. Its row stays the planner's formula.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field, replace

from .errors import UsageError

DRY_RUN_STRATEGIES = ("fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard")
RESHARD_AFTER_FORWARD = {"fsdp_full_shard": True, "fsdp_shard_grad_op": False, "fsdp_hybrid_shard": True}
NOT_DRY_RUN = {
    "zero3": ("not dry-run: DeepSpeed ZeRO-3 partitions parameters (deepspeed.zero.Init) by allocating each "
              "rank's ds_tensor as real memory and needs deepspeed.comm over a real backend; there is no "
              "meta-device/fake-process-group path. Shown: the planner's formula only."),
}
MOMENTS = {"adamw": 2, "sgd": 0, "sgd-momentum": 1}


@dataclass
class RankCount:
    rank: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    params_elements: int  # unpadded elements this rank owns
    built: bool           # True: counted on a really wrapped model; False: computed from placements

    @property
    def model_states_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


@dataclass
class DryRun:
    strategy: str
    world_size: int
    nodes: int
    gpus_per_node: int
    shard_degree: int
    mesh: tuple
    dtype: str
    ranks: list = field(default_factory=list)  # RankCount per rank, all ranks
    computed_matches_built: bool = True
    seconds: float = 0.0


def _dtype(precision: str):
    import torch

    return torch.bfloat16 if precision == "bf16-pure" else torch.float32


def _tensor_layout(param):
    """(dim0, elements per row, element size, mesh dim that shards dim 0 or None) of a DTensor parameter."""
    from torch.distributed.tensor import Shard

    shard_dims = [i for i, p in enumerate(param.placements) if isinstance(p, Shard)]
    if shard_dims and param.placements[shard_dims[0]].dim != 0:
        raise RuntimeError(f"unexpected FSDP2 placement {param.placements}")
    dim0 = param.shape[0] if param.dim() else 1
    return dim0, param.numel() // max(dim0, 1), param.element_size(), shard_dims[0] if shard_dims else None


def _computed_rank(layouts, rank: int, mesh_shape: tuple, moments: int) -> RankCount:
    """One rank's bytes from the tensors' layouts and FSDP2's chunking rule (see module docstring)."""
    coords, rest = [], rank
    for size in reversed(mesh_shape):  # row-major mesh
        coords.append(rest % size)
        rest //= size
    coords.reverse()
    params = elements = optim = 0
    for dim0, row, esize, mesh_dim in layouts:
        if mesh_dim is None:
            held = padded = dim0
        else:
            n, c = mesh_shape[mesh_dim], coords[mesh_dim]
            padded = -(-dim0 // n)
            held = max(0, min(padded, dim0 - c * padded))
        params += padded * row * esize
        elements += held * row
        optim += moments * held * row * esize + (4 if moments else 0)
    return RankCount(rank, params, params, optim, elements, built=False)


def _build_rank(config, strategy: str, rank: int, world_size: int, nodes: int, dtype, moments: int):
    """Wrap the meta model as `rank` under a fake process group; count from its DTensor shards."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers backend "fake"

    from .planner import _meta_model
    from .state_bytes import local_tensor, model_parameters

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        if strategy == "fsdp_hybrid_shard":
            mesh = init_device_mesh("cpu", (nodes, world_size // nodes), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
        model = _meta_model(config).to(dtype)
        blocks = set(getattr(model, "_no_split_modules", None) or ())
        wrapped = [m for m in model.modules() if type(m).__name__ in blocks]
        if not wrapped:
            raise UsageError(f"model type '{config.model_type}' names no transformer block class "
                             f"(_no_split_modules) to wrap per layer")
        reshard = RESHARD_AFTER_FORWARD[strategy]
        for module in wrapped:
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        params = elements = optim = 0
        layouts = []
        for p in model_parameters(model):
            local = local_tensor(p)
            params += local.untyped_storage().nbytes()  # padded shard storage (meta: nbytes, no memory)
            elements += local.numel()
            if moments:
                moment = local_tensor(torch.zeros_like(p))  # what AdamW allocates for exp_avg / exp_avg_sq
                optim += moments * moment.numel() * moment.element_size() + 4  # + fp32 step
            layouts.append(_tensor_layout(p))
        return RankCount(rank, params, params, optim, elements, built=True), layouts, tuple(mesh.shape)
    finally:
        dist.destroy_process_group()


def dry_run(config, strategy: str, world_size: int, nodes: int = 1, precision: str = "bf16-mixed",
            optimizer: str = "adamw") -> DryRun:
    """The per-rank model-state bytes of `strategy` on `world_size` ranks over `nodes` nodes."""
    import torch.distributed as dist

    if strategy not in DRY_RUN_STRATEGIES:
        raise UsageError(f"--dry-run builds {', '.join(DRY_RUN_STRATEGIES)}; {strategy}: "
                         + NOT_DRY_RUN.get(strategy, "not dry-run (use the formula rows of shardscope plan)"))
    check_mesh(world_size, nodes)
    if optimizer not in MOMENTS:
        raise UsageError(f"--dry-run counts optimizers {', '.join(MOMENTS)}; got '{optimizer}'")
    if dist.is_initialized():
        raise UsageError("--dry-run needs its own fake process group; call it outside a distributed run")
    start = time.perf_counter()
    dtype, moments = _dtype(precision), MOMENTS[optimizer]
    built = {}
    for rank in sorted({0, world_size - 1}):
        built[rank], layouts, mesh_shape = _build_rank(config, strategy, rank, world_size, nodes, dtype, moments)
    ranks = [built.get(r) or _computed_rank(layouts, r, mesh_shape, moments) for r in range(world_size)]
    matches = all(asdict(_computed_rank(layouts, r, mesh_shape, moments)) == {**asdict(b), "built": False}
                  for r, b in built.items())
    return DryRun(strategy, world_size, nodes, world_size // nodes,
                  mesh_shape[-1] if strategy == "fsdp_hybrid_shard" else world_size, mesh_shape,
                  str(dtype).replace("torch.", ""), ranks, matches, time.perf_counter() - start)


def check_mesh(world_size: int, nodes: int) -> None:
    if world_size < 1 or nodes < 1:
        raise UsageError(f"world size and nodes must be at least 1, got {world_size} ranks on {nodes} nodes")
    if world_size % nodes:
        raise UsageError(f"world size {world_size} does not divide into {nodes} nodes: the device mesh is "
                         f"nodes x GPUs per node ({nodes} x {world_size / nodes:g} is not whole)")


# ----------------------------------------------------------------------------- beside the planner
def compare_rows(result: DryRun, spec, setup) -> dict:
    """The dry-run's extreme ranks beside the planner's formula row for the same strategy and setup."""
    from .planner import strategy_row

    row = strategy_row(result.strategy, spec, replace(setup, gpus_per_node=result.gpus_per_node,
                                                      nodes=result.nodes, fsdp_version=2))
    planned = {"params_bytes": row.params_bytes, "grads_bytes": row.grads_bytes,
               "optimizer_bytes": row.optimizer_bytes, "model_states_bytes": row.model_states_bytes}
    heaviest = max(result.ranks, key=lambda r: (r.model_states_bytes, -r.rank))
    lightest = min(result.ranks, key=lambda r: (r.model_states_bytes, r.rank))
    out = {"planned": planned, "ranks": {}}
    for label, rank in (("max", heaviest), ("min", lightest)):
        measured = {k: getattr(rank, k) for k in planned}
        out["ranks"][label] = {"rank": rank.rank, "built": rank.built, **measured,
                               "rel_diff": {k: (measured[k] - planned[k]) / planned[k] if planned[k] else 0.0
                                            for k in planned}}
    return out


def run(model: str, strategies, world_size: int, nodes: int, setup) -> dict:
    from .planner import load_config, model_spec

    config = load_config(model)
    spec = model_spec(config)
    results = []
    for strategy in strategies:
        if strategy in NOT_DRY_RUN:
            from .planner import strategy_row

            row = strategy_row(strategy, spec, replace(setup, gpus_per_node=world_size // nodes, nodes=nodes))
            results.append({"strategy": strategy, "dry_run": None, "note": NOT_DRY_RUN[strategy],
                            "planned": {"params_bytes": row.params_bytes, "grads_bytes": row.grads_bytes,
                                        "optimizer_bytes": row.optimizer_bytes,
                                        "model_states_bytes": row.model_states_bytes}})
            continue
        result = dry_run(config, strategy, world_size, nodes, setup.precision, setup.optimizer)
        results.append({"strategy": strategy, "world_size": world_size, "nodes": nodes,
                        "shard_degree": result.shard_degree, "mesh": list(result.mesh), "dtype": result.dtype,
                        "seconds": round(result.seconds, 3), "computed_matches_built": result.computed_matches_built,
                        "built_ranks": [r.rank for r in result.ranks if r.built],
                        **compare_rows(result, spec, setup),
                        "per_rank": [dict(asdict(r)) for r in result.ranks]})
    return {"model": spec.name, "params_total": spec.params_total, "world_size": world_size, "nodes": nodes,
            "precision": setup.precision, "optimizer": setup.optimizer, "results": results}


def format_dry_run(out: dict) -> str:
    from .planner import gb

    lines = [f"dry run: {out['model']} ({out['params_total']:,} params), {out['world_size']} ranks on "
             f"{out['nodes']} node(s), {out['precision']}, {out['optimizer']}; meta device + fake process group, "
             f"real FSDP2 fully_shard per decoder layer + root",
             f"{'per rank, GB (1e9 B)':<38}{'params':>9}{'grads':>9}{'optim':>9}{'states':>9}  diff vs formula"]
    keys = ("params_bytes", "grads_bytes", "optimizer_bytes", "model_states_bytes")
    for r in out["results"]:
        planned = r["planned"]
        lines.append(f"{r['strategy'] + ' formula':<38}" + "".join(f"{gb(planned[k]):>9}" for k in keys))
        if r.get("dry_run", True) is None:
            lines.append(f"{r['strategy'] + ' dry run':<38}  {r['note']}")
            continue
        for label in ("max", "min"):
            rank = r["ranks"][label]
            how = "built" if rank["built"] else "computed"
            diff = max(rank["rel_diff"].values(), key=abs)
            lines.append(f"{'  dry run ' + label + ': rank ' + str(rank['rank']) + ' (' + how + ')':<38}"
                         + "".join(f"{gb(rank[k]):>9}" for k in keys) + f"  {diff:+.3%}")
        lines.append(f"  mesh {tuple(r['mesh'])}, shards over {r['shard_degree']}, {r['dtype']} shards, built ranks "
                     f"{r['built_ranks']}, computed = built: {'yes' if r['computed_matches_built'] else 'NO'}, "
                     f"{r['seconds']:.2f} s")
    lines += ["params include FSDP2's padding of uneven shards (storage of ceil(dim0/n) rows); grads the same; "
              "AdamW moments follow the unpadded local shard (+4 B step per tensor). Formulas: docs/planner.md; "
              "dry run: docs/cluster.md"]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI wiring
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`shardscope plan` flags for the dry run; `--dry-run` routes the command here."""
    group = parser.add_argument_group("dry run (real FSDP2 sharding on the meta device, fake process group)")
    group.add_argument("--dry-run", action="store_true",
                       help="wrap the model with FSDP2 for the given ranks and count each rank's bytes")
    group.add_argument("--world-size", type=int, help="total ranks (default: --gpus x --nodes)")
    group.add_argument("--strategy", action="append", choices=(*DRY_RUN_STRATEGIES, *NOT_DRY_RUN),
                       help="repeatable; default: the FSDP strategies (hybrid only with --nodes > 1) and zero3")
    formula_command = parser.get_default("func")

    def command(args) -> int:
        return dry_run_command(args) if args.dry_run else formula_command(args)

    parser.set_defaults(func=command)


def dry_run_command(args) -> int:
    from .planner import setup_from_args

    if not args.model:
        raise UsageError("--dry-run needs --model (a config to build; --params has no layer shapes)")
    if args.lora_rank:
        raise UsageError("--dry-run does not apply LoRA; drop --lora-rank")
    nodes = args.nodes
    world = args.world_size if args.world_size is not None else args.gpus * nodes
    if args.world_size is not None and args.gpus != 1 and args.gpus * nodes != world:
        raise UsageError(f"--world-size {world} disagrees with --gpus {args.gpus} x --nodes {nodes}")
    check_mesh(world, nodes)  # before anything heavy is imported
    setup = replace(setup_from_args(args), gpus_per_node=world // nodes, nodes=nodes)
    strategies = args.strategy or [s for s in (*DRY_RUN_STRATEGIES, *NOT_DRY_RUN)
                                   if s != "fsdp_hybrid_shard" or nodes > 1]
    out = run(args.model, strategies, world, nodes, setup)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(format_dry_run(out))
    return 0
