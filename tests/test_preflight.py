"""`shardscope preflight` on loopback (gloo, CPU), as docs/cluster.md's "Before the first multi-node run" runs it.

Node check (one process per "node", no launcher): all joined with equal fingerprints exits 0; a node never
started is named by the deadline and every joined process exits 1 within it + 10 s; a node with another NCCL
variable is a finding. Full check, launched like training as two "nodes" of 2 ranks: torchrun (rank 3 slowed
on purpose with the hidden `--test-slow-rank`: named as the straggler), accelerate's multi-node yaml, and
DeepSpeed's hostfile launch (one `deepspeed --no_ssh` launcher per host, as tests/test_multinode.py does).
Every launch is shared by the assertions about it; the JSON is read back by `calibration_from_preflight`.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from launch import BIN, ROOT, accelerate_multinode_launch, cpu_env, free_port, multinode_launch

from shardscope.cli import main
from shardscope.configs.catalog import find_config
from shardscope.preflight import calibration_from_preflight
from shardscope.measure.collective_timing import KINDS

SIZES = [64 * 2 ** 10, 256 * 2 ** 10]  # small: a launch takes seconds on CPU
SIZE_ARG = ",".join(f"{s // 2 ** 10}KiB" for s in SIZES)
DEADLINE_SLACK = 10  # the bound: a missing node is reported within the deadline + 10 s
TABLE = "shardscope preflight ("


# ----------------------------------------------------------------------------- the node check
def together(specs: dict, timeout: float) -> dict:
    """Start `shardscope preflight ARGS` for each name -> (args, extra env) at once; -> {name: (rc, output)}.
    Each runs under coreutils' `timeout` at the deadline + DEADLINE_SLACK: one that has not ended by then exits 124
    (the bound is the process's, not a clock read here). No launcher, so no cpu_shim on the path (its start-up
    imports would count against the deadline)."""
    procs = {}
    for name, (args, env) in specs.items():
        procs[name] = subprocess.Popen(["timeout", "--kill-after", "5", str(timeout + DEADLINE_SLACK), sys.executable,
                                        "-m", "shardscope", "preflight", *map(str, args)],
                                       env=cpu_env(PYTHONPATH=str(ROOT / "plugin"), **env), cwd=ROOT, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    outputs = {name: proc.communicate()[0] for name, proc in procs.items()}
    return {name: (proc.returncode, outputs[name]) for name, proc in procs.items()}


def node_args(out, nnodes, rank, port, timeout, *extra):
    folder = out / f"node{rank}"  # not there yet: each node's check creates its own
    return ["--nnodes", nnodes, "--node-rank", rank, "--master-addr", "127.0.0.1", "--master-port", port,
            "--timeout", timeout, "--sizes", SIZE_ARG, "--output-dir", folder, *extra]


def node_check(out, nnodes, ranks, timeout=30, env=None):
    """One node-check process per rank in `ranks`, on one port; -> {rank: (rc, output)}."""
    port = free_port()
    return together({rank: (node_args(out, nnodes, rank, port, timeout), (env or {}).get(rank, {}))
                     for rank in ranks}, timeout)


def bus(row, ranks):
    """nccl-tests' bus bandwidth, written out here: size / seconds x 2(n-1)/n (all_reduce), x (n-1)/n otherwise."""
    factor = 2 * (ranks - 1) / ranks if row["kind"] == "all_reduce" else (ranks - 1) / ranks
    return row["size_bytes"] / row["seconds"] * factor


