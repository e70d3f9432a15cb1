"""Loading: folders and GGUF files, tokenizer compatibility, dtype and device choices."""

import time
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoModelForCausalLM, BertConfig, BertForMaskedLM, GenerationConfig, LlamaConfig, LlamaForSequenceClassification,
    M2M100Config, M2M100ForConditionalGeneration, MambaConfig, MptConfig, PreTrainedTokenizerFast,
)

from batchspec.defaults import default_target
from batchspec.models import (
    ModelError, check_same_tokenizer, gguf_folder, load_config, load_pair, resolve_device, resolve_dtype,
    unapplied_settings,
)
from batchspec.tiny import build_tokenizer
from test_job import run_here


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


NOT_DECODABLE = {  # checkpoints batchspec cannot decode exactly, or that are no language model
    "m2m100": lambda v: M2M100ForConditionalGeneration(M2M100Config(  # NLLB's family: positions not set per row
        vocab_size=v, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)),
    "bert": lambda v: BertForMaskedLM(BertConfig(vocab_size=v, hidden_size=32, num_hidden_layers=1,
                                                 num_attention_heads=4, intermediate_size=64)),
    "classifier": lambda v: LlamaForSequenceClassification(LlamaConfig(  # would get a fresh, random LM head
        vocab_size=v, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        pad_token_id=0)),
}


@pytest.fixture(scope="module")
def not_decodable(tmp_path_factory):
    """name -> folder of a tiny checkpoint batchspec refuses, with a tokenizer."""
    root, tokenizer = tmp_path_factory.mktemp("not-decodable"), build_tokenizer()
    for name, build in NOT_DECODABLE.items():
        build(len(tokenizer)).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


@pytest.mark.parametrize("name, message", [
    ("m2m100", r"'.+/m2m100' is an encoder-decoder model \(m2m_100\); batchspec decodes causal language models "
               r"and the encoder-decoder families t5, mt5, umt5, bart, mbart, marian, pegasus"),
    ("bert", r"'.+/bert' is a BertForMaskedLM, not a language model"),
    ("classifier", r"'.+/classifier' is a LlamaForSequenceClassification, not a language model"),
])
def test_models_batchspec_cannot_decode_are_refused(not_decodable, name, message):
    """Refused before any weight is read, as target and as draft, and by the dry run's config check."""
    with pytest.raises(ModelError, match=message):
        load_pair(str(not_decodable / name), dtype="float32", device="cpu")
    with pytest.raises(ModelError, match=message):
        load_config(str(not_decodable / name))


def test_a_refused_target_stops_the_run_before_it_starts(not_decodable, tiny_pair, tmp_path):
    """Exit 2, one line, no record written, as target and as draft; the output then takes a run
    with other models (a run that wrote nothing leaves no fingerprint to resume)."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": "a", "prompt": "the cat"}\n')
    target, _ = tiny_pair("llama")
    m2m100 = str(not_decodable / "m2m100")
    for models in (["--target", m2m100, "--mode", "ar"], ["--target", str(target), "--draft", m2m100]):
        for extra in ([], ["--dry-run"]):
            result = run_here(str(source), "--out", str(tmp_path / "out.jsonl"), *models, *extra, "--no-progress")
            assert result.exit_code == 2, result.output
            assert "is an encoder-decoder model (m2m_100)" in result.output and "Traceback" not in result.output
            assert not (tmp_path / "out.jsonl").exists() or not (tmp_path / "out.jsonl").read_bytes()
    result = run_here(str(source), "--out", str(tmp_path / "out.jsonl"), "--target", str(target), "--mode", "ar",
                      "--max-new-tokens", "2", "--no-progress")
    assert result.exit_code == 0, result.output


def test_an_mpt_target_runs_autoregressively_only(tmp_path):
    """MPT's ALiBi counts cache slots: speculation (with holes) is refused before decoding, ar runs."""
    tokenizer = build_tokenizer()
    config = MptConfig(vocab_size=len(tokenizer), d_model=32, n_heads=4, n_layers=1, max_seq_len=128)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "mpt")
    tokenizer.save_pretrained(tmp_path / "mpt")
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": "a", "prompt": "the cat"}\n')
    common = [str(source), "--target", str(tmp_path / "mpt"), "--max-new-tokens", "3", "--no-progress"]
    result = run_here(*common, "--out", str(tmp_path / "spec.jsonl"), "--draft", "ngram")
    assert result.exit_code == 2 and "is an MPT model, whose ALiBi counts cache slots" in result.output
    assert run_here(*common, "--out", str(tmp_path / "ar.jsonl"), "--mode", "ar").exit_code == 0


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
    assert again.eos_token_ids == (2,) and again.context_length() == 8192
    directory, name = gguf.rsplit("/", 1)
    reference = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    ids = torch.tensor([pair.tokenizer("The capital of France is")["input_ids"]])
    with torch.inference_mode():
        torch.testing.assert_close(again.target(ids).logits, reference(ids).logits)


def test_generation_config_settings_not_applied_are_named():
    """Every setting of a generation config that changes generate()'s tokens and batchspec does
    not apply is named (the run warns with them); neutral values and the defaults are not."""
    config = GenerationConfig(min_new_tokens=10, exponential_decay_length_penalty=(4, 1.5), typical_p=0.9,
                              encoder_repetition_penalty=1.0, stop_strings=["\n\n"])
    assert unapplied_settings(SimpleNamespace(generation_config=config)) == [
        "min_new_tokens=10", "exponential_decay_length_penalty=(4, 1.5)", "typical_p=0.9", "stop_strings=['\\n\\n']"]
    assert unapplied_settings(SimpleNamespace(generation_config=GenerationConfig())) == []
