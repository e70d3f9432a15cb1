"""Structured outputs under speculation: rows with different grammars (JSON schemas, a regex,
choices, a Lark grammar, none) in one batch, greedy output identical to transformers' generate
with the grammar engine's mask as a logits processor, row by row, in every drafting mode;
sampling under a grammar passes the two-sample test, which fails when the verify positions are
masked blind to the proposals before them."""

import json
import random
import re

import jsonschema
import orjson
import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion
from tokenizers import Tokenizer, decoders, models as token_models
from transformers import (ForcedBOSTokenLogitsProcessor, ForcedEOSTokenLogitsProcessor, LogitsProcessor,
                          LogitsProcessorList, PreTrainedTokenizerFast)

from batchspec.decoding import DecodeConfig, RowOptions, SamplingParams, decode_batch
from batchspec.decoding.grammar import Grammar, GrammarRows, engine_tokenizer, matcher, unpack
from batchspec.decoding.suffix_index import SuffixIndex
from batchspec.models import load_pair
from batchspec.request_body import structured_output

from test_job import run_here, tiny_run_options
from test_sampling import ALPHA, NEW_TOKENS, PROMPT, SAMPLES, models, p_values  # noqa: F401 (models: a fixture)

MAX_NEW = 48
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 2}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
FLAG = {"type": "object", "properties": {"kind": {"enum": ["x", "y"]}, "n": {"type": "integer", "maximum": 99}},
        "required": ["kind", "n"], "additionalProperties": False}
CHOICES = ["yes", "no", "maybe so"]
REGEX = r"[0-9]{3}-[a-z]{2,6}"
LARK = 'start: "(" item ("," item)* ")"\nitem: /[a-z]{1,4}/'
GRAMMARS = [Grammar.json_schema(PERSON), Grammar("regex", REGEX), Grammar.json_schema(FLAG), None,
            Grammar.choice(CHOICES), Grammar.json_schema(PERSON), Grammar("grammar", LARK), Grammar.json_schema(FLAG)]
LENGTHS = [5, 40, 1, 17, 9, 60, 3, 25]
MODES = {  # name -> (with the draft model, DecodeConfig settings)
    "ar": (False, {}), "model": (True, dict(gamma=3)), "auto": (True, dict(gamma=None)),
    "ngram": (False, dict(gamma=4, ngram=(1, 3))), "hybrid": (True, dict(gamma=None, ngram=(1, 3))),
    "suffix": (False, dict(gamma=4, ngram=(1, 3))),  # a fresh suffix index per batch (run)
    "no jump": (True, dict(gamma=3, jump_forward=False)),
}


class GrammarMask(LogitsProcessor):
    """The reference: generate's loop with the grammar engine's mask, one matcher per row."""

    def __init__(self, grammars: list[Grammar], tokenizer, vocab: int, eos_ids, prompt_length: int,
                 skip_first: bool = False):
        """skip_first: the first output token is forced (a forced BOS), not read by the grammar."""
        engine = engine_tokenizer(tokenizer, vocab, tuple(eos_ids))
        self.matchers = [matcher(g, engine).deep_copy() for g in grammars]
        self.vocab, self.prompt_length, self.skip_first = vocab, prompt_length, skip_first
        self.words = (max(vocab, len(tokenizer)) + 31) // 32

    def __call__(self, input_ids, scores):
        bits = torch.full((len(self.matchers), self.words), -1, dtype=torch.int32)
        new = input_ids.shape[1] - self.prompt_length
        for b, m in enumerate(self.matchers):
            if new > int(self.skip_first):
                m.consume_token(int(input_ids[b, -1]))
            m.unsafe_compute_mask_ptr(bits[b].data_ptr(), self.words * 4)
        return scores.masked_fill(~unpack(bits, self.vocab), float("-inf"))


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return load_pair(*map(str, tiny_pair("llama")), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def prompts(pair):
    rng = random.Random(2)
    return [[rng.randrange(3, len(pair.tokenizer)) for _ in range(n)] for n in LENGTHS]


def generate(pair, prompt: list[int], grammar: Grammar | None) -> list[int]:
    """The target alone on one row, masked by the grammar's reference processor."""
    ids = torch.tensor([prompt])
    vocab = pair.target.get_output_embeddings().weight.shape[0]
    masks = LogitsProcessorList([GrammarMask([grammar], pair.tokenizer, vocab, pair.eos_token_ids, len(prompt))]
                                if grammar else [])
    out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                               eos_token_id=list(pair.eos_token_ids), pad_token_id=0, logits_processor=masks)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def expected(pair, prompts):
    return [generate(pair, p, g) for p, g in zip(prompts, GRAMMARS)]


