"""Structured outputs: a grammar per row (a JSON schema, a regex, a list of choices, a Lark or
GBNF grammar), enforced by masking the logits to the tokens the row's grammar allows next.

The grammar engine is llguidance: it compiles a schema in about a millisecond, refuses the
schema keywords it cannot enforce (uniqueItems, if/then, not, contains, ...) instead of ignoring
them, computes a row's mask in tens of microseconds and rolls back. JSON is compact (no free
whitespace): small models otherwise loop on spaces and newlines inside an object.

Under speculation the target scores [last, d_1..d_G] at once; position j must be masked as if
d_1..d_j had been emitted. So each row's matcher is advanced through its proposals, computing
the mask at every position on the way, then rolled back; after the check it consumes the tokens
the row kept. A proposal the grammar refuses is never consumed (a refused token would leave the
matcher in its error state): the target's masked p gives it no mass, so it is rejected there and
the positions after it are never used. The draft's q is masked the same way, position by
position, so p and q are the grammar-constrained distributions of the papers' acceptance test.
"""

import functools
import json
import time
from dataclasses import dataclass

import llguidance
import llguidance.hf
import torch
from llguidance import LLMatcher

JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: "," and ":" without spaces, no newlines
KINDS = ("json_schema", "regex", "choice", "grammar")


class GrammarError(ValueError):
    """A schema, regex or grammar the engine cannot compile or enforce."""


@dataclass(frozen=True)
class Grammar:
    """A row's constraint: its kind (json_schema, regex, choice, grammar) and its text (a JSON
    schema, or the list of choices, as JSON in the order given; a regex; a Lark or GBNF grammar).
    Built only if the engine can compile it (GrammarError otherwise)."""

    kind: str
    text: str

    def __post_init__(self):
        problem = grammar_problem(self, None)
        if problem:
            raise GrammarError(problem)

    @classmethod
    def json_schema(cls, schema) -> "Grammar":
        """schema: a JSON schema, as an object or its JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema must be an object")
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))

    @classmethod
    def choice(cls, options) -> "Grammar":
        if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
            raise GrammarError("choices must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(options, ensure_ascii=False))

    @functools.cached_property
    def compiled(self) -> str:
        """llguidance's grammar definition."""
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.text, defaults=JSON_OPTIONS)
        return llguidance.grammar_from(self.kind, self.text)


@functools.lru_cache(maxsize=1024)
def grammar_problem(grammar: Grammar, tokenizer) -> str | None:
    """What the engine cannot compile or enforce in a grammar (with the tokenizer: also tokens
    it names that the tokenizer does not have, and what fails its first mask, e.g. a schema that
    refers to itself whole), or None. Cached: a million rows may share one."""
    if grammar.kind not in KINDS:
        return f"unknown grammar kind {grammar.kind!r}"
    try:
        problem = LLMatcher.validate_grammar(grammar.compiled, tokenizer and engine_tokenizer(tokenizer))
        if not problem and tokenizer is not None:
            problem = first_mask_problem(grammar, engine_tokenizer(tokenizer))
    except (ValueError, GrammarError) as e:
        problem = str(e)
    return f"invalid {grammar.kind.replace('_', ' ')}: {problem.strip()}" if problem else None


def first_mask_problem(grammar: Grammar, tokenizer: llguidance.LLTokenizer) -> str | None:
    """The engine's error (first line) when it cannot compute the grammar's first mask."""
    start = LLMatcher(tokenizer, grammar.compiled, log_level=0)
    start.compute_bitmask()
    return f"the engine cannot start it ({start.get_error().strip().splitlines()[0]})" if start.is_error() else None


@functools.lru_cache(maxsize=4)
def engine_tokenizer(tokenizer, vocab: int = 0, eos_ids: tuple[int, ...] = ()) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face tokenizer (built once: it reads the whole vocabulary),
    with masks `vocab` wide (at least the tokenizer's size) and the ids that end a row."""
    eos = list(eos_ids) or tokenizer.eos_token_id
    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(vocab, len(tokenizer)), eos_token=eos)
    except Exception as e:  # llguidance reads fast (Rust) tokenizers with a known decoder
        raise GrammarError(f"the grammar engine cannot read this tokenizer: {e}") from None


@functools.lru_cache(maxsize=256)
def matcher(grammar: Grammar, tokenizer: llguidance.LLTokenizer) -> LLMatcher:
    """A compiled matcher at its start, cached by grammar: rows take deep copies."""
    return LLMatcher(tokenizer, grammar.compiled, log_level=0)


def unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..., W] int32 bitmasks (bit i of word w: token 32w + i) -> [..., vocab] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits[..., None] >> shifts) & 1).flatten(-2)[..., :vocab].bool()


class GrammarRows:
    """The batch's rows' grammar states; a row without a grammar allows every token.

    grammars: per row, its Grammar or None; tokenizer: the target's; vocab: the target's logit
    width; eos_ids: the ids that end a row (allowed once the grammar is complete); skip_first:
    the first output token is forced by the model's generation config, not part of the text
    the grammar reads."""

    def __init__(self, grammars: list[Grammar | None], tokenizer, vocab: int, eos_ids: tuple[int, ...],
                 device: torch.device, skip_first: bool = False):
        engine = engine_tokenizer(tokenizer, vocab, tuple(eos_ids))
        self.matchers = [matcher(g, engine).deep_copy() if g is not None else None for g in grammars]
        self.kinds = [g.kind.replace("_", " ") if g is not None else None for g in grammars]
        self.vocab, self.words, self.device = vocab, (max(vocab, len(tokenizer)) + 31) // 32, device
        self.eos, self.eos_ids = engine.eos_token, set(engine.eos_tokens)
        self.skip = [skip_first] * len(grammars)
        self.seconds = 0.0  # host time spent computing masks

    @property
    def active(self) -> bool:
        return any(m is not None for m in self.matchers)

    def allowed(self, proposals: list[list[int]], first: int, J: int) -> torch.Tensor:
        """[B, J, V] bool on the device: at position j, what row b's grammar allows after its
        proposals[b][:first + j] (everything past a proposal the grammar refuses, or past an EOS,
        is never used: all allowed)."""
        started = time.perf_counter()
        bits = torch.full((len(self.matchers), J, self.words), -1, dtype=torch.int32)  # [B, J, W] all allowed
        for b, m in enumerate(self.matchers):
            if m is None:
                continue
            skip = int(self.skip[b])  # a forced first token is not the grammar's to read
            tokens = self.before_eos(proposals[b][skip : first + J - 1])
            valid = m.validate_tokens(tokens)
            consumed = 0
            for j in range(J):
                read = max(first + j - skip, 0)  # the proposals before position j that the grammar reads
                if read > valid:
                    break
                m.consume_tokens(tokens[consumed:read])
                consumed = read
                m.unsafe_compute_mask_ptr(bits[b, j].data_ptr(), self.words * 4)
            m.rollback(consumed)
        self.seconds += time.perf_counter() - started
        return unpack(bits.to(self.device, non_blocking=True), self.vocab)

    def before_eos(self, tokens: list[int]) -> list[int]:
        """The tokens before the first EOS id (the matcher ends there: it consumes nothing after)."""
        return next((tokens[:k] for k, token in enumerate(tokens) if token in self.eos_ids), tokens)

    def advance(self, blocks: list[list[int]]) -> list[str | None]:
        """Row b emitted blocks[b] (host ids). Returns per row why its grammar cannot go on (the
        engine's matcher is in its error state: the row ends there), else None."""
        for b, (m, block) in enumerate(zip(self.matchers, blocks)):
            if m is not None and block:
                m.consume_tokens(self.before_eos(block[1:] if self.skip[b] else block))
            self.skip[b] = self.skip[b] and not block
        return [self.error(b) for b in range(len(self.matchers))]

    def error(self, b: int) -> str | None:
        """Why row b's grammar cannot be enforced any further (None: it can)."""
        m = self.matchers[b]
        if m is None or not m.is_error():
            return None
        first = next(iter(m.get_error().strip().splitlines()), "") or "the grammar engine failed"
        return f"the {self.kinds[b]} could not be enforced: {first}"

    def forced(self, b: int, gamma: int) -> list[int]:
        """Up to gamma tokens row b's grammar allows alone from here (jump-forward): the text it
        forces, tokenized, or an EOS id once the grammar is complete; [] without a grammar."""
        m = self.matchers[b]
        if m is None or self.skip[b] or m.is_error():
            return []
        return [self.eos] if m.is_stopped() else m.compute_ff_tokens()[:gamma]

    def select(self, kept: list[int]) -> None:
        self.matchers = [self.matchers[b] for b in kept]
        self.kinds = [self.kinds[b] for b in kept]
        self.skip = [self.skip[b] for b in kept]
