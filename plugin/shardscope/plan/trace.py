"""What a training step holds besides its model states, from the model's own code run on fake tensors.

The model is built from its transformers config inside torch's `FakeTensorMode` (shapes and dtypes, no
memory), one forward with labels (the loss included) and one backward run at the requested shapes, and
torch's `MemTracker` records every tensor: the moment of the largest total, and what was live then
(activations saved for backward, temporaries such as the fp32 logits the loss upcasts, gradients
already produced). This is the same measurement `peak.StepPeak` makes on a real step, so a prediction
and a measurement differ only by what the planner adds for the strategy.

A full-depth run (`plan --simulate`) is exact for one process; the default traces the model at 1 and 2
layers and scales: activations(L) = base + L x per-layer, which holds because every decoder (or encoder)
layer of a transformers model runs the same code on the same shapes. The compute regime follows the
strategy: `autocast` (fp32 parameters, 16-bit ops: DDP) or `pure` (16-bit parameters: FSDP's mixed
precision policy, DeepSpeed's bf16/fp16 module), `fp32` otherwise.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

from ..model.spec import auto_class
from ..strategy import strategy_record

REGIMES = ("fp32", "autocast", "pure")


class TraceError(Exception):
    """The model's code could not run on fake tensors (the planner falls back to its formula)."""


@dataclass(frozen=True)
class Moment:
    """What is live at one phase's peak (forward or backward) besides parameters and optimizer state, for a
    model of L layers: each part is base + L x per-layer bytes."""

    activations: tuple[int, int]   # saved for backward (checkpointing: each layer's input, one layer recomputed)
    temporaries: tuple[int, int]   # logits/loss upcasts, attention scratch, autocast's 16-bit weight copies
    gradients: tuple[int, int]     # gradients already produced (0 in forward)

    def at(self, layers: int) -> dict:
        return {part: base + layers * per_layer for part, (base, per_layer) in
                (("activations", self.activations), ("temporaries", self.temporaries), ("gradients", self.gradients))}


