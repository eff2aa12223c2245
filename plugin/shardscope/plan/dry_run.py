"""`shardscope plan --dry-run`: the real FSDP2 / tensor-parallel sharding of a model, on the meta device, for any
world size.

What is *built* and what is *computed*:

- Built: the model from its config on the meta device (no weight memory), in the dtype the sharded
  parameters are kept in (fp32 under `*-mixed`: accelerate upcasts under FSDP mixed precision, and the
  recipes load fp32 weights for TP; bf16 under `bf16-pure`), a fake process group of the requested world
  size (torch's test backend `"fake"` from `torch.testing._internal.distributed.fake_pg`: collectives are
  no-ops, nothing is sent), then the same sharding as the real run:
  - FSDP strategies: the device mesh (1-D for full shard / shard-grad-op; 2-D `("replicate", "shard")` =
    `(nodes, gpus_per_node)` for HSDP, as `fsdp_hybrid_shard.yaml`'s `parallelism_config` says), and the
    real `fully_shard` on every decoder layer (the model's `_no_split_modules`, as `TRANSFORMER_BASED_WRAP`
    does) then the root, with `reshard_after_forward` from the config (true: full shard, false:
    shard-grad-op).
  - Tensor parallel strategies (`tp`, `fsdp_tp`, `hsdp_tp`): transformers' own code, the path
    `from_pretrained(..., distributed_config=DistributedConfig(tp_size, fsdp_size, dp_replicate_size))`
    takes in the real run: `PreTrainedModel.maybe_distribute_model` resolves the model's TP and FSDP plans
    (`_resolve_parallel_plans`), applies the TP plan (`apply_tensor_parallelism`: DTensor placements and
    forward hooks) and then FSDP2 over the data-parallel dims (`apply_fully_sharded_data_parallelism`:
    embed_tokens, each decoder layer, norm + lm_head, root). Used rather than torch's
    `parallelize_module` so that the plan, the styles (e.g. `embedding_rowwise`, `colwise_gather_output`)
    and the FSDP units are exactly those of the real run, with no mapping of ours in between. Only the
    mesh is built here, with `init_device_mesh("cpu", (1, R, S, t), ("pp", "dp_replicate", "fsdp", "tp"))`
    (and the expert mesh beside it) wrapped in `TransformersDeviceMesh`: the same dims and names as
    `initialize_distributed_mesh`, which is not called because it takes the device type from the
    machine's accelerator and binds a local device, which a fake group on a GPU machine must not do.
    TP alone (no FSDP) then runs one forward and backward on a 1 x 2 token meta batch: the gradient
    placements come from DTensor's operator rules, not from the plan (the embedding_rowwise weight's
    gradient comes back Replicate, whole on every TP rank), so they are read, not assumed. With FSDP2 a
    meta backward is refused (FSDP2 requires materialised parameters to train); its reduce-scatter leaves
    every gradient in the parameter's padded shard.
  This is done as rank 0 and as the last rank (two process-group initialisations), the sample ranks.
  Decoder layers that hold the same parameters (names, shapes, dtypes, class) are built as one that stands
  for all of them: FSDP2 shards each layer on its own and the TP plan names layers by pattern, so each of the
  layer's tensors is counted once per layer (layers that differ, e.g. a dense first layer before MoE ones,
  are all built).
- Counted on the built ranks, from the DTensor local shards: params = the bytes of the storage
  behind each `to_local()` (FSDP2 allocates every rank a padded shard of ceil(dim0 / n) rows and
  views the unpadded rows into it, so the storage includes the padding; as measure/state_bytes.py counts a
  live rank, except that it skips meta storages, so here the meta storage's `nbytes()` is read).
  Grads: under FSDP2 the reduce-scatter writes each rank's gradient into a padded buffer of the same
  shard sizes, in the parameters' dtype: grads = params bytes (every parameter is trainable); under
  TP alone, the storage behind each gradient's local part after the meta backward.
  Optimizer (AdamW): `torch.zeros_like(param)` on each DTensor (what AdamW does for exp_avg and
  exp_avg_sq), measured: the moments follow the *unpadded* local shard, 2 x local numel x dtype,
  plus a 4-byte fp32 `step` tensor per parameter. SGD holds nothing, SGD with momentum 1 x.
- Computed for every other rank, from the placements: ranks are laid out row-major over the mesh
  (FSDP: rank = node * gpus + c; TP: rank = (replica * S + shard) * t + tp), and each tensor is cut
  in the order the run cuts it. First the `tp` mesh dim: `Shard(d)` (d = 0 colwise / embedding, 1
  rowwise) gives TP coordinate j the chunk max(0, min(k, n - j*k)) of dim d, k = ceil(n / t), as
  DTensor's Shard does. Then the FSDP mesh dim (`shard`, or `fsdp` where its placement is
  `Shard(0)` or `_StridedShard(0, sf=t)`: FSDP2 shards the local TP shard, whichever way the
  placement spells it) splits dim 0 of what is left the same way, in a storage of k rows (padded).
  Replicate dims cut nothing. The computed numbers are checked against the two built ranks
  (`computed_matches_built`).

DeepSpeed ZeRO-3 is not dry-run: `deepspeed.zero.Init` partitions parameters by allocating each
rank's `ds_tensor` as real memory on the accelerator (or CPU) and runs its collectives through
`deepspeed.comm` over a real backend; there is no meta-device path, so a 70B model cannot be
partitioned here without allocating its shard. Its row stays the planner's formula.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace

from ..errors import UsageError
from .formulas import chunk, strategy_row
from .mesh import LibraryKnobs, check_tp_heads, setup_for_mesh, tp_degree
from ..model import cache as model_cache
from ..model.spec import attention_heads, config_bytes, load_model_config, meta_model, model_spec, resolve_model
from ..strategy import RECORDS, TP_STRATEGIES, Mesh, strategy_record

# What FSDP2 and transformers' TP plan build on the meta device: the FSDP records that keep states on the GPU, TP's
DRY_RUN_STRATEGIES = tuple(r.name for r in RECORDS if r.family in ("fsdp", "tp") and not r.offload)
FSDP_MESH_DIMS = ("shard", "fsdp")  # the mesh dims FSDP2 shards over (ours; transformers')
NOT_DRY_RUN = {
    "zero3": ("not dry-run: DeepSpeed ZeRO-3 partitions parameters (deepspeed.zero.Init) by allocating each "
              "rank's ds_tensor as real memory and needs deepspeed.comm over a real backend; there is no "
              "meta-device/fake-process-group path. Shown: the planner's formula only."),
}
MOMENTS = {"adamw": 2, "sgd": 0, "sgd-momentum": 1}


class LibraryRefused(Exception):
    """The library's own sharding code failed on this model: the strategy's row carries the reason."""


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)
OUTPUT_KEYS = ("model", "params_total", "world_size", "nodes", "precision", "optimizer", "results")
FOUNDATION = ("errors.py", "safe_io.py", "strategy.py", "units.py")  # used by plan/ and model/


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
    mesh_dim_names: tuple = ()
    tp: int = 1


def _dtype(precision: str):
    import torch

    return torch.bfloat16 if precision == "bf16-pure" else torch.float32


def _sharding(tensor) -> tuple:
    """((mesh dim name, tensor dim), ...) for every mesh dim that shards `tensor` (a DTensor), () otherwise."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not hasattr(tensor, "placements"):
        return ()
    names = tensor.device_mesh.mesh_dim_names
    ndim = max(tensor.dim(), 1)
    return tuple((name, placement.dim % ndim) for name, placement in zip(names, tensor.placements)
                 if isinstance(placement, (Shard, _StridedShard)))


