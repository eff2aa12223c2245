"""doctor's precision rules (doctor_precision.py), in process: one fixture per rule, and silence on sound set-ups."""
from pathlib import Path

import pytest
import yaml

from shardscope.doctor.diagnose import Inputs, diagnose, parse_trainer_args

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def empty_hf_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


def yaml_file(tmp_path, name, **changes):
    raw = {**yaml.safe_load((ROOT / "accelerate_configs" / f"{name}.yaml").read_text()), **changes}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def diagnosed(*argv, validate=False, **inputs):
    trainer, source = parse_trainer_args(list(argv)) if argv else (None, "trainer arguments")
    return diagnose(Inputs(trainer=trainer, trainer_source=source, **inputs), validate=validate)


def test_fp16_on_cpu_under_ddp_is_a_finding(tmp_path):
    config = yaml_file(tmp_path, "ddp", mixed_precision="fp16", use_cpu=True)
    findings, _ = diagnosed(accelerate_config=config)
    assert [(f.code, f.key) for f in findings] == [("fp16-cpu", "mixed_precision")]
    assert "plain fp32" in findings[0].problem and "--bf16" in findings[0].fix
    findings, _ = diagnosed("--fp16", "--use_cpu", accelerate_config=config)
    assert [f.code for f in findings] == ["fp16-cpu"]
    assert diagnosed("--bf16", "--use_cpu", accelerate_config=yaml_file(tmp_path, "ddp", use_cpu=True))[0] == []
    assert diagnosed("--fp16", accelerate_config=yaml_file(tmp_path, "ddp", mixed_precision="fp16"))[0] == []


def test_fsdp2_with_bf16_gets_a_notice_not_a_finding():
    findings, notes = diagnosed(accelerate_config=ROOT / "accelerate_configs" / "fsdp_full_shard.yaml")
    assert findings == [] and any("never wraps the forward in autocast" in n for n in notes)
    _, notes = diagnosed(accelerate_config=ROOT / "accelerate_configs" / "fsdp1_full_shard.yaml")
    assert not any("autocast" in n for n in notes)
