"""Offline test session: tiny models built here, saved and loaded back the way users load theirs."""

import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["BATCHSPEC_CACHE"] = tempfile.mkdtemp(prefix="batchspec-cache-")  # GGUF conversions: once a session

import pytest  # noqa: E402
import torch  # noqa: E402

from batchspec.tiny import build_pair  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """family -> (target folder, draft folder): the draft is the target plus weight noise."""
    root = tmp_path_factory.mktemp("tiny")
    built = {}

    def get(family: str, **kwargs):
        key = (family, tuple(sorted(kwargs.items())))
        if key not in built:
            built[key] = build_pair(root / f"{family}-{len(built)}", family, **{"noise": 0.03, **kwargs})
        return built[key]

    return get
