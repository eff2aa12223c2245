"""Collectives counted (comm_count.py) and the step's time broken down (time_breakdown.py), in one process.

The 2-rank runs (test_comm_agreement.py, test_tensor_parallel.py) hold the counts against the planner; here a
1-rank gloo group checks each kind's logical size, and synthetic profiler spans check the breakdown's arithmetic.
"""
import json
import logging

import pytest
import torch
import torch.distributed as dist

from shardscope.measure import comm_count, time_breakdown
from shardscope.measure.comm_count import CollectiveCounter, sent_share

# Parts are built to partition the step exactly; float rounding is all that may differ.
SUM_REL = 1e-9


@pytest.fixture(scope="module")
def group():
    """A real 1-rank gloo process group (a collective over one rank sends nothing, but is issued and sized)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_each_kind_is_sized_by_its_logical_tensor(group):
    import torch.distributed._functional_collectives as funcol

    x = torch.ones(10, 4)  # 160 bytes
    with CollectiveCounter() as counter:
        dist.all_reduce(x)
        dist.all_reduce(x.double())  # 320 bytes: the dtype counts
        dist.all_gather_into_tensor(torch.empty(10, 4), x)
        dist.all_gather([torch.empty(10, 4)], x)
        dist.reduce_scatter_tensor(torch.empty(10, 4), x)
        dist.broadcast(x, 0)
        dist.barrier()
        funcol.wait_tensor(funcol.all_reduce(x, "sum", group))  # waited: an unwaited one outlives the test
        funcol.wait_tensor(funcol.all_gather_tensor(x, 0, group))  # functional: sized as input x group size
    comm = counter.result()["comm"]
    assert comm["all_reduce"] == {"calls": 3, "bytes": 160 + 320 + 160, "sent_bytes": 0}  # one rank sends nothing
    assert comm["all_gather"]["calls"] == 3 and comm["all_gather"]["bytes"] == 3 * 160
    assert comm["reduce_scatter"]["bytes"] == 160 and comm["broadcast"]["bytes"] == 160
    assert comm["barrier"] == {"calls": 1, "bytes": 0, "sent_bytes": 0}
    assert counter.result()["comm_sent_bytes_per_step"] == 0


def test_fsdp2_gradient_clipping_runs_under_the_counter(group):
    """FSDP2's clip_grad_norm_ propagates DTensor shardings on FakeTensors: the counter hands back DTensors only, so
    the norm is computed as without the counter, and counting goes on."""
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    fully_shard(model[0])
    fully_shard(model)
    model(torch.ones(4, 8)).sum().backward()
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.full_tensor())
                                                     for p in model.parameters()]))  # before clipping
    with CollectiveCounter() as counter:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert float(norm.full_tensor()) == pytest.approx(float(expected), rel=1e-6)
    assert counter.instrument.ok


def test_unknown_collective_is_other_with_one_warning(group, caplog):
    """An operator in a collective namespace the table does not know: counted as `other`, warned once."""
    library = torch.library.Library("c10d", "FRAGMENT")
    library.define("shardscope_test_collective(Tensor x) -> Tensor")
    library.impl("shardscope_test_collective", lambda x: x.clone(), "CompositeExplicitAutograd")
    with caplog.at_level(logging.WARNING, logger="shardscope"), CollectiveCounter() as counter:
        for _ in range(2):
            torch.ops.c10d.shardscope_test_collective(torch.ones(8))
    assert counter.result()["comm"] == {"other": {"calls": 2, "bytes": 2 * 32, "sent_bytes": 0}}
    assert sum("shardscope_test_collective" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("kind, n, share", [("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_gather", 4, 0.75),
                                            ("reduce_scatter", 2, 0.5), ("broadcast", 1, 0.0), ("send", 4, 1.0),
                                            ("recv", 4, 0.0), ("other", 4, 0.0)])
def test_sent_bytes_follow_the_ring_convention(kind, n, share):
    assert sent_share(kind, n) == share


def test_fields_round_trip_through_the_cross_rank_gather():
    counted = {"comm": {"all_gather": {"calls": 3, "bytes": 600, "sent_bytes": 300}}, "comm_sent_bytes_per_step": 300,
               "comm_padded_tokens": 64}
    fields = comm_count.to_fields(counted)
    assert set(fields) == set(comm_count.RANK_FIELDS)
    assert comm_count.from_fields(fields) == counted
    assert comm_count.from_fields(comm_count.to_fields(None))["comm"] is None


def test_breakdown_partitions_the_step_and_takes_exposed_comm_out_of_its_phase():
    """step 0-100 us; forward 10-30, backward 30-70, optimizer 75-90 with its inner update 77-82 and 84-88;
    collectives 40-60 and 80-85; compute ops 10-25, 30-45, 55-70, 75-90; a library's ranges 12-16, 50-58 and 80-82.
    Exposed: 45-55 (in backward); 80-85 is hidden under the optimizer's compute. Library: 4 us in forward, 8 - 5
    exposed in backward; its range inside the optimizer is not forward or backward work."""
    spans = {"step": [(0, 100)], "forward": [(10, 30)], "backward": [(30, 70)], "optimizer": [(75, 90)],
             "update": [(77, 82), (84, 88)], "library": [(12, 16), (50, 58), (80, 82)],
             "comm": [(40, 60), (80, 85)], "compute": [(10, 25), (30, 45), (55, 70), (75, 90)]}
    out = {k: round(v * 1e6, 6) for k, v in time_breakdown.breakdown(spans).items()}
    assert out == {"forward_s": 20, "backward_s": 30, "optimizer_s": 15, "optimizer_update_s": 9, "comm_s": 25,
                   "exposed_comm_s": 10, "data_wait_s": 10, "other_s": 15, "step_s": 100, "library_s": 7}
    assert sum(out[k] for k in time_breakdown.PARTS) == out["step_s"]


def _train(tiny_llama, tmp_path, steps, **callback_kwargs):
    from test_callback_contract import token_rows, train
    from transformers import AutoModelForCausalLM

    return train(AutoModelForCausalLM.from_pretrained(tiny_llama), token_rows(), tmp_path, steps=steps,
                 **callback_kwargs)


def test_one_process_run_reports_a_breakdown_that_sums_to_its_step(tiny_llama, tmp_path):
    trainer, summary = _train(tiny_llama, tmp_path, steps=6, time_every_n_steps=2)
    rank = summary["ranks"][0]
    assert rank["comm"] == {} and rank["comm_sent_bytes_per_step"] == 0  # one process issues no collective
    assert not [key for key in rank if key.startswith("comm_") and key not in ("comm_sent_bytes_per_step",
                                                                                "comm_padded_tokens")]
    timed = rank["time_breakdown"]
    assert timed["timed_steps"] == 3  # step 4 (the default) and every 2nd: 2, 4, 6
    assert sum(timed[k] for k in time_breakdown.PARTS) == pytest.approx(timed["step_s"], rel=SUM_REL)
    assert min(timed["forward_s"], timed["backward_s"], timed["optimizer_s"]) > 0 and timed["comm_s"] == 0
    assert summary["straggler"]["busiest_rank"] == 0 and summary["straggler"]["spread"] == 0
    assert summary["gradient_accumulation_steps"] == 1
    # steps 3 (memory and collectives), 2, 4 and 6 (timed) are instrumented: only 1 and 5 are throughput
    assert rank["throughput"]["samples"] == 2 * 2
    # the same 2 plain steps timed one by one: with two, the median is their mean
    timing = rank["step_seconds"]
    assert timing["steps"] == 2 and timing["p10"] <= timing["median"] <= timing["p90"]
    assert 2 * timing["median"] == pytest.approx(rank["throughput"]["seconds"], rel=1e-9)


def test_a_profiler_already_running_costs_the_breakdown_not_the_training(tiny_llama, tmp_path, caplog):
    """The user profiles the whole run: a second torch profiler would end their session (torch keeps one), so
    the breakdown is left out with one warning, their profile keeps its events and training finishes."""
    with caplog.at_level(logging.WARNING, logger="shardscope"), torch.profiler.profile() as users:
        _, summary = _train(tiny_llama, tmp_path, steps=4)
    assert any(e.name == "aten::mm" for e in users.events())
    assert summary["global_step"] == 4 and summary["ranks"][0]["time_breakdown"] is None
    assert summary["straggler"] is None
    assert sum("step_time disabled" in r.message for r in caplog.records) == 1
    assert "already running" in summary["instruments"]["step_time"]
    json.dumps(summary)  # still a complete summary