def run(pair, prompts, grammars, mode: str, **options):
    drafts, settings = MODES[mode]
    settings = settings | ({"suffix": SuffixIndex()} if mode == "suffix" else {})
    config = DecodeConfig(max_new_tokens=MAX_NEW, eos_token_ids=pair.eos_token_ids, **settings)
    return decode_batch(pair.target, pair.draft if drafts else None, prompts, list(range(len(prompts))), config,
                        [RowOptions(grammar=g, **options) for g in grammars], tokenizer=pair.tokenizer).rows


def holds(grammar: Grammar, text: str) -> bool:
    """The text is what the grammar describes (the test's own check, not the engine's)."""
    if grammar.kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), json.loads(grammar.text))
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if grammar.kind == "choice":
        return text in json.loads(grammar.text)
    if grammar.kind == "regex":
        return re.fullmatch(grammar.text, text) is not None
    return re.fullmatch(r"\([a-z]{1,4}(,[a-z]{1,4})*\)", text) is not None


@pytest.mark.parametrize("mode", list(MODES))
def test_grammar_rows_equal_generate_with_the_mask(pair, prompts, expected, mode):
    out = run(pair, prompts, GRAMMARS, mode)
    assert [r.token_ids for r in out] == expected
    done = [b for b, r in enumerate(out) if GRAMMARS[b] and r.finish_reason == "stop"]
    assert len(done) >= 4
    for b in done:
        text = pair.tokenizer.decode(out[b].token_ids, skip_special_tokens=True)
        assert holds(GRAMMARS[b], text), (b, text)
    if mode != "ar":
        assert sum(r.stats["draft_tokens"] - r.stats["accepted_tokens"] for r in out) > 0  # rejections happen
        jumps = sum(r.stats["jump_steps"] for r in out)
        assert jumps == 0 if mode == "no jump" else jumps > 0


@pytest.mark.parametrize("mode", ["ar", "model"])
def test_a_row_whose_grammar_fails_ends_with_an_error(pair, prompts, expected, mode, monkeypatch):
    """A row whose matcher enters its error state (forced here: after its third step it consumes
    a token its grammar refuses) ends there with an error naming the grammar's kind and the
    engine's message, not as a normal "stop"; its batch mates decode on as before."""
    advance, steps = GrammarRows.advance, []

    def failing(self, blocks):
        steps.append(len(self.matchers))
        if len(steps) == 3:  # the JSON schema row, first in the batch
            m = self.matchers[0]
            m.consume_tokens([next(t for t in range(self.vocab) if m.validate_tokens([t]) == 0)])
        return advance(self, blocks)

    monkeypatch.setattr(GrammarRows, "advance", failing)
    out = run(pair, prompts, GRAMMARS, mode)
    failed = out[0]
    assert failed.finish_reason == "error" and failed.error.startswith("the json schema could not be enforced: ")
    assert len(failed.error) > len("the json schema could not be enforced: ")
    assert failed.token_ids == expected[0][: len(failed.token_ids)] and len(failed.token_ids) < len(expected[0])
    assert [r.token_ids for r in out[1:]] == expected[1:] and all(r.error is None for r in out[1:])


@pytest.mark.parametrize("family, forced_bos", [("t5", None), ("bart", 77)])
def test_encoder_decoder_rows_under_a_grammar(tiny_pair, family, forced_bos):
    """The decoder's output under each row's grammar equals generate's with the mask, then the
    forced tokens of the generation config (BART: a forced BOS the grammar does not read, EOS
    forced at the limit), in every mode."""
    pair = load_pair(*map(str, tiny_pair(family)), dtype="float32", device="cpu")
    vocab = pair.target.get_output_embeddings().weight.shape[0]
    forced_eos = pair.target.generation_config.forced_eos_token_id
    rng = random.Random(3)
    prompts = [[rng.randrange(3, len(pair.tokenizer)) for _ in range(n)] for n in (6, 30, 1, 14)]
    grammars = GRAMMARS[:4]
    expected = []
    for prompt, grammar in zip(prompts, grammars):
        masks = [GrammarMask([grammar], pair.tokenizer, vocab, pair.eos_token_ids, 1, forced_bos is not None)
                 if grammar else None]
        masks += [ForcedBOSTokenLogitsProcessor(forced_bos)] if forced_bos is not None else []
        masks += [ForcedEOSTokenLogitsProcessor(1 + MAX_NEW, forced_eos)] if forced_eos is not None else []
        ids = torch.tensor([prompt])
        out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                                   forced_bos_token_id=None, forced_eos_token_id=None,
                                   logits_processor=LogitsProcessorList([m for m in masks if m is not None]))
        expected.append(out[0, 1:].tolist())
    assert forced_bos is None or all(row[0] == forced_bos for row in expected)
    for mode in ("ar", "model", "auto"):
        drafts, settings = MODES[mode]
        config = DecodeConfig(max_new_tokens=MAX_NEW, eos_token_ids=pair.eos_token_ids, forced_bos_token_id=forced_bos,
                              forced_eos_token_id=forced_eos, **settings)
        out = decode_batch(pair.target, pair.draft if drafts else None, prompts, list(range(4)), config,
                           [RowOptions(grammar=g) for g in grammars], tokenizer=pair.tokenizer).rows
        assert [r.token_ids for r in out] == expected, mode
    assert sum(r.finish_reason == "stop" for r in out) >= 2