def _tensor_layout(param, grad=None):
    """(shape, element size, parameter sharding, gradient sharding): the gradient's is None when it is
    FSDP2's padded shard (the parameter's storage size), False when there is no gradient."""
    for name, dim in _sharding(param):
        if name in FSDP_MESH_DIMS and dim != 0:
            raise RuntimeError(f"unexpected FSDP2 placement {param.placements}")
    return (tuple(param.shape), param.element_size(), _sharding(param),
            grad if grad is None or grad is False else _sharding(grad))


def _local(shape, sharding, sizes: dict, coords: dict) -> tuple[int, int]:
    """(elements held, elements of storage) of one tensor at mesh coordinates `coords`: the `tp` dim cuts
    first (DTensor Shard chunks), then an FSDP dim cuts dim 0 of the rest in padded chunks."""
    local = list(shape) or [1]
    cuts = dict(sharding)
    if "tp" in cuts:
        d = cuts.pop("tp")
        local[d] = chunk(local[d], sizes["tp"], coords["tp"])
    rest = math.prod(local[1:])
    for name, d in cuts.items():  # at most one: the FSDP dim, on dim 0
        n = sizes[name]
        return chunk(local[0], n, coords[name]) * rest, -(-local[0] // n) * rest
    return local[0] * rest, local[0] * rest


def _computed_rank(layouts, rank: int, mesh_shape: tuple, mesh_names: tuple, moments: int) -> RankCount:
    """One rank's bytes from the tensors' layouts and the chunking rules (see module docstring)."""
    coords, rest = [], rank
    for size in reversed(mesh_shape):  # row-major mesh
        coords.append(rest % size)
        rest //= size
    coords = dict(zip(mesh_names, reversed(coords)))
    sizes = dict(zip(mesh_names, mesh_shape))
    params = grads = elements = optim = 0
    for shape, esize, sharding, grad_sharding, copies in layouts:
        held, stored = _local(shape, sharding, sizes, coords)
        params += copies * stored * esize
        if grad_sharding is None:
            grads += copies * stored * esize
        elif grad_sharding is not False:
            grads += copies * _local(shape, grad_sharding, sizes, coords)[1] * esize
        elements += copies * held
        optim += copies * (moments * held * esize + (4 if moments else 0))
    return RankCount(rank, params, grads, optim, elements, built=False)


def _meta_backward(model) -> None:
    """One forward and backward of a 1 x 2 token batch on the meta device (nothing is computed or sent)."""
    import inspect

    import torch

    if getattr(model.config, "_experts_implementation", None) == "grouped_mm":
        # grouped_mm's meta kernel takes bf16 only (torch 2.13); the experts' implementation changes the forward's
        # kernels, not the parameters or their gradients' layout, which are all this backward is for
        model.set_experts_implementation("batched_mm")
    ids = torch.zeros(1, 2, dtype=torch.long, device="meta")
    labels = {"labels": ids} if "labels" in inspect.signature(model.forward).parameters else {}
    out = model(input_ids=ids, **labels)
    loss = out.loss if getattr(out, "loss", None) is not None else out[0].float().sum()
    loss.backward()


def one_layer_model(config, dtype):
    """(meta model in `dtype`, qualified name of its decoder layers' list or None, how many layers it stands for).

    FSDP2 shards each decoder layer on its own and the TP plan names layers by pattern (`layers.*`), so a rank's
    bytes of n layers that hold the same parameters (names, shapes, dtypes, class) are n times one layer's: the
    list keeps its first layer and stands for n. Layers that differ (or no list of them) keep the whole model."""
    import torch

    model = meta_model(config).to(dtype)
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1
             and all(type(layer).__name__ in blocks for layer in m)]
    if not lists:
        return model, None, 1
    name, layers = max(lists, key=lambda pair: len(pair[1]))
    first = _signature(layers[0])
    if any(_signature(layer) != first for layer in layers[1:]):
        return model, None, 1
    count = len(layers)
    del layers[1:]
    return model, name, count


