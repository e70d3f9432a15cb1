"""Encoder–decoder models (T5: relative positions; BART: learned positions, forced EOS) through
the same equivalence tests as causal LMs: greedy rows equal `generate(do_sample=False)` on each
row alone, sampling follows `generate(do_sample=True)`, and the job runs them from the CLI."""

import random
import shutil
from collections import Counter

import orjson
import pytest
import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM, BartConfig, GenerationConfig, T5Config

import batchspec.decoding.seq2seq as seq2seq
from batchspec.decoding import DecodeConfig, SamplingParams, decode_batch
from batchspec.models import load_pair
from batchspec.tiny import build_tokenizer, perturbed

from policies import Scripted
from test_job import lines, run_here
from test_sampling import ALPHA, NEW_TOKENS, PROMPT, SAMPLES, VOCAB, p_values

FAMILIES = ["t5", "bart"]
MAX_NEW = 40
LENGTHS = [1, 120, 2, 64, 3, 97, 5, 33, 8, 111, 13, 1, 21, 80, 45, 17]  # 16 rows, 1..120 tokens


def generate(model, prompt: list[int], max_new: int = MAX_NEW, **kwargs) -> list[int]:
    """The target alone: greedy, one unpadded row; the tokens after the decoder start token."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, **kwargs)
    return out[0, 1:].tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tiny_pair):
    pair = load_pair(*map(str, tiny_pair(request.param)), dtype="float32", device="cpu")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, len(pair.tokenizer)) for _ in range(n)] for n in LENGTHS]
    return pair, prompts, [generate(pair.target, p) for p in prompts]


def decode(pair, draft, prompts, gamma=3, forced=None, **kwargs):
    policy = Scripted([0, 2, 0, 0, 5, 1, 3], gamma_max=8) if gamma == "switching" else None
    config = DecodeConfig(max_new_tokens=MAX_NEW, eos_token_ids=pair.eos_token_ids,
                          gamma=gamma if isinstance(gamma, int) else None, **(forced or pair.forced_tokens), **kwargs)
    return decode_batch(pair.target, draft, prompts, list(range(len(prompts))), config, policy=policy)


@pytest.mark.parametrize("mode", ["ar", 3, 6, "auto", "switching", "ngram", "hybrid", "compact every step", "tree",
                                  "static asked"])
def test_greedy_equals_generate(case, mode):
    pair, prompts, expected = case
    draft = None if mode in ("ar", "ngram") else pair.draft
    extra = {"ngram": (1, 3)} if mode in ("ngram", "hybrid") else {"compact_at": 0.0} if mode == "compact every step" \
        else {"tree_width": 3} if mode == "tree" else {"static_cache": True} if mode == "static asked" else {}
    out = decode(pair, draft, prompts, mode if isinstance(mode, int) else 3 if mode in ("compact every step", "tree")
                 else mode, **extra)
    assert [r.token_ids for r in out.rows] == expected
    assert not out.stats["static_cache"]  # encoder–decoders keep today's cache, static asked or not
    if mode == "tree":  # T5's relative positions and BART's (forced EOS processed at each slot's depth) in trees
        assert all(r.stats["tree_steps"] == r.stats["model_steps"] > 0 for r in out.rows)
    if mode in (3, 6, "switching", "hybrid", "tree"):  # rejections: holes in the decoder caches
        rates = [r.stats["acceptance_rate"] for r in out.rows if r.stats["draft_tokens"]]
        assert 0 < sum(rates) / len(rates) < 1


def test_rows_without_their_own_positions_go_wrong(case, monkeypatch):
    """The check above can fail: with the library's slot positions (no per-row patch), holes and
    pads shift the decoder's positions and rows differ from generate."""
    pair, prompts, expected = case
    # the models' patches read positions the caches no longer set: the library's own apply
    monkeypatch.setattr(seq2seq, "row_positions", lambda model: seq2seq.RowPositions())
    out = decode(pair, pair.draft, prompts)
    assert sum(r.token_ids != e for r, e in zip(out.rows, expected)) >= 2


