"""Loading: folders and GGUF files, tokenizer compatibility, dtype and device choices."""

import time

import pytest
import torch
from transformers import AutoModelForCausalLM, MambaConfig, PreTrainedTokenizerFast

from batchspec.defaults import default_target
from batchspec.models import (
    ModelError, check_same_tokenizer, gguf_folder, load_pair, resolve_device, resolve_dtype,
)
from batchspec.tiny import build_tokenizer


def test_pair_with_a_different_tokenizer_is_refused_naming_the_id(tiny_pair, tmp_path):
    target, draft = tiny_pair("llama")
    build_tokenizer(seed=1).save_pretrained(tmp_path / "draft")  # trained on other text: other merges
    AutoModelForCausalLM.from_pretrained(draft).save_pretrained(tmp_path / "draft")
    with pytest.raises(ModelError, match=r"id \d+ is '.+' for the target and '.+' for the draft"):
        load_pair(str(target), str(tmp_path / "draft"), dtype="float32", device="cpu")
    check_same_tokenizer(build_tokenizer(), PreTrainedTokenizerFast.from_pretrained(target))  # same: no error


def test_unknown_model_is_a_model_error():
    with pytest.raises(ModelError, match="cannot load"):
        load_pair("/no/such/model/folder", dtype="float32", device="cpu")
    with pytest.raises(ModelError, match="GGUF file not found"):
        load_pair("/no/such/model.gguf", dtype="float32", device="cpu")


def test_recurrent_model_is_refused(tmp_path):
    """A Mamba-style model's state cannot be cut back to the accepted tokens: a clear ModelError."""
    tokenizer = build_tokenizer()
    config = MambaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, state_size=4)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "mamba")
    tokenizer.save_pretrained(tmp_path / "mamba")
    with pytest.raises(ModelError, match="MambaForCausalLM, whose recurrent state cannot be rolled back"):
        load_pair(str(tmp_path / "mamba"), dtype="float32", device="cpu")


def test_other_layer_types_are_refused(tiny_pair, tmp_path):
    """Layers other than full or sliding-window attention (here chunked) are not masked by position."""
    target, _ = tiny_pair("llama")
    model = AutoModelForCausalLM.from_pretrained(target)
    model.config.layer_types = ["full_attention", "chunked_attention"]
    model.save_pretrained(tmp_path / "chunked")
    build_tokenizer().save_pretrained(tmp_path / "chunked")
    with pytest.raises(ModelError, match="has chunked_attention layers; batchspec supports full and sliding"):
        load_pair(str(tmp_path / "chunked"), dtype="float32", device="cpu")


def test_dtype_and_device_choices():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    with pytest.raises(ModelError):
        resolve_dtype("float8", cpu)
    assert resolve_device("cpu") == cpu
    if not torch.cuda.is_available():
        assert resolve_device("auto") == cpu
        with pytest.raises(ModelError, match="no CUDA"):
            resolve_device("cuda")


def test_gguf_is_converted_once_and_matches_transformers_own_gguf_load():
    """The default target ships as GGUF: the first load converts it to a cached safetensors
    folder, later loads read the cache, and the model computes what transformers' GGUF loader gives."""
    gguf = default_target()
    pair = load_pair(gguf, dtype="float32", device="cpu")
    assert (gguf_folder(gguf) / "model.safetensors").is_file()
    start = time.monotonic()
    again = load_pair(gguf, dtype="float32", device="cpu")
    assert time.monotonic() - start < 30  # the conversion is not redone
    assert again.eos_token_ids == (2,) and again.context_length == 8192
    directory, name = gguf.rsplit("/", 1)
    reference = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    ids = torch.tensor([pair.tokenizer("The capital of France is")["input_ids"]])
    with torch.inference_mode():
        torch.testing.assert_close(again.target(ids).logits, reference(ids).logits)