@pytest.mark.launch
def test_node_check_all_joined_times_the_link_and_exits_0(tmp_path):
    results = node_check(tmp_path, 2, [0, 1])
    assert [rc for rc, _ in results.values()] == [0, 0], results
    assert "all 2 nodes joined" in results[0][1] and "findings: none" in results[0][1]
    assert TABLE not in results[1][1] and "all 2 nodes joined; 0 finding(s)" in results[1][1]
    doc = json.loads((tmp_path / "node0" / "preflight.json").read_text())
    assert not (tmp_path / "node1" / "preflight.json").exists()  # node 0 writes, the others print one line
    assert (tmp_path / "node1").is_dir()  # each node made its --output-dir (not shared here), as node 0 did
    assert (doc["check"], doc["missing"], doc["findings"], doc["exit_code"]) == ("node", [], [], 0)
    assert [n["node"] for n in doc["nodes"]] == [0, 1]
    assert doc["nodes"][0]["fingerprint"] == doc["nodes"][1]["fingerprint"] | {"host": doc["nodes"][0]["host"]}
    collectives = [r for r in doc["links"] if r["scope"] != "pair"]
    assert sorted((r["kind"], r["scope"]) for r in collectives) == sorted((k, "inter") for k in KINDS for _ in SIZES)
    for row in collectives:  # one process per node: every collective crosses nodes
        assert row["ranks"] == [0, 1] and row["seconds"] > 0
        assert math.isclose(row["busbw_bytes_per_s"], bus(row, 2))
    pairs = [r for r in doc["links"] if r["scope"] == "pair"]
    assert sorted(tuple(r["nodes"]) for r in pairs) == [(0, 1), (1, 0)]
    assert doc["slowest_pair"]["nodes"] == [0, 1]
    assert doc["slowest_pair"]["busbw_bytes_per_s"] == min(r["busbw_bytes_per_s"] for r in pairs)
    calibration = calibration_from_preflight(tmp_path / "node0" / "preflight.json")
    assert calibration["link_bytes_per_s"]["send_recv"] == {"inter": doc["slowest_pair"]["busbw_bytes_per_s"]}
    top = {r["kind"]: r["busbw_bytes_per_s"] for r in collectives if r["size_bytes"] == max(SIZES)}
    assert {k: v["inter"] for k, v in calibration["link_bytes_per_s"].items() if k in KINDS} == top
    assert calibration["matmul_flops_per_s"] == {}  # the node check times no compute


@pytest.mark.launch
def test_a_member_never_started_is_named_by_the_deadline(tmp_path):
    """Three checks at once, each alone: node 0 (node 1 never started), node 1 (node 0, the meeting point, never
    started) and the full check's rank 0 of 2 started by hand (the launcher's variables, no launcher). The deadline
    counts from the command's start; the bound holds while importing torch takes less than the timeout."""
    timeout = 8
    full = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}
    results = together({
        "node0": (node_args(tmp_path / "a", 2, 0, free_port(), timeout, "--hosts", "gpu-a,gpu-b"), {}),
        "node1": (node_args(tmp_path / "b", 2, 1, free_port(), timeout), {}),
        "rank0": (["--timeout", timeout, "--sizes", SIZE_ARG, "--output-dir", tmp_path], full)}, timeout)
    for name, (rc, output) in results.items():  # 124: still running at the deadline + DEADLINE_SLACK
        assert rc == 1 and "Traceback" not in output, (name, rc, output)
    assert "1 of 2 nodes never joined by the deadline: node 1 (gpu-b)" in results["node0"][1]
    doc = json.loads((tmp_path / "a" / "node0" / "preflight.json").read_text())
    assert doc["missing"] == [{"node": 1, "host": "gpu-b"}] and doc["exit_code"] == 1 and doc["links"] == []
    output = results["node1"][1]
    assert "node 0 (the meeting point 127.0.0.1:" in output and f"never answered within {timeout} s" in output
    assert "1 of 2 ranks never joined by the deadline: rank 1" in results["rank0"][1]
    doc = json.loads((tmp_path / "preflight.json").read_text())
    assert (doc["check"], doc["missing"], doc["compute"]) == ("full", [{"rank": 1, "node": 1, "host": None}], [])


@pytest.mark.launch
def test_a_node_with_another_nccl_variable_is_named(tmp_path):
    results = node_check(tmp_path, 2, [0, 1], env={1: {"NCCL_IB_DISABLE": "1"}})
    assert [rc for rc, _ in results.values()] == [1, 1], results
    doc = json.loads((tmp_path / "node0" / "preflight.json").read_text())
    (finding,) = doc["findings"]
    assert (finding["code"], finding["key"], finding["nodes"]) == ("fingerprint", "NCCL_IB_DISABLE", [1])
    assert finding["values"] == {"1": "1"} and finding["majority"] == "(unset)"  # a tie: node 0's value
    assert "NCCL_IB_DISABLE differs: node 1 has '1'" in results[0][1]
    assert "1 finding(s) (node 0 printed them)" in results[1][1]