def test_forced_tokens_of_the_generation_config(tiny_pair):
    """BART forces EOS as the last token of a row that reaches its limit, and mBART-style configs
    force a first token (the target language): generate's ForcedEOS/ForcedBOS processors, in ar
    and spec, per row limits included."""
    pair = load_pair(*map(str, tiny_pair("bart")), dtype="float32", device="cpu")
    eos = pair.target.generation_config.forced_eos_token_id
    rng = random.Random(1)
    prompts = [[rng.randrange(3, len(pair.tokenizer)) for _ in range(n)] for n in (4, 30, 9, 17)]
    for forced in ({"forced_bos_token_id": None, "forced_eos_token_id": eos},
                   {"forced_bos_token_id": 77, "forced_eos_token_id": eos}):
        expected = [generate(pair.target, p, 12, **forced) for p in prompts]
        assert all(row[-1] == eos for row in expected if len(row) == 12)  # the limit's last token is EOS
        assert forced["forced_bos_token_id"] is None or all(row[0] == 77 for row in expected)
        for draft in (None, pair.draft):
            config = DecodeConfig(max_new_tokens=12, eos_token_ids=pair.eos_token_ids, gamma=3, **forced)
            out = decode_batch(pair.target, draft, prompts, list(range(len(prompts))), config)
            assert [r.token_ids for r in out.rows] == expected


OTHER_FAMILIES = {  # the rest of the supported families: T5's relative bias (UMT5: in every layer), or
    # learned (mBART, offset 2) or sinusoidal (Marian, Pegasus) position embeddings
    "mt5": {}, "umt5": {}, "marian": {}, "pegasus": {}, "mbart": {"decoder_start_token_id": None},  # mBART: BOS
}


def tiny_config(family: str, tokenizer, **extra):
    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
           "bos_token_id": tokenizer.pad_token_id, "decoder_start_token_id": tokenizer.pad_token_id}
    if family in seq2seq.T5_FAMILY:
        shape = {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "initializer_factor": 3.0,
                 "dropout_rate": 0.0}
    else:
        shape = {"d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
                 "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "init_std": 0.2,
                 "max_position_embeddings": 256, "dropout": 0.0, "attention_dropout": 0.0}
    return AutoConfig.for_model(family, vocab_size=len(tokenizer), tie_word_embeddings=False,
                                **shape, **{**ids, **extra})


@pytest.mark.parametrize("family", list(OTHER_FAMILIES))
def test_other_families_greedy_equal_generate(family, monkeypatch):
    """Spec (gamma 3, holes) and ar rows equal generate for each other supported family, and
    spec rows differ without the per-row positions."""
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    target = AutoModelForSeq2SeqLM.from_config(tiny_config(family, tokenizer, **OTHER_FAMILIES[family])).eval()
    draft = perturbed(target, noise=0.05, seed=1).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, len(tokenizer)) for _ in range(n)] for n in (1, 40, 7, 23, 2, 61)]
    expected = [generate(target, p, 24) for p in prompts]
    forced = {k: getattr(target.generation_config, k, None) for k in ("forced_bos_token_id", "forced_eos_token_id")}
    for draft_model in (None, draft):
        config = DecodeConfig(max_new_tokens=24, eos_token_ids=(tokenizer.eos_token_id,), gamma=3, **forced)
        out = decode_batch(target, draft_model, prompts, list(range(len(prompts))), config)
        assert [r.token_ids for r in out.rows] == expected
    rates = [r.stats["acceptance_rate"] for r in out.rows if r.stats["draft_tokens"]]
    assert 0 < sum(rates) / len(rates) < 1
    monkeypatch.setattr(seq2seq, "row_positions", lambda model: seq2seq.RowPositions())
    out = decode_batch(target, draft, prompts, list(range(len(prompts))), config)
    assert any(r.token_ids != e for r, e in zip(out.rows, expected))