@dataclass(frozen=True)
class StepTrace:
    """The candidate peak moments of one micro-batch, and the trainable bytes the gradients belong to.

    forward:        the forward's peak (the loss included)
    head backward:  the peak before the top layer's backward begins (the loss's and the head's gradients)
    last layer backward / first layer backward: the peak inside the backward of the top and the bottom layer
                    (checkpointing: the late one holds nearly all gradients and little else)
    embeddings backward: the peak from the input embeddings' backward to the end (all other gradients, the
                    embeddings' own; a head tied to them holds its gradient until the two are summed)
    """

    moments: dict                # name -> Moment
    trainable: tuple[int, int]   # bytes of the trainable parameters in the trace's dtype: base, per layer
    regime: str
    simulated: bool = False      # a full-depth run, not scaled from 1 and 2 layers

    def toward(self, big: "StepTrace", largest: int, k: int) -> "StepTrace":
        """The step at micro-batch k, on the line from this trace (micro-batch 1) to `big` (micro-batch `largest`).
        A layer's moment is the largest of its instants', each affine in the micro-batch (per-sample tensors plus
        what does not grow with it: autocast's 16-bit weight copies, rotary tables), so it is convex in it: the
        line is exact at both ends and high between them (but for the small non-linear part the 1-and-2-layer
        scaling leaves: tests/test_peak_prediction.py bounds it)."""
        def line(ones, bigs):
            return tuple(one - (-(k - 1) * (b - one) // max(1, largest - 1)) for one, b in zip(ones, bigs))

        moments = {name: Moment(*(line(a, b) for a, b in zip(
            (m.activations, m.temporaries, m.gradients), (o.activations, o.temporaries, o.gradients))))
            for name, m in self.moments.items() for o in (big.moments[name],)}
        return StepTrace(moments, self.trainable, self.regime, self.simulated)

    def at(self, layers: int) -> dict:
        """{moment: {activations, temporaries, gradient_fraction}} for a model of `layers` layers; the
        gradient fraction is the share of all gradients that exist at that moment."""
        total = self.trainable[0] + layers * self.trainable[1]
        out = {}
        for name, moment in self.moments.items():
            parts = moment.at(layers)
            grads = parts.pop("gradients")
            out[name] = {**parts, "gradient_fraction": min(1.0, max(0.0, grads / total)) if total else 0.0}
        return out


def regime_for(strategy: str, precision: str) -> str:
    """How a strategy computes at `precision` (see the module docstring)."""
    if precision == "fp32":
        return "fp32"
    if precision.endswith("-pure") or not strategy_record(strategy).autocast:
        return "pure"
    return "autocast"


def trace_step(config, micro_batch: int, seq_len: int, *, precision: str = "fp32", regime: str = "fp32",
               checkpointing: bool = False, attention: str = "sdpa", image_size: int | None = None,
               full_depth: bool = False, lora: tuple | None = None, inputs: str = "unpadded") -> StepTrace:
    """Trace one micro-batch's forward and backward (see the module docstring). `config` is the model's
    transformers config; it is copied, never changed. `lora`: (rank, target module names) to train LoRA
    adapters on the frozen model, as peft builds them. `inputs`: how the batch reaches the model (plan/batching.py's
    INPUTS): "padded" adds an attention mask, "packed" position ids; on fake tensors transformers cannot read them,
    so it builds the 4-D mask a real padded (or packed) batch gets. Raises TraceError when the model cannot be
    traced."""
    import torch

    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}")
    half = torch.float16 if precision.startswith("fp16") else torch.bfloat16
    layers_key = _layers_key(config)
    total_layers = getattr(config, layers_key)
    depths = (total_layers,) if full_depth else (1, 2)
    points = []
    for depth in depths:
        try:
            with _quiet_fake_tensor_log(), _grouped_mm_at_any_dtype():
                points.append(_trace(config, layers_key, depth, micro_batch, seq_len, regime, half, checkpointing,
                                     attention, image_size, lora, inputs))
        except TraceError:
            raise
        except Exception as error:  # the model's code on fake tensors: any failure means "cannot trace"
            first = str(error).splitlines()[0] if str(error) else ""
            raise TraceError(f"{type(error).__name__}: {first}"[:200]) from None
    if full_depth:
        (moments, trainable), = points
        return StepTrace({name: Moment(*((v, 0) for v in parts)) for name, parts in moments.items()},
                         (trainable, 0), regime, simulated=True)
    (m1, p1), (m2, p2) = points
    scaled = {name: Moment(*((2 * v1 - v2, v2 - v1) for v1, v2 in zip(m1[name], m2[name]))) for name in m1}
    return StepTrace(scaled, (2 * p1 - p2, p2 - p1), regime)


@contextlib.contextmanager
def _grouped_mm_at_any_dtype():
    """transformers' fused experts (Qwen3-MoE, gpt-oss, Mixtral) call torch's grouped_mm, whose fake kernel takes
    bf16 only (torch 2.13: "Expected inputs of BF16 type"); at another dtype (fp32 weights under autocast)
    transformers' own fallback op (`transformers::grouped_mm_fallback`: a fake kernel at every dtype, the same
    input and weight saved for backward) stands in, chosen where transformers chooses (`_can_use_grouped_mm`)."""
    import torch

    try:
        from transformers.integrations import moe
    except ImportError:  # a transformers without fused experts
        yield
        return
    chooses = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda input, weight, offs: weight.dtype == torch.bfloat16 and chooses(input, weight,
                                                                                                      offs)
    try:
        yield
    finally:
        moe._can_use_grouped_mm = chooses


def trace_attention(config, attention: str) -> tuple[str, str | None]:
    """The attention implementation the trace runs, and why when it is not `attention`: a model whose transformers
    class has no sdpa (gpt-oss) runs eager, as transformers itself chooses for it by default."""
    auto = auto_class(config)
    model_class = auto._model_mapping[type(config)] if auto is not None else None
    if attention != "sdpa" or model_class is None or getattr(model_class, "_supports_sdpa", True):
        return attention, None
    return "eager", (f"traced with eager attention: transformers has no sdpa for {model_class.__name__} (eager is "
                     "what it runs by default)")


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """torch logs an operator its fake kernel refuses, with a traceback, before raising: the raise is what the trace
    reports (one line, in TraceError), so the log is silenced meanwhile."""
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _layers_key(config) -> str:
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(getattr(config, key, None), int):
            return key
    raise TraceError(f"config of model type '{getattr(config, 'model_type', '?')}' names no layer count")


def _trace(config, layers_key, depth, micro_batch, seq_len, regime, half, checkpointing, attention, image_size,
           lora=None, inputs="unpadded"):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM, AutoModelForImageClassification
    from transformers.initialization import no_init_weights

    config = copy.deepcopy(config)
    setattr(config, layers_key, depth)
    if hasattr(config, "layer_types") and isinstance(config.layer_types, list):  # per-layer kinds (Gemma-2, Qwen2)
        config.layer_types = config.layer_types[:depth]
    config._attn_implementation = attention
    auto = auto_class(config)
    if auto not in (AutoModelForCausalLM, AutoModelForImageClassification):
        raise TraceError(f"model type '{getattr(config, 'model_type', '?')}' has no causal-LM or image-classification "
                         "head whose loss could be traced")
    vision = auto is AutoModelForImageClassification
    dtype = half if regime == "pure" else torch.float32
    # Built on the meta device (no weights, no initialisers: they read values), LoRA applied there, then each
    # tensor made a fake CPU tensor of the same shape and dtype: peft's own device moves fail on fake tensors.
    with torch.device("meta"), no_init_weights():
        model = auto.from_config(config, dtype=dtype)  # not the dtype a saved config names
    if lora is not None:
        model = _with_lora(model, *lora)
    with FakeTensorMode(allow_non_fake_inputs=False):
        model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))
        # a fake tensor cannot take a meta tensor's place in its Parameter, so `_apply` made new ones: tie the
        # config's tied weights again (GPT-2's head and input embeddings), or the trace holds two of them
        (model.get_base_model() if lora is not None else model).tie_weights()
        if checkpointing:
            model.config.use_cache = False  # the cache is off under checkpointing anyway: say so, not warn it
            enable_checkpointing(model)
        model.train()
        if vision:
            size = image_size or config.image_size
            batch = {"pixel_values": torch.zeros(micro_batch, config.num_channels, size, size,
                                                 dtype=half if regime == "pure" else torch.float32),
                     "labels": torch.zeros(micro_batch, dtype=torch.long)}
        else:
            ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
            batch = {"input_ids": ids, "labels": ids}
            if inputs == "padded":
                batch["attention_mask"] = torch.ones(micro_batch, seq_len, dtype=torch.long)
            elif inputs == "packed":  # no key/value cache, as the Trainer runs (TrainingArguments.use_cache False):
                # transformers then reads packed sequences from the position ids and builds their block mask (on fake
                # tensors always; unpadded inputs keep the config's cache: a real run's arange positions build none)
                batch.update(position_ids=torch.zeros(micro_batch, seq_len, dtype=torch.long), use_cache=False)
        trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        autocast = torch.autocast("cpu", dtype=half) if regime == "autocast" else contextlib.nullcontext()
        moments = _moments(model, batch, autocast, _layer_list(model, depth))
    return moments, trainable