def test_the_masks_change_the_output(pair, prompts, expected):
    """Without its grammar a row writes no JSON: the equality above is not the plain output's."""
    free = [generate(pair, p, None) for p in prompts[:3]]
    assert all(f != e for f, e in zip(free, expected[:3]))
    assert not pair.tokenizer.decode(free[0]).startswith("{")


SAMPLED = Grammar("regex", "(ab|c[de]|f)[a-h]{5,}")  # no end within NEW_TOKENS: EOS never allowed


@pytest.fixture(scope="module")
def letters():
    """A tokenizer of the sampling model's 12 ids: "a".."k" and an EOS."""
    tokens = Tokenizer(token_models.BPE(vocab={c: i for i, c in enumerate("abcdefghijk")} | {"<eos>": 11}, merges=[]))
    tokens.add_special_tokens(["<eos>"])
    tokens.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokens, eos_token="<eos>")


@pytest.fixture(scope="module")
def grammar_target_samples(models, letters):
    target, _ = models
    torch.manual_seed(7)
    ids = torch.tensor([PROMPT] * SAMPLES)
    masks = LogitsProcessorList([GrammarMask([SAMPLED] * SAMPLES, letters, 12, (), len(PROMPT))])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=None,
                          max_new_tokens=NEW_TOKENS, pad_token_id=0, logits_processor=masks)
    return out[:, len(PROMPT) :].tolist()


def grammar_samples(models, letters, drafter: str) -> list[list[int]]:
    target, draft = models
    config = DecodeConfig(max_new_tokens=NEW_TOKENS, sampling=SamplingParams(temperature=1.0), gamma=3,
                          ngram=(1, 3) if drafter == "ngram" else None)
    out = decode_batch(target, draft if drafter == "model" else None, [PROMPT] * SAMPLES, list(range(SAMPLES)),
                       config, [RowOptions(grammar=SAMPLED)] * SAMPLES, tokenizer=letters)
    assert sum(r.stats["draft_tokens"] - r.stats["accepted_tokens"] for r in out.rows) > SAMPLES / 10
    assert drafter == "model" or sum(r.stats["jump_steps"] for r in out.rows) > SAMPLES / 10
    return [r.token_ids for r in out.rows]


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_sampling_under_a_grammar_matches_generate(models, letters, grammar_target_samples, drafter):
    """model: the draft's q masked position by position; ngram: jump-forward and lookups, one-hot q."""
    ours = grammar_samples(models, letters, drafter)
    assert all(re.fullmatch(r"(ab|c[de]|f)[a-h]*", letters.decode(row)) for row in ours)
    p = p_values(ours, grammar_target_samples)
    assert min(p.values()) > ALPHA, p


def test_masks_blind_to_the_proposals_are_caught(models, letters, grammar_target_samples, monkeypatch):
    """Masking every verify position (and each draft position) by the grammar's state at the
    step's start samples another distribution: the same test fails."""
    allowed = GrammarRows.allowed
    monkeypatch.setattr(GrammarRows, "allowed",
                        lambda self, proposals, first, J: allowed(self, proposals, 0, 1).expand(-1, J, -1))
    p = p_values(grammar_samples(models, letters, "model"), grammar_target_samples)
    assert min(p.values()) < ALPHA, p


def request(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> bytes:
    body = {"model": "m", "max_tokens": MAX_NEW} | body
    if url.endswith("chat/completions"):
        body.setdefault("messages", [{"role": "user", "content": f"Tell me about {custom_id}"}])
    else:
        body.setdefault("prompt", f"A record about {custom_id}:")
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + b"\n"


STRUCTURED = {  # custom_id -> body keys (the grammar each row's text must match)
    "schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
    "object": {"response_format": {"type": "json_object"}},
    "regex": {"guided_regex": REGEX},
    "choice": {"guided_choice": CHOICES, "n": 2},
    "vllm": {"structured_outputs": {"json": FLAG}},
    "lark": {"guided_grammar": LARK},
    "text": {"response_format": {"type": "text"}},
}
REFUSED = {  # custom_id -> (body keys, what the error message names)
    "bad type": ({"guided_json": {"type": "wat"}}, "Invalid type: wat"),
    "unique": ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "array", "uniqueItems": True}}}}, "uniqueItems"),
    "no schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    "two": ({"guided_regex": "a+", "guided_choice": ["a"]}, "give one structured output"),
    "min tokens": ({"guided_regex": "a+", "min_tokens": 3}, "min_tokens cannot be combined"),
    "bad regex": ({"guided_regex": "a("}, "unclosed group"),
    "tag": ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    "yaml": ({"response_format": {"type": "yaml"}}, "response_format must be an object whose 'type'"),
}


