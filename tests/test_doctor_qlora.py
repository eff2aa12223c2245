"""doctor's QLoRA rules (doctor/qlora.py), in process: each rule's failing fixture and a passing one, through the SFT
recipe's own arguments as `shardscope doctor -- recipes/causal_lm_sft.py ARGS` reads them."""
from pathlib import Path

import pytest

from shardscope.cli import main
from shardscope.doctor.diagnose import Inputs, diagnose, parse_trainer_args

ROOT = Path(__file__).resolve().parents[1]
SFT = str(ROOT / "recipes" / "causal_lm_sft.py")
QLORA = ("--use_lora", "--load_in_4bit", "--dtype", "bfloat16", "--bnb_4bit_quant_storage", "bfloat16")


@pytest.fixture(autouse=True)
def empty_hf_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


def codes(*argv, config=None):
    trainer, source = parse_trainer_args([SFT, *argv])
    accelerate = ROOT / "accelerate_configs" / f"{config}.yaml" if config else None
    findings, _ = diagnose(Inputs(trainer=trainer, trainer_source=source, accelerate_config=accelerate),
                           validate=False, environment=False)
    return sorted(f.code for f in findings if f.code.startswith("qlora"))


def test_a_quantised_base_without_lora_trains_nothing():
    assert codes("--load_in_4bit") == ["qlora-frozen"]
    assert codes(*QLORA) == []


@pytest.mark.parametrize("config", ["fsdp_qlora", "fsdp_full_shard", "zero3"])
def test_fsdp_and_zero3_need_the_quant_storage_of_the_other_parameters(config):
    assert codes("--use_lora", "--load_in_4bit", "--dtype", "bfloat16", config=config) == ["qlora-quant-storage"]
    assert codes(*QLORA, config=config) == []
    assert codes(*QLORA, config="ddp") == codes("--use_lora", "--load_in_4bit", config="ddp") == []  # whole weights


def test_strategies_that_cannot_shard_a_quantised_base():
    assert codes("--use_lora", "--load_in_8bit", config="fsdp_qlora") == ["qlora-strategy"]
    assert codes("--use_lora", "--load_in_8bit", config="ddp") == []
    assert codes(*QLORA, config="tp") == ["qlora-strategy"]


def test_the_shipped_qlora_yaml_is_what_the_planner_calls_fsdp_full_shard(capsys):
    assert main(["doctor", "--accelerate-config", str(ROOT / "accelerate_configs/fsdp_qlora.yaml"), "--", SFT,
                 *QLORA, "--bf16"]) == 0
    assert "no problems found" in capsys.readouterr().out