def enable_checkpointing(model) -> None:
    """transformers' activation checkpointing, non-reentrant as the Trainer's: `activation_checkpointing_enable`
    (5.2x), `gradient_checkpointing_enable` where that is all there is (transformers 5.17, seen on a GPU machine:
    without it every checkpointed plan fell back to the formula, benchmarks/results/gpu_check.md)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _moments(model, batch, autocast, layers) -> dict:
    """One forward with the loss and one backward under MemTracker; the parts (`_parts`) of the candidate moments:
    the model's forward peak, its backward peak before the top layer's backward begins (the loss and the head),
    each end layer's backward peak, and the input embeddings' backward peak, which runs to the end of backward
    (a tied head's gradient waits there to be summed with the embeddings'; absent where no gradient reaches them)."""
    from ..mem_tracker import tracker as memory_tracker

    tracker = memory_tracker()
    tracker.track_external(model)

    def peak(module):  # a module's backward or forward peak so far (MemTracker names its states by these strings)
        states = {s.value: v for s, v in tracker.memory_tracking[module].snapshots.items()} \
            if module in tracker.memory_tracking else {}
        return {state: _parts(states[state][-1]) for state in ("Peak-Forward", "Peak-Backward") if state in states}

    head = {}
    pre_backward = tracker._pre_bw_hook  # ModTracker takes the instance's hooks when the tracker is entered

    def before_layer(module, args):
        if module is layers[-1] and not head:
            head.update(peak(model))
        pre_backward(module, args)

    tracker._pre_bw_hook = before_layer
    with tracker:
        with autocast:
            outputs = model(**batch)
            loss = outputs.loss
            del outputs  # the Trainer keeps only the loss: the logits are freed before backward
        loss.backward()
    moments = {"forward": peak(model)["Peak-Forward"], "head backward": head["Peak-Backward"],
               "last layer backward": peak(layers[-1])["Peak-Backward"],
               "first layer backward": peak(layers[0])["Peak-Backward"]}
    embeddings = peak(_input_embeddings(model)).get("Peak-Backward")
    return moments if embeddings is None else {**moments, "embeddings backward": embeddings}


def _input_embeddings(model):
    """The model's input embeddings module, or None where its class names none."""
    try:
        return model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        return None