def test_structured_requests_through_the_job(tiny_pair, tmp_path):
    """OpenAI-batch requests, each with its own structured output, in shared batches: every
    finished output holds its grammar (and parses with the openai client's types), a row that
    hits max_tokens first ends with "length", and every malformed one is an error record."""
    source = tmp_path / "requests.jsonl"
    lines = [request(i, body) for i, body in STRUCTURED.items()]
    lines += [request("short", {"response_format": {"type": "json_object"}, "max_tokens": 3})]
    lines += [request("completion", {"guided_regex": REGEX}, url="/v1/completions")]
    lines += [request(i, body) for i, (body, _) in REFUSED.items()]
    source.write_bytes(b"".join(lines))
    out = tmp_path / "out.jsonl"
    result = run_here(str(source), "--out", str(out), *tiny_run_options(tiny_pair), "--output-format", "openai",
                      "--max-new-tokens", str(MAX_NEW))
    assert result.exit_code == 3, result.output
    errors = {e["id"]: e["error"] for e in map(orjson.loads, (tmp_path / "out.errors.jsonl").read_bytes().splitlines())}
    assert {i: e["type"] for i, e in errors.items()} == dict.fromkeys(REFUSED, "invalid_request")
    for i, (_, message) in REFUSED.items():
        assert message in errors[i]["message"], (i, errors[i])
    bodies = {r["custom_id"]: r["response"]["body"] for r in map(orjson.loads, out.read_bytes().splitlines())}
    for body in bodies.values():
        (ChatCompletion if body["object"] == "chat.completion" else Completion).model_validate(body)
    grammars = {i: structured_output(b) for i, b in STRUCTURED.items()} | {"completion": Grammar("regex", REGEX)}
    finished = 0
    for i, grammar in grammars.items():
        for choice in bodies[i]["choices"]:
            text = choice.get("text", choice.get("message", {}).get("content"))
            if grammar is None:
                assert not text.startswith("{")
            elif choice["finish_reason"] == "stop":
                finished += 1
                assert holds(grammar, text), (i, text)
    assert finished >= 5 and len(bodies["choice"]["choices"]) == 2
    short = bodies["short"]["choices"][0]
    assert short["finish_reason"] == "length" and short["message"]["content"].startswith("{")


def test_run_wide_grammars_from_the_command_line(tiny_pair, tmp_path):
    """--json-schema, --regex, --choice and --grammar apply to every row; bad ones stop the run
    before it starts (exit 2), as do two at once and --min-new-tokens beside one."""
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"id": i, "prompt": p}) + b"\n"
                                for i, p in enumerate(["the hot water", "a man said", "one"])))
    schema, lark, bad = tmp_path / "schema.json", tmp_path / "g.lark", tmp_path / "bad.json"
    schema.write_text(json.dumps(FLAG))
    lark.write_text(LARK)
    bad.write_text('{"type": "object", "not": {}}')
    options = [*tiny_run_options(tiny_pair), "--max-new-tokens", str(MAX_NEW)]
    for k, (args, grammar) in enumerate([(["--json-schema", str(schema)], Grammar.json_schema(FLAG)),
                                         (["--regex", REGEX], Grammar("regex", REGEX)),
                                         (["--choice", ",".join(CHOICES)], Grammar.choice(CHOICES)),
                                         (["--grammar", str(lark)], Grammar("grammar", LARK))]):
        out = tmp_path / f"out{k}.jsonl"
        result = run_here(str(source), "--out", str(out), *options, *args)
        assert result.exit_code == 0, result.output
        records = list(map(orjson.loads, out.read_bytes().splitlines()))
        assert len(records) == 3
        assert all(holds(grammar, r["completion"]) for r in records if r["finish_reason"] == "stop")
        assert sum(r["finish_reason"] == "stop" for r in records) >= 2
    for args, message in [(["--json-schema", str(bad)], "Unimplemented keys"),
                          (["--regex", "a(", "--choice", "a,b"], "give one of --regex, --choice"),
                          (["--choice", "a,b", "--min-new-tokens", "2"], "--min-new-tokens cannot be combined")]:
        result = run_here(str(source), "--out", str(tmp_path / "refused.jsonl"), *options, *args)
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
