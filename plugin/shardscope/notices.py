"""Library notices kept out of shardscope's own output (the command line's and the tiny-model helper's)."""
from __future__ import annotations

import logging


def quiet_library_notices() -> None:
    """Keep the tool's output its own: DeepSpeed announces on stdout, at import, that it fell back to the
    CPU accelerator; the commands only read its configs (training runs launched by `compare` keep it)."""
    logging.getLogger("DeepSpeed").addFilter(
        lambda record: "Setting accelerator to CPU" not in record.getMessage())
