"""`plan --dataset` / `fit --dataset`: the dataset's real lengths (plan/dataset.py, plan/batching.py), each way of
batching's worst micro-batch and padding waste, and each strategy's peak at that worst micro-batch."""
from __future__ import annotations

from ..errors import UsageError
from ..plan.batching import batchings, data_facts, worst_step_shape
from ..plan.dataset import MODES, load_tokenizer, read_lengths
from ..units import gb


def add_dataset_arguments(parser, batching: bool = True) -> None:
    """`--dataset` and its flags (`plan`, `fit`); `--batching` (what plan's main table plans) where `batching`."""
    group = parser.add_argument_group("your data (plans at the worst micro-batch of the dataset's real lengths)")
    group.add_argument("--dataset", metavar="PATH",
                       help="jsonl, json, parquet, csv or arrow file, or a save_to_disk folder: Alpaca "
                            "instruction/input/output, chat messages, or --text-field")
    group.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder (default: the --model folder)")
    group.add_argument("--text-field", help="read this text column (as the recipe's --text_field)")
    group.add_argument("--max-length", type=int,
                       help="length limit: longer samples are truncated, blocks of packing (default: --seq-len)")
    group.add_argument("--sample", type=int, metavar="N", help="read only the first N rows (faster; can miss the "
                                                               "long tail)")
    if batching:
        group.add_argument("--batching", choices=MODES, default="pad_longest",
                           help="the batching the main table plans (default pad_longest, the Trainer's collator); "
                                "every mode's worst-step peak is printed beside it")


def dataset_lengths(args) -> tuple:
    """(`dataset.Lengths` of `--dataset`, the length limit: `--max-length`, else `--seq-len`)."""
    if not args.model:
        raise UsageError("--dataset needs --model (a folder, or a shipped name with --tokenizer DIR)")
    if args.sample is not None and args.sample < 1:
        raise UsageError(f"--sample must be at least 1, got {args.sample}")
    max_length = args.max_length if args.max_length is not None else args.seq_len
    if max_length < 1:
        raise UsageError(f"--max-length must be at least 1, got {max_length}")
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    return read_lengths(args.dataset, tokenizer, max_length, args.text_field, args.sample), max_length


def read_dataset(args) -> tuple[dict, dict]:
    """(`data` facts, {mode: Batching}) of `--dataset` at `--max-length` and `--micro-batch`."""
    lengths, max_length = dataset_lengths(args)
    facts = data_facts(lengths, max_length, args.micro_batch)
    return {"path": args.dataset, **facts}, batchings(lengths, max_length, args.micro_batch)


def dataset_plan_setup(args, setup) -> tuple:
    """(`data` facts, {mode: Batching}, the setup as given, the setup at `--batching`'s worst micro-batch) with
    `--dataset`; (None, None, setup, setup) without."""
    if not args.dataset:
        return None, None, setup, setup
    data, modes = read_dataset(args)
    return data, modes, setup, worst_step_shape(setup, modes[args.batching])


def format_data(data: dict, peaks: dict, chosen: str) -> list[str]:
    """The dataset's lines above the main table: counts, percentiles, and per mode its worst micro-batch, padding
    waste and each strategy's worst-step peak."""
    pct = data["length_percentiles"]
    lines = [f"dataset {data['path']}: {data['samples']:,} samples" + (f" ({data['dropped']:,} dropped: no response "
             "token within --max-length)" if data["dropped"] else "") + f", {data['tokens']:,} tokens after "
             f"--max-length {data['max_length']:,}" + (f"; a sample of the first {data['rows_read']:,} rows: the "
                                                       "long tail may be missed" if data["sampled"] else ""),
             f"lengths (tokens): p50 {pct['p50']:,}, p90 {pct['p90']:,}, p99 {pct['p99']:,}, max {pct['max']:,}; "
             f"{data['truncated']:,} over --max-length (truncated)", ""]
    modes = list(data["batching"])
    lines.append(f"{'worst step, micro-batch ' + str(data['micro_batch']):<30}" + "".join(f"{m:>16}" for m in modes))
    lines.append(f"{'worst micro-batch (rows x len)':<30}" + "".join(
        f"{str(w['rows']) + ' x ' + str(w['seq_len']):>16}" for w in (data["batching"][m]["worst_micro_batch"]
                                                                       for m in modes)))
    lines.append(f"{'padding waste':<30}" + "".join(f"{data['padding_waste'][m]:>16.1%}" for m in modes))
    lines.append(f"{'peak per GPU, GB (fits)':<30}")
    for strategy in peaks[modes[0]]:
        cells = [peaks[m].get(strategy) for m in modes]
        lines.append(f"  {strategy:<28}" + "".join(
            f"{'' if c is None else gb(c['peak_bytes']) + {True: ' yes', False: ' no', None: ''}[c['fits']]:>16}"
            for c in cells))
    lines += [f"padding waste: padded tokens / real tokens; pad_longest {data['batching']['pad_longest']['note']}; "
              f"group_by_length {data['batching']['group_by_length']['note']}",
              f"packing: {data['batching']['packing']['note']}; padding_free: examples kept apart by position ids, "
              f"{data['batching']['padding_free']['note']}",
              f"the table below plans the worst micro-batch of {chosen} (--batching)", ""]
    return lines
