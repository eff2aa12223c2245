"""doctor's multi-node rules (shardscope.doctor.cluster): the DeepSpeed hostfile read by DeepSpeed's own parser,
its hosts and slots against the nodes and GPUs, what `deepspeed --hostfile` needs to reach them, MASTER_ADDR/
MASTER_PORT beside a yaml's rendezvous, NCCL/gloo interface variables, and the fingerprint compared across nodes."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest
import yaml

from shardscope.doctor import cluster
from shardscope.cli import main
from shardscope.configs.catalog import shipped_configs
from shardscope.doctor.diagnose import Inputs, diagnose
from shardscope.doctor.cluster import check_interfaces, check_master_env, fingerprint
from shardscope.doctor.rules import failing

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = {c.path.name: c.path for c in shipped_configs()}
HOSTFILE = ROOT / "ds_configs" / "hostfile"


@pytest.fixture(autouse=True)
def clean_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    for name in ("MASTER_ADDR", "MASTER_PORT", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def programs(monkeypatch):
    """Which of ssh / pdsh this machine has, as the rule sees it."""
    def have(*names):
        monkeypatch.setattr(cluster.shutil, "which", lambda p: f"/usr/bin/{p}" if p in names else None)
    return have


def hostfile(tmp_path, text, name="hostfile"):
    path = tmp_path / name
    path.write_text(text)
    return path


def findings(**inputs):
    return diagnose(Inputs(**inputs))[0]


def codes(found):
    return sorted((f.code, f.key) for f in found)


@pytest.mark.parametrize("text, says", [
    ("node-0 slots=8\nnode-0 slots=8\n", "multiple entries for node-0"),   # duplicate host
    ("node-0 slots=8\nnode-1 gpus=8\n", "bad entry: node-1 gpus=8"),       # not HOST slots=N
    ("# only a comment\n\n", "empty or not formatted correctly"),
])
def test_a_hostfile_deepspeed_refuses_is_an_error_in_deepspeeds_words(tmp_path, text, says, programs):
    programs("ssh", "pdsh")
    (f,) = findings(hostfile=hostfile(tmp_path, text), gpus=8, nodes=2)
    assert (f.code, f.level) == ("hostfile", "error") and says in f.problem and "DeepSpeed refuses it" in f.problem


def test_slots_against_the_gpus_per_node(tmp_path, programs):
    programs("ssh", "pdsh")
    path = hostfile(tmp_path, "a slots=8\nb slots=4\nc slots=16\n")
    found = findings(hostfile=path, gpus=8, nodes=3)
    assert codes(found) == [("hostfile", "b"), ("hostfile", "c")]
    assert "leaving GPUs idle" in found[0].problem and "more than its GPUs" in found[1].problem
    assert findings(hostfile=hostfile(tmp_path, "a slots=8\nb slots=8\nc slots=8\n", "ok"), gpus=8, nodes=3) == []


def test_hosts_against_the_nodes_and_the_yaml_that_names_the_hostfile(tmp_path, programs):
    programs("ssh", "pdsh")
    three = hostfile(tmp_path, "a slots=2\nb slots=2\nc slots=2\n")
    (f,) = findings(hostfile=three, gpus=2, nodes=2)
    assert (f.code, f.key) == ("hostfile", "hosts") and "3 host(s) (a, b, c) but --nodes 2" in f.problem
    yaml_path = tmp_path / "ds_multinode.yaml"  # accelerate hands deepspeed_hostfile to `deepspeed --hostfile`
    yaml_path.write_text(yaml.safe_dump({
        "distributed_type": "DEEPSPEED", "num_machines": 2, "num_processes": 4, "machine_rank": 0,
        "main_process_ip": "10.0.0.1", "main_process_port": 29500,
        "deepspeed_config": {"zero_stage": 2, "deepspeed_hostfile": str(three),
                             "deepspeed_multinode_launcher": "pdsh"}}))
    found = findings(accelerate_config=yaml_path)
    assert ("hostfile", "hosts") in codes(found)
    assert "num_machines 2" in next(f.problem for f in found if f.code == "hostfile")


def test_what_deepspeed_needs_to_reach_the_hosts(tmp_path, programs):
    two = hostfile(tmp_path, "a slots=2\nb slots=2\n")
    programs("ssh")  # no pdsh
    (f,) = findings(hostfile=two, gpus=2, nodes=2)
    assert (f.code, f.level) == ("hostfile-ssh", "notice") and "pdsh not found" in f.problem
    assert "--no_ssh --node_rank N --master_addr" in f.fix
    programs()  # one host needs ssh only (DeepSpeed's ssh check runs for any hostfile), never pdsh
    (f,) = findings(hostfile=hostfile(tmp_path, "a slots=2\n", "one"), gpus=2)
    assert "ssh not found" in f.problem and "pdsh" not in f.problem
    programs("ssh", "pdsh")
    assert findings(hostfile=two, gpus=2, nodes=2) == []


def test_the_shipped_hostfile_is_clean_for_two_nodes_of_eight(programs):
    programs()  # even here (no ssh, no pdsh) only a notice: the file itself is right
    found = findings(hostfile=HOSTFILE, gpus=8, nodes=2)
    assert failing(found) == [] and codes(found) == [("hostfile-ssh", "hosts")]


def test_master_addr_and_port_beside_a_yaml_filled_in_for_the_cluster(tmp_path):
    raw = {"num_machines": 2, "main_process_ip": "10.0.0.1", "main_process_port": 29500}
    found = check_master_env("y.yaml", raw, {"MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29501"})
    assert codes(found) == [("master-env", "main_process_ip"), ("master-env", "main_process_port")]
    assert found[0].level == "warning" and "ignores MASTER_ADDR" in found[0].problem
    assert check_master_env("y.yaml", raw, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}) == []
    assert check_master_env("y.yaml", {**raw, "num_machines": 1}, {"MASTER_ADDR": "10.0.0.2"}) == []
    # the shipped multi-node yamls say 127.0.0.1, to be overridden with --main_process_ip: not a mismatch
    shipped = yaml.safe_load(SHIPPED["ddp_multinode.yaml"].read_text())
    assert check_master_env("ddp_multinode.yaml", shipped, {"MASTER_ADDR": "10.0.0.2"}) == []


def test_interface_variables_name_interfaces_of_this_machine():
    present = [name for _, name in socket.if_nameindex()]
    first = present[0]
    assert check_interfaces({"NCCL_SOCKET_IFNAME": first[:2]}) == []                # NCCL: a prefix
    assert check_interfaces({"NCCL_SOCKET_IFNAME": f"={first}"}) == []              # NCCL: exact
    assert check_interfaces({"NCCL_SOCKET_IFNAME": "^docker,nosuch"}) == []         # NCCL: exclusions
    assert check_interfaces({"GLOO_SOCKET_IFNAME": first}) == []                    # gloo: exact
    (f,) = check_interfaces({"NCCL_SOCKET_IFNAME": f"nosuchif0,{first}"})
    assert (f.code, f.level, f.key) == ("net-interface", "notice", "NCCL_SOCKET_IFNAME") and "'nosuchif0'" in f.problem
    if first[:-1] not in present:
        (f,) = check_interfaces({"GLOO_SOCKET_IFNAME": first[:-1]})  # gloo takes no prefixes
        assert f.key == "GLOO_SOCKET_IFNAME"


def test_fingerprint_ignores_the_node_rank_and_sees_everything_else(tmp_path):
    raw = yaml.safe_load(SHIPPED["zero3_multinode.yaml"].read_text())
    paths = []
    for rank, processes in ((0, 16), (1, 16), (0, 8)):
        path = tmp_path / f"node{len(paths)}.yaml"
        path.write_text(yaml.safe_dump({**raw, "machine_rank": rank, "num_processes": processes}))
        paths.append(path)
    env = {"NCCL_SOCKET_IFNAME": "ib0", "PATH": "/bin"}
    node0, node1, other = (fingerprint([p, HOSTFILE], env) for p in paths)
    assert node0 == node1 != other
    assert fingerprint([paths[0], HOSTFILE], {**env, "PATH": "/usr/bin"}) == node0  # unrelated variables
    assert fingerprint([paths[0], HOSTFILE], {**env, "NCCL_SOCKET_IFNAME": "eth0"}) != node0
    assert fingerprint([paths[0]], env) != node0


def test_doctor_prints_the_fingerprint_on_multi_node_setups_only(capsys, programs):
    programs("ssh", "pdsh")
    assert main(["doctor", "--hostfile", str(HOSTFILE), "--gpus", "8", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "note: multi-node fingerprint " in out and "checked: DeepSpeed hostfile" in out
    assert main(["doctor", "--accelerate-config", "ddp"]) == 0
    assert "fingerprint" not in capsys.readouterr().out


def test_configs_check_reads_no_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "nosuchif0")
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(SHIPPED["ddp_multinode.yaml"].read_text()),
                                    "main_process_ip": "10.0.0.1"}))
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.2")
    assert main(["configs", "check", str(path)]) == 0
    assert {"net-interface", "master-env"} <= {f.code for f in findings(accelerate_config=path)}