def _signature(layer) -> tuple:
    return type(layer), tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters())


def untie(model) -> None:
    """Give each tied weight (`all_tied_weights_keys`: target -> source) a parameter of its own, as the model is
    when from_pretrained distributes it (it builds under `no_tie_weights` and ties after loading)."""
    import torch

    for target in (getattr(model, "all_tied_weights_keys", None) or {}):
        module_name, _, name = target.rpartition(".")
        module = model.get_submodule(module_name)
        tied = getattr(module, name)
        setattr(module, name, torch.nn.Parameter(torch.empty_like(tied), requires_grad=tied.requires_grad))


def _shard_model(model, config, strategy: str, mesh_shape: tuple):
    """`model` (on the meta device) sharded as `strategy` on the current (fake) process group, and the mesh dim
    names."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if strategy in TP_STRATEGIES:
        from transformers.distributed import DistributedConfig
        from transformers.distributed.utils import TransformersDeviceMesh

        r, s, t = mesh_shape
        dc = DistributedConfig(tp_size=t, fsdp_size=s, dp_replicate_size=r)
        dense = init_device_mesh("cpu", (1, r, s, t), mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
        expert = init_device_mesh("cpu", (1, r, dc.efsdp_size, dc.ep_size),
                                  mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
        untie(model)  # from_pretrained distributes the weights before it ties them
        try:
            model = type(model).maybe_distribute_model(model, dc, TransformersDeviceMesh(dense, expert))
            model.tie_weights()
        except Exception as error:  # transformers' own code refusing this model: the row says so, the others go on
            first = str(error).splitlines()[0] if str(error) else ""
            raise LibraryRefused(f"not dry-run: transformers {_version('transformers')} could not apply its "
                                 f"tensor-parallel plan to this model ({type(error).__name__}: {first})") from None
        return model, ("dp_replicate", "fsdp", "tp")
    record = strategy_record(strategy)
    names = ("replicate", "shard") if record.node_local else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    wrapped = [m for m in model.modules() if type(m).__name__ in blocks]
    if not wrapped:
        raise UsageError(f"model type '{config.model_type}' names no transformer block class "
                         f"(_no_split_modules) to wrap per layer")
    reshard = record.sharding != "SHARD_GRAD_OP"
    for module in wrapped:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, names


def _local_part(tensor):
    """The part of `tensor` this rank stores: a DTensor's local shard (`to_local`), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _build_rank(template, config, strategy: str, rank: int, mesh_shape: tuple, moments: int):
    """Shard a copy of the meta model `template` (model, decoder layers' list name, layers it stands for) as `rank`
    under a fake process group; count from its DTensor shards, the one decoder layer times the layers."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers backend "fake"

    base, layer_list, layers = template
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=math.prod(mesh_shape))
    try:
        model, names = _shard_model(copy.deepcopy(base), config, strategy, mesh_shape)
        tp_alone = _tp_alone(strategy)
        if tp_alone:
            _meta_backward(model)
        params = grads = elements = optim = 0
        layouts = []
        for name, p in model.named_parameters():
            copies = layers if layer_list is not None and name.startswith(f"{layer_list}.0.") else 1
            local = _local_part(p)
            stored = local.untyped_storage().nbytes()  # padded shard storage (meta: nbytes, no memory)
            params += copies * stored
            elements += copies * local.numel()
            if not tp_alone:
                grads += copies * stored
            elif p.grad is not None:
                grads += copies * _local_part(p.grad).untyped_storage().nbytes()
            if moments:
                moment = _local_part(torch.zeros_like(p))  # what AdamW allocates for exp_avg / exp_avg_sq
                optim += copies * (moments * moment.numel() * moment.element_size() + 4)  # + fp32 step
            grad = (p.grad if p.grad is not None else False) if tp_alone else None
            layouts.append((*_tensor_layout(p, grad), copies))
        return RankCount(rank, params, grads, optim, elements, built=True), layouts, names
    finally:
        dist.destroy_process_group()


def tp_mesh_shape(config, strategy: str, world_size: int, nodes: int, tp: int | None) -> tuple[int, int, int]:
    """(dp_replicate, dp_shard, tp) of a TP dry run, checked like the planner's rows (one-line errors)."""
    gpus = world_size // nodes
    heads, kv = attention_heads(config)
    heads = heads or 1
    kv = kv or heads
    if _tp_alone(strategy):
        t = world_size if tp is None else tp
        if t != world_size or nodes != 1:
            raise UsageError(f"--dry-run tp: tensor parallelism alone runs on --tp ranks of one node; got --tp {t} "
                             f"on {world_size} ranks over {nodes} node(s) (fsdp_tp / hsdp_tp use the others)")
    else:
        t = math.gcd(gpus, heads, kv) if tp is None else tp
    if t < 1:
        raise UsageError(f"--tp must be at least 1, got {t}")
    if gpus % t:
        raise UsageError(f"--tp {t} must divide the GPUs per node (--gpus {gpus}): a tensor-parallel group stays "
                         f"inside one node")
    check_tp_heads(t, heads, kv, getattr(config, "_name_or_path", "") or config.model_type)
    if not getattr(config, "base_model_tp_plan", None):
        raise UsageError(f"--dry-run {strategy}: transformers has no tensor-parallel plan for model type "
                         f"'{config.model_type}' (config.base_model_tp_plan)")
    mesh = strategy_record(strategy).mesh_on(world_size, nodes, t)
    return mesh.dp_replicate, mesh.dp_shard, mesh.tp


