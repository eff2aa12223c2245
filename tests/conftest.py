import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama saved with save_pretrained; runs load it back with from_pretrained."""
    from shardscope.tiny import make_causal_lm

    path = tmp_path_factory.mktemp("tiny_llama")
    make_causal_lm(path, "llama")
    return path
