"""jobs/make_draft.py's slice of the target, and the embedded draft it made."""

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchspec.defaults import DRAFT_FOLDER

ROOT = Path(__file__).resolve().parents[1]


def make_draft():
    spec = importlib.util.spec_from_file_location("make_draft", ROOT / "jobs" / "make_draft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_slice_of_every_layer_and_id_is_the_target(tiny_pair, family):
    target = AutoModelForCausalLM.from_pretrained(tiny_pair(family)[0]).eval()
    vocab, layers = target.config.vocab_size, target.config.num_hidden_layers
    ids = torch.randint(0, vocab, (2, 12))
    draft_from_target = make_draft().draft_from_target
    whole = draft_from_target(target, vocab, list(range(layers))).eval()
    torch.testing.assert_close(whole(ids).logits, target(ids).logits)
    part = draft_from_target(target, vocab // 2, [layers - 1]).eval()
    assert part.config.vocab_size == vocab // 2 and len(part.model.layers) == 1
    torch.testing.assert_close(part.lm_head.weight, target.lm_head.weight[: vocab // 2])
    torch.testing.assert_close(part.model.layers[0].mlp.up_proj.weight, target.model.layers[-1].mlp.up_proj.weight)


def test_embedded_draft_fits_in_the_repository():
    assert sum(f.stat().st_size for f in DRAFT_FOLDER.iterdir()) <= 25e6