def _with_lora(model, rank: int, targets: tuple):
    """The model wrapped by peft with LoRA adapters of `rank` on `targets` ("all-linear": every Linear but the
    head), as `get_peft_model` builds them for training (base weights frozen, adapters in fp32 by default)."""
    import warnings

    from peft import LoraConfig, get_peft_model

    names = "all-linear" if "all-linear" in targets else list(targets)
    try:
        with warnings.catch_warnings():  # peft reads transformers' deprecated name: not the user's to act on
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
            return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=names))
    except ValueError as error:  # no module matches the targets: the planner's own count says so first
        raise TraceError(f"LoRA: {str(error).splitlines()[0]}"[:200]) from None


def _layer_list(model, depth: int):
    """The model's repeated blocks: the ModuleList of `depth` modules of a class it never splits."""
    import torch

    names = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if (isinstance(module, torch.nn.ModuleList) and len(module) == depth
                and all(type(m).__name__ in names for m in module)):
            return module
    raise TraceError(f"no list of {depth} repeated layers found in {type(model).__name__}")


def _parts(snapshot: dict) -> tuple[int, int, int]:
    """(activations, temporaries, gradients) of a MemTracker snapshot, summed over devices."""
    return tuple(sum(per_device.get(category, 0) for per_device in snapshot.values())
                 for category in ("Activation", "Temp", "Gradient"))


def tracer(config, largest: int, trace_of=None):
    """`setup -> {regime: StepTrace}` for a search over many setups of micro-batches 1..`largest`: each
    (checkpointing, precision, sequence, attention, LoRA) traced at micro-batches 1 and `largest`, and any
    micro-batch between taken on the line through them (`StepTrace.toward`: exact at the ends, high
    between); {} when the model cannot be traced. `trace_of(setup)`: `traces_for(config, setup)` another way
    (`trace_cache.cached_tracer`: through the cache)."""
    from dataclasses import replace

    cache, trace_of = {}, trace_of or (lambda setup: traces_for(config, setup))

    def traces(setup) -> dict:
        key = (setup.activation_checkpointing, setup.precision, setup.seq_len, setup.image_size, setup.attention,
               setup.lora_rank, setup.lora_targets, setup.batch_inputs)
        if key not in cache:
            cache[key] = [trace_of(replace(setup, micro_batch=b))[0] for b in sorted({1, largest})]
        one, big = cache[key][0], cache[key][-1]
        return {regime: trace.toward(big[regime], largest, setup.micro_batch) for regime, trace in one.items()}
    return traces


def traces_for(config, setup, simulate: bool = False) -> tuple[dict, str | None]:
    """{regime: StepTrace} for every regime `setup.precision` needs (fp32: one; 16-bit: autocast and pure),
    and a note when the model cannot be traced (the planner then uses its formula, marked approximate)."""
    regimes = ("fp32",) if setup.precision == "fp32" else ("autocast", "pure")
    attention, why = trace_attention(config, setup.attention)
    traces = {}
    for regime in regimes:
        try:
            traces[regime] = trace_step(config, setup.micro_batch, setup.seq_len, precision=setup.precision,
                                        regime=regime, checkpointing=setup.activation_checkpointing,
                                        attention=attention, image_size=setup.image_size,
                                        full_depth=simulate,
                                        lora=(setup.lora_rank, setup.lora_targets) if setup.lora_rank else None,
                                        inputs=setup.batch_inputs)
        except TraceError as error:
            return {}, f"activations from the formula (approximate): the model could not be traced ({error})"
    return traces, why