def test_bad_options_exit_2_with_one_line(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")  # an --output-dir under a file cannot be created
    for argv in (["--nnodes", "2", "--node-rank", "2", "--master-addr", "a"], ["--nnodes", "2"],
                 ["--sizes", "1XB"], ["--timeout", "0"], ["--output-dir", str(tmp_path / "a_file" / "sub")],
                 ["--nnodes", "2", "--node-rank", "0", "--master-addr", "a", "--hosts", "x"]):
        assert main(["preflight", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("shardscope: error: ") and err.count("\n") == 1, err


# ----------------------------------------------------------------------------- the full check
def launch_args(out, *extra):
    return ["preflight", "--sizes", SIZE_ARG, "--output-dir", str(out), *extra]


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory):
    """Two torchrun launchers as two "nodes" of 2 ranks; rank 3 slowed on purpose (--test-slow-rank 3)."""
    out, port = tmp_path_factory.mktemp("preflight_torchrun"), free_port()
    cmds = {node: [str(BIN / "torchrun"), "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "2",
                   "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "shardscope",
                   *launch_args(out, "--test-slow-rank", "3")] for node in (0, 1)}
    return multinode_launch(cmds, cpu_env(), out, timeout=150)


def full_doc(run):
    assert not run.timed_out and run.survivors() == []
    return json.loads((run.output_dir / "preflight.json").read_text())


def check_full_document(doc):
    """What every full check on two "nodes" of 2 ranks must hold, whatever the launcher."""
    assert doc["check"] == "full" and doc["missing"] == [] and doc["expected"] == 4
    assert [(r["rank"], r["node"], r["local_rank"]) for r in doc["ranks"]] == [(0, 0, 0), (1, 0, 1), (2, 1, 0),
                                                                               (3, 1, 1)]
    groups = {"intra": [[0, 1], [2, 3]], "inter": [[0, 2], [1, 3]]}
    collectives = [r for r in doc["links"] if r["scope"] != "pair"]
    assert sorted((r["kind"], r["scope"], r["ranks"], r["size_bytes"]) for r in collectives) == sorted(
        (k, s, g, size) for k in KINDS for s, gs in groups.items() for g in gs for size in SIZES)
    for row in collectives:
        assert math.isclose(row["busbw_bytes_per_s"], bus(row, 2))
        assert row["nodes"] == ([row["ranks"][0] // 2] if row["scope"] == "intra" else [0, 1])
    pairs = [r for r in doc["links"] if r["scope"] == "pair"]
    assert [(r["ranks"], r["nodes"]) for r in sorted(pairs, key=lambda r: r["ranks"])] == [([0, 2], [0, 1]),
                                                                                           ([2, 0], [1, 0])]
    assert doc["slowest_pair"]["nodes"] == [0, 1]
    assert [c["rank"] for c in doc["compute"]] == [0, 1, 2, 3]
    assert all(c["flops_per_s"] > 0 and c["dtype"] == "float32" for c in doc["compute"])
    fingerprints = [r["fingerprint"] for r in doc["ranks"]]
    assert all(fp["torch"] == fingerprints[0]["torch"] and fp["backend"] == "gloo" for fp in fingerprints)


@pytest.mark.launch
def test_torchrun_full_check_names_the_slowed_rank_as_the_straggler(torchrun_run):
    doc = full_doc(torchrun_run)
    check_full_document(doc)
    stragglers = [f for f in doc["findings"] if f["code"] == "straggler"]
    assert [f["ranks"] for f in stragglers] == [[3]] and doc["findings"] == stragglers
    assert "rank 3 (node 1) is a straggler" in stragglers[0]["message"]
    flops = {c["rank"]: c["flops_per_s"] for c in doc["compute"]}
    assert min(flops, key=flops.get) == 3
    assert doc["exit_code"] == 1 and torchrun_run.returncodes == [1, 1]  # every rank exits with the verdict
    node0, node1 = torchrun_run.outputs
    assert node0.count(TABLE) == 1 and TABLE not in node1  # rank 0 prints the table, once
    assert "findings: 1" in node0 and "rank 3 (node 1) is a straggler" in node0


@pytest.mark.launch
def test_calibration_reads_back_what_the_full_check_wrote(torchrun_run):
    doc = full_doc(torchrun_run)
    calibration = calibration_from_preflight(torchrun_run.output_dir / "preflight.json")
    for kind in KINDS:
        for scope in ("intra", "inter"):
            rows = [r for r in doc["links"] if (r["kind"], r["scope"], r["size_bytes"]) == (kind, scope, max(SIZES))]
            assert calibration["link_bytes_per_s"][kind][scope] == min(r["busbw_bytes_per_s"] for r in rows)
    assert calibration["matmul_flops_per_s"] == {c["rank"]: c["flops_per_s"] for c in doc["compute"]}
    assert calibration["dtype"] == "float32"


@pytest.mark.launch
def test_accelerate_multinode_yaml_full_check_all_clear(tmp_path):
    """accelerate's multi-node yaml, two launchers (ACCELERATE_USE_CPU=1 set by the helper; docs/cluster.md)."""
    run = accelerate_multinode_launch(find_config("ddp_multinode").path, "shardscope", launch_args(tmp_path),
                                      tmp_path, launcher_flags=["-m"], timeout=150)
    doc = full_doc(run)
    check_full_document(doc)
    assert doc["findings"] == [] and doc["exit_code"] == 0, doc["findings"]
    run.check()
    assert run.outputs[0].count(TABLE) == 1 and "findings: none" in run.outputs[0]


@pytest.mark.launch
def test_deepspeed_hostfile_full_check(tmp_path):
    """DeepSpeed's multi-node launch as tests/test_multinode.py runs it: a hostfile of two hosts x 2 slots, one
    `deepspeed --hostfile F --no_ssh --node_rank N` per host; --no_local_rank keeps --local_rank out of argv."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    port = free_port()
    cmds = {node: [str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node),
                   "--master_addr", "127.0.0.1", "--master_port", str(port), "--no_local_rank", "--module",
                   "shardscope", *launch_args(tmp_path)] for node in (0, 1)}
    run = multinode_launch(cmds, cpu_env(), tmp_path, timeout=150)
    doc = full_doc(run)
    check_full_document(doc)
    assert doc["findings"] == [] and doc["exit_code"] == 0, doc["findings"]
    run.check()


# ----------------------------------------------------------------------------- the pure pieces
def test_fingerprint_differences_name_the_odd_members_and_the_majority():
    from shardscope.preflight.report import fingerprint_findings as differences

    prints = {0: {"torch": "2.13.0", "host": "a"}, 1: {"torch": "2.13.0", "host": "b"},
              2: {"torch": "2.12.1", "host": "c", "NCCL_IB_HCA": "mlx5_0"}}
    found = {f["key"]: f for f in differences(prints)}
    assert sorted(found) == ["NCCL_IB_HCA", "torch"]  # the host differs by design: never compared
    assert (found["torch"]["nodes"], found["torch"]["majority"]) == ([2], "2.13.0")
    assert (found["NCCL_IB_HCA"]["nodes"], found["NCCL_IB_HCA"]["majority"]) == ([2], "(unset)")
    (by_rank,) = differences({0: {"gpu": "H100"}, 1: {"gpu": "A100"}}, "rank", lambda r: f" (node {r // 8})")
    assert by_rank["ranks"] == [1] and "rank 1 (node 0) has 'A100'" in by_rank["message"]


def test_links_below_half_the_expected_speed_or_of_their_peers():
    from shardscope.plan.time_model import DATASHEETS, Hardware
    from shardscope.preflight.report import COMPARED_FROM, expected_links, link_findings, slowest_pair

    expected = expected_links("NVIDIA H100 80GB HBM3")
    assert expected["intra"] == DATASHEETS["H100"][2] * 1e9  # the fit model's table, not a copy
    assert expected["inter"] == Hardware.network_bytes_per_s and expected_links(None) is None

    def row(scope, who, busbw, kind="all_reduce", size=COMPARED_FROM):
        return {"kind": kind, "scope": scope, "group": who, "ranks": [who], "nodes": [who] if scope == "intra" else who,
                "size_bytes": size, "seconds": 1.0, "busbw_bytes_per_s": busbw}

    rows = [row("intra", 0, 0.49 * expected["intra"]), row("intra", 1, 0.6 * expected["intra"])]
    (found,) = link_findings(rows, expected)
    assert (found["code"], found["who"]) == ("slow-link", "node 0") and "under half the expected" in found["message"]
    assert link_findings(rows, None) == []  # CPU: nothing expected, and two nodes have no odd one out
    small = [row("intra", 0, 0.1 * expected["intra"], size=COMPARED_FROM // 2)]
    assert link_findings(small, expected) == []  # latency-bound sizes are not held against the link's speed
    pairs = [row("pair", [a, b], value, "send_recv") for (a, b), value in
             {(0, 1): 10e9, (1, 0): 10e9, (0, 2): 10e9, (2, 0): 9e9, (1, 2): 4e9, (2, 1): 4.5e9}.items()]
    (found,) = link_findings(pairs, None)
    assert found["who"] == "nodes 1 and 2" and "under half the median" in found["message"]
    assert slowest_pair(pairs) == {"nodes": [1, 2], "busbw_bytes_per_s": 4e9, "pairs_measured": 3}


def test_stragglers_are_below_80_percent_of_the_median():
    from shardscope.preflight.report import stragglers

    assert [f["ranks"] for f in stragglers({0: 100e12, 1: 100e12, 2: 100e12, 3: 79e12, 4: 81e12})] == [[3]]
    assert stragglers({0: 100e12}) == []


def test_calibration_refuses_a_file_that_is_not_a_preflight(tmp_path):
    from shardscope.errors import UsageError

    other = tmp_path / "shardscope_summary.json"
    other.write_text(json.dumps({"world_size": 4}))
    with pytest.raises(UsageError, match="not a preflight.json"):
        calibration_from_preflight(other)
    broken = tmp_path / "preflight.json"
    broken.write_text(json.dumps({"schema_version": 1, "links": [{"kind": "all_reduce"}], "compute": []}))
    with pytest.raises(UsageError, match="malformed 'links' or 'compute'"):
        calibration_from_preflight(broken)


def test_the_meeting_names_late_and_miscounted_members():
    """meet() in one process over torch's HashStore: node 0 closes the meeting at the deadline; a member started
    with another member count is refused instead of waiting for a group that will never form; a late one is left
    out."""
    import threading

    import torch.distributed as dist

    from shardscope.preflight import meet

    store, results = dist.HashStore(), {}

    def join(me, count, deadline):
        try:
            results[me] = meet.meet(store, me, count, {"node": me}, meet.deadline_in(deadline))
        except meet.Unreachable as error:
            results[me] = str(error)

    threads = [threading.Thread(target=join, args=(0, 3, 1.0)), threading.Thread(target=join, args=(1, 2, 1.0))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results[0] == ([0, 1], {0: {"node": 0}, 1: {"node": 1}})  # member 2 never came
    assert results[1] == "member 0 expects 3 members, this one was started with 2"
    join(2, 3, 1.0)  # after the deadline: the verdict stands, without it (node_check says "joined after the deadline")
    assert results[2][0] == [0, 1]


def test_a_group_that_never_forms_is_a_finding_not_a_hang():
    """After the meeting, a member that never joins the process group: gloo's own timeout, turned into a finding."""
    import threading
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from shardscope.preflight.checks import PreflightOptions, run_measurements

    options = PreflightOptions("node", timeout=1.0, started=0.0, output_dir=Path("."), sizes=(2 ** 10,))  # no deadline read
    result = []
    check = threading.Thread(target=lambda: result.append(run_measurements(
        dist.HashStore(), [{"node": 0}, {"node": 1}], 0, options, torch.device("cpu"))))
    check.start()
    check.join(timeout=10)  # a hang fails here: gloo's 1 s timeout, not NCCL's 30 minutes
    assert not check.is_alive()
    rows, flops, (failed,) = result[0]
    assert (rows, flops, failed["code"]) == ([], [], "link-failed")
    assert not dist.is_initialized()  # destroyed: the next check in this process starts clean