def _tp_alone(strategy: str) -> bool:
    """Tensor parallelism with no data-parallel dimension (no FSDP over its shards)."""
    return strategy_record(strategy).dims == ("tp",)


def dry_run(config, strategy: str, world_size: int, nodes: int = 1, precision: str = "bf16-mixed",
            optimizer: str = "adamw", tp: int | None = None, models: dict | None = None) -> DryRun:
    """The per-rank model-state bytes of `strategy` on `world_size` ranks over `nodes` nodes.

    `tp` (tp / fsdp_tp / hsdp_tp): the tensor-parallel degree; default as the planner's (`tp`: the
    world size; otherwise gcd(GPUs per node, attention heads, KV heads)). The mesh is then
    tp: (1, 1, t); fsdp_tp: (1, world / t, t); hsdp_tp: (nodes, GPUs per node / t, t). `models`: this config's
    `one_layer_model` by dtype, shared by calls on the same config (filled here)."""
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
    if strategy in TP_STRATEGIES:
        mesh_shape = tp_mesh_shape(config, strategy, world_size, nodes, tp)
        shard_degree = mesh_shape[1] * mesh_shape[2]  # ranks that divide the model states
    else:
        mesh = strategy_record(strategy).mesh_on(world_size, nodes)
        mesh_shape = (mesh.dp_replicate, mesh.dp_shard) if strategy_record(strategy).node_local else (mesh.dp_shard,)
        shard_degree = mesh_shape[-1]
    dtype, moments = _dtype(precision), MOMENTS[optimizer]
    models = {} if models is None else models
    if dtype not in models:
        models[dtype] = one_layer_model(config, dtype)
    built = {}
    for rank in sorted({0, world_size - 1}):
        built[rank], layouts, names = _build_rank(models[dtype], config, strategy, rank, mesh_shape, moments)
    ranks = [built.get(r) or _computed_rank(layouts, r, mesh_shape, names, moments) for r in range(world_size)]
    matches = all(asdict(_computed_rank(layouts, r, mesh_shape, names, moments)) == {**asdict(b), "built": False}
                  for r, b in built.items())
    return DryRun(strategy, world_size, nodes, world_size // nodes, shard_degree, mesh_shape,
                  str(dtype).replace("torch.", ""), ranks, matches, time.perf_counter() - start, names,
                  mesh_shape[2] if strategy in TP_STRATEGIES else 1)


