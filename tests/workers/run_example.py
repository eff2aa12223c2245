"""Run an example loop (examples/<name>.py, its `main(argv)`), then write what this rank holds, counted independently
(train_tiny's count through each library's own accessors), and what the loop fed, to `facts_rank{R}.json`."""
import importlib
import json
import sys
from pathlib import Path

import torch

from shardscope.recipes.training import end_of_run

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from train_tiny import local_param_bytes, optimizer_state_bytes  # noqa: E402  (same folder)


def write_facts(result, output_dir: Path):
    model = getattr(result.model, "module", result.model)
    facts = {"params_bytes": local_param_bytes(model), "optimizer_bytes": optimizer_state_bytes(result.optimizer, model),
             "tokens_fed": result.tokens_fed, "samples_fed": result.samples_fed}
    if getattr(result, "reference", None) is not None:
        facts["reference_bytes"] = local_param_bytes(result.reference)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    (output_dir / f"facts_rank{rank}.json").write_text(json.dumps(facts))


def main():
    name, argv = sys.argv[1], sys.argv[2:]
    write_facts(importlib.import_module(name).main(argv), Path(argv[argv.index("--output_dir") + 1]))
    end_of_run()


if __name__ == "__main__":
    main()