def small_vocabulary_pair(family: str):
    """A target of VOCAB ids whose sampled tokens vary (T5; BART, which ends rows on EOS and
    forces it at the limit), and its noisy draft."""
    torch.manual_seed(0)
    if family == "t5":
        config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                          decoder_start_token_id=0, pad_token_id=0, eos_token_id=None, initializer_factor=0.3,
                          tie_word_embeddings=False, dropout_rate=0.0)
    else:
        config = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, init_std=0.1,
                            max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, pad_token_id=0,
                            bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2,
                            tie_word_embeddings=False)
    target = AutoModelForSeq2SeqLM.from_config(config).eval()
    return target, perturbed(target, noise=0.3, seed=1).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_matches_generate(family):
    """Two-sample test, per position and for the joint of the first two tokens, against generate
    (rows ended by EOS padded with 0, as generate pads them)."""
    target, draft = small_vocabulary_pair(family)
    torch.manual_seed(123)
    theirs = target.generate(torch.tensor([PROMPT] * SAMPLES), do_sample=True, temperature=1.0, top_k=None,
                             top_p=1.0, max_new_tokens=NEW_TOKENS)[:, 1:].tolist()
    eos = target.generation_config.eos_token_id
    config = DecodeConfig(max_new_tokens=NEW_TOKENS, sampling=SamplingParams(temperature=1.0), gamma=3,
                          eos_token_ids=() if eos is None else (eos,),
                          forced_eos_token_id=target.generation_config.forced_eos_token_id)
    out = decode_batch(target, draft, [PROMPT] * SAMPLES, list(range(SAMPLES)), config)
    rates = [r.stats["acceptance_rate"] for r in out.rows if r.stats["draft_tokens"]]
    assert 0.05 < sum(rates) / len(rates) < 0.9  # the residual path is exercised a lot
    ours = [r.token_ids + [0] * (NEW_TOKENS - len(r.token_ids)) for r in out.rows]
    p = p_values(ours, theirs)
    assert min(p.values()) > ALPHA, p


def test_a_seq2seq_pair_through_the_job(tiny_pair, tmp_path):
    """`batchspec run` detects the kind from the config: records equal generate on each row's
    prompt (tokenized with the tokenizer's special tokens, as users call generate); generation
    config settings it does not apply (beams, no-repeat n-grams) are named in a warning; a T5
    target with a causal draft is refused before the run."""
    shared, draft = tiny_pair("t5")
    target = tmp_path / "t5-beams"
    shutil.copytree(shared, target)
    config = GenerationConfig.from_pretrained(target)
    config.update(num_beams=4, no_repeat_ngram_size=3)
    config.save_pretrained(target)
    source = tmp_path / "in.jsonl"
    texts = ["the cat sat on a mat", "then it went home to read", "a small book about water in the old house"]
    source.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "prompt": t}) + b"\n" for i, t in enumerate(texts)))
    out = tmp_path / "out.jsonl"
    result = run_here(str(source), "--out", str(out), "--target", str(target), "--draft", str(draft), "--gamma", "3",
                      "--max-new-tokens", "16", "--token-ids", "--no-progress")
    assert result.exit_code == 0, result.output
    assert "warning: the target's generation config sets num_beams=4, no_repeat_ngram_size=3" in result.output
    pair = load_pair(str(target), dtype="float32", device="cpu")
    records = {r["id"]: r for r in map(orjson.loads, lines(out))}
    for i, text in enumerate(texts):
        expected = generate(pair.target, pair.tokenizer(text)["input_ids"], 16, num_beams=1, no_repeat_ngram_size=0)
        assert records[f"r{i}"]["token_ids"] == expected
        assert records[f"r{i}"]["completion"] == pair.tokenizer.decode(expected, skip_special_tokens=True)
    assert Counter(r["stats"]["prompt_tokens"] for r in records.values()) == Counter(
        len(pair.tokenizer(t)["input_ids"]) for t in texts)
    llama, _ = tiny_pair("llama")
    result = run_here(str(source), "--out", str(tmp_path / "mixed.jsonl"), "--target", str(target), "--draft",
                      str(llama), "--no-progress")
    assert result.exit_code == 2 and "the target is an encoder-decoder model and the draft a decoder-only" in \
        result.output