def check_mesh(world_size: int, nodes: int) -> None:
    if world_size < 1 or nodes < 1:
        raise UsageError(f"world size and nodes must be at least 1, got {world_size} ranks on {nodes} nodes")
    if world_size % nodes:
        raise UsageError(f"world size {world_size} does not divide into {nodes} nodes: the device mesh is "
                         f"nodes x GPUs per node ({nodes} x {world_size / nodes:g} is not whole)")


# ----------------------------------------------------------------------------- beside the planner
def compare_rows(result: DryRun, spec, setup, knobs: LibraryKnobs | None = None) -> dict:
    """The dry-run's extreme ranks beside the planner's formula row for the same strategy and setup (FSDP2)."""
    if result.strategy in TP_STRATEGIES:
        r, s, t = result.mesh
        _, row_setup = setup_for_mesh(setup, Mesh(r, s, t))
    else:
        row_setup = replace(setup, gpus_per_node=result.gpus_per_node, nodes=result.nodes)
    row = strategy_row(result.strategy, spec, row_setup, knobs=replace(knobs or LibraryKnobs(), fsdp_version=2))
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


def default_strategies(config, world_size: int, nodes: int, tp: int | None) -> list[str]:
    """The FSDP strategies (hybrid only over several nodes), the TP ones when transformers has a TP plan for the
    model and the TP degree is above 1 (hsdp_tp only over several nodes), and zero3."""
    tp_default = bool(getattr(config, "base_model_tp_plan", None)) and (
        tp_mesh_shape(config, "fsdp_tp", world_size, nodes, tp)[2] > 1)
    return [s for s in (*DRY_RUN_STRATEGIES, *NOT_DRY_RUN) if (not strategy_record(s).node_local or nodes > 1)
            and (s not in TP_STRATEGIES or tp_default)]


def dry_run_all(model: str, strategies, world_size: int, nodes: int, setup,
                knobs: LibraryKnobs | None = None) -> dict:
    """`plan --dry-run`'s rows (`strategies` None: `default_strategies`), from `model/cache.py` when this config.json,
    request, library versions and the code that computes them were dry-run before (then neither torch nor
    transformers is imported; `seconds` is the build's that the cache recorded)."""
    source = config_bytes(model)
    knobs = knobs or LibraryKnobs()
    request = json.dumps([strategies, world_size, nodes, asdict(setup), asdict(knobs)], sort_keys=True, default=str)
    key = model_cache.cache_key(source, dry_run_sources(), "dry run", resolve_model(model), request) if source else None
    cached = model_cache.load(key) if key else None
    if isinstance(cached, dict) and tuple(cached) == OUTPUT_KEYS and isinstance(cached["results"], list):
        return cached
    out = _dry_run_all(load_model_config(model), strategies, world_size, nodes, setup, knobs)
    if key:
        model_cache.store(key, out)
    return out


def dry_run_sources() -> tuple[str, ...]:
    """The package's files a dry run's rows are computed by (its layers plan/ and model/, and the foundation
    modules they use), named from the package root: the cache key hashes their source."""
    return (*sorted(str(path.relative_to(model_cache.PACKAGE)) for layer in ("plan", "model")
                    for path in (model_cache.PACKAGE / layer).glob("*.py")), *FOUNDATION)


def _dry_run_all(config, strategies, world_size: int, nodes: int, setup, knobs: LibraryKnobs) -> dict:
    spec, results, models = model_spec(config), [], {}
    for strategy in strategies or default_strategies(config, world_size, nodes, setup.tp_size):
        world, where = world_size, nodes
        if _tp_alone(strategy):  # TP alone: the t GPUs of one node, as the planner's tp row
            world, where = tp_degree(spec, replace(setup, gpus_per_node=world_size // nodes)), 1
        note = NOT_DRY_RUN.get(strategy)
        if note is None:
            try:
                result = dry_run(config, strategy, world, where, setup.precision, setup.optimizer,
                                 world if _tp_alone(strategy) else setup.tp_size, models)
            except LibraryRefused as refused:
                note = str(refused)
        if note is not None:  # the planner's formula row, and why there is no dry run beside it
            row = strategy_row(strategy, spec, replace(setup, gpus_per_node=world_size // nodes, nodes=nodes),
                               knobs=knobs)
            results.append({"strategy": strategy, "dry_run": None, "note": note,
                            "planned": {"params_bytes": row.params_bytes, "grads_bytes": row.grads_bytes,
                                        "optimizer_bytes": row.optimizer_bytes,
                                        "model_states_bytes": row.model_states_bytes}})
            continue
        results.append({"strategy": strategy, "world_size": world, "nodes": where,
                        "shard_degree": result.shard_degree, "mesh": list(result.mesh),
                        "mesh_dim_names": list(result.mesh_dim_names), "tp": result.tp, "dtype": result.dtype,
                        "seconds": round(result.seconds, 3), "computed_matches_built": result.computed_matches_built,
                        "built_ranks": [r.rank for r in result.ranks if r.built],
                        **compare_rows(result, spec, setup, knobs),
                        "per_rank": [dict(asdict(r)) for r in result.ranks]})
    out = {"model": spec.name, "params_total": spec.params_total, "world_size": world_size, "nodes": nodes,
           "precision": setup.precision, "optimizer": setup.optimizer, "results": results}
    assert tuple(out) == OUTPUT_KEYS
    return out
