"""Rows in, records out: the one path from an input row to its output record.

`batchspec run` runs on it (and adds the files: resume, the error file, the summary), a Python
pipeline calls it directly (`Generator.generate`, `Generator.map` for `datasets.map`), and the
Ray stage (batchspec.ray) holds one per actor.
"""

import time
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import count
from typing import NamedTuple
from dataclasses import dataclass, fields, replace
from pathlib import Path

from batchspec.buckets import Batch, make_encoder, plan
from batchspec.chat import NO_TEMPLATE, Bounds, run_template_options
from batchspec.config import LOOKUPS, SUFFIX, RunConfig
from batchspec.decoding import DecodeConfig, RowOptions, resolve_sampling
from batchspec.decoding.compiled import Compiled
from batchspec.decoding.drafters import tree_problem
from batchspec.decoding.engine import BatchDecoder, BatchOutput, split
from batchspec.decoding.grammar import Grammar, grammar_problem
from batchspec.decoding.kv_cache import SLOT_ALIBI
from batchspec.decoding.seq2seq import static_problem
from batchspec.decoding.suffix_index import SuffixIndex
from batchspec.defaults import default_draft, default_target
from batchspec.errors import UsageError, say
from batchspec.memory import HEADROOM, batch_bytes, free_bytes
from batchspec.models import ModelPair, context_length, load_config, load_pair, rope_window, unapplied_settings
from batchspec.records import RecordMaker
from batchspec.request_body import SAMPLES, SAMPLING_KEYS
from batchspec.sources import Fields, Row, RowError, parse_object, unique_ids

ROWS = "<rows>"  # a Generator's input and out: its rows come from, and its records go to, the caller
GRAMMAR_OPTIONS = {"json_schema": "--json-schema", "regex": "--regex", "choice": "--choice", "grammar": "--grammar"}


def with_default_models(cfg: RunConfig) -> RunConfig:
    """No --target: the embedded SmolLM2-135M-Instruct, with the embedded draft for --mode spec."""
    if cfg.target is not None:
        return cfg
    wants_draft = cfg.mode == "spec" and cfg.draft is None and not cfg.dry_run
    return replace(cfg, target=default_target(), draft=default_draft() if wants_draft else cfg.draft)


def check_options(cfg: RunConfig) -> None:
    """Options that cannot work together (UsageError); the input and OUT are the job's to check."""
    if cfg.mode not in ("spec", "ar"):
        raise UsageError(f"--mode must be spec or ar, got {cfg.mode!r}")
    if cfg.mode == "spec" and not cfg.draft and not cfg.dry_run:
        raise UsageError("--mode spec needs a --draft model, --draft ngram or --draft suffix (or use --mode ar)")
    if (cfg.ngram or cfg.suffix) and cfg.mode != "spec":
        raise UsageError("--ngram and --suffix draft for --mode spec; --mode ar has no draft")
    if cfg.ngram and cfg.suffix or (cfg.ngram or cfg.suffix) and cfg.draft in LOOKUPS:
        raise UsageError("one model-free drafter at a time: --draft ngram|suffix, or --ngram or --suffix beside a "
                         "draft model (the suffix drafter looks up the row's own text too)")
    if not 1 <= cfg.ngram_min <= cfg.ngram_max:
        raise UsageError(f"need 1 <= --ngram-min <= --ngram-max, got {cfg.ngram_min} and {cfg.ngram_max}")
    for name in ("gamma_max", "max_new_tokens", "batch_size", "window", "tree_width"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if cfg.gamma != "auto" and not (isinstance(cfg.gamma, int) and 1 <= cfg.gamma):
        raise UsageError(f"--gamma must be auto or a whole number >= 1, got {cfg.gamma!r}")
    if cfg.min_new_tokens > cfg.max_new_tokens:
        raise UsageError(f"--min-new-tokens {cfg.min_new_tokens} is over --max-new-tokens {cfg.max_new_tokens}")
    if cfg.compile_after != RunConfig.compile_after and not cfg.compile:
        raise UsageError("--compile-after says when --compile compiles: give --compile too")
    check_tree(cfg)
    if any(not stop for stop in cfg.stop):
        raise UsageError("--stop strings must not be empty")
    if run_grammar(cfg) is not None and cfg.min_new_tokens:
        raise UsageError("--min-new-tokens cannot be combined with a structured output: the grammar decides where "
                         "the output ends")


def check_tree(cfg: RunConfig) -> None:
    if cfg.tree_width > 1 and (cfg.mode != "spec" or cfg.lookup):
        raise UsageError("--tree-width needs --mode spec with a draft model: the draft grows the trees (no lookup "
                         "beside it)")
    if cfg.more_drafts and (cfg.mode != "spec" or set(LOOKUPS) & {cfg.draft, *cfg.more_drafts} or cfg.lookup
                            or cfg.tree_width > 1):
        raise UsageError("several --draft models need --mode spec, and each proposes one chain: no 'ngram' or "
                         "'suffix', --ngram, --suffix or --tree-width beside them")
    if cfg.tree_depth is not None:
        if cfg.tree_width == 1:
            raise UsageError("--tree-depth needs --tree-width 2 or more (a chain's depth is --gamma)")
        if cfg.gamma != "auto":
            raise UsageError("give --gamma or --tree-depth, not both: a tree's depth is its gamma")
        if cfg.tree_depth < 1:
            raise UsageError("--tree-depth must be at least 1")


def decode_gamma(cfg: RunConfig) -> int | None:
    """The fixed gamma (a tree's depth), or None: auto."""
    return cfg.tree_depth or (None if cfg.gamma == "auto" else cfg.gamma)


def run_grammar(cfg: RunConfig) -> Grammar | None:
    """The grammar every row's output matches (--json-schema, --regex, --choice, --grammar), or None."""
    given = [name for name in GRAMMAR_OPTIONS if getattr(cfg, name) is not None]
    if len(given) > 1:
        raise UsageError(f"give one of {', '.join(GRAMMAR_OPTIONS[name] for name in given)}")
    return option_grammar(given[0], getattr(cfg, given[0])) if given else None


def option_grammar(name: str, value: str, tokenizer=None) -> Grammar:
    """A grammar option's grammar (name: a GRAMMAR_OPTIONS key; value: a file for json_schema
    and grammar, comma-separated texts for choice), checked against the tokenizer when given;
    UsageError naming the option when it cannot be enforced."""
    try:
        text = Path(value).read_text() if name in ("json_schema", "grammar") else value
        if name == "json_schema":
            grammar = Grammar.json_schema(text)
        else:
            grammar = Grammar.choice(text.split(",")) if name == "choice" else Grammar(name, text)
    except (OSError, ValueError) as e:
        raise UsageError(f"{GRAMMAR_OPTIONS[name]}: {e}") from None
    problem = tokenizer is not None and grammar_problem(grammar, tokenizer)
    if problem:
        raise UsageError(f"{GRAMMAR_OPTIONS[name]}: {problem}")
    return grammar


def run_row_options(cfg: RunConfig, vocab: int, generation_config) -> RowOptions:
    """What every row asks for unless its request says otherwise (the --stop, --min-new-tokens,
    penalty, --logit-bias, --logprobs and grammar options; the repetition penalty defaults to
    the target's generation_config, as in generate)."""
    bias = {int(token): float(value) for token, value in (item.split("=") for item in cfg.logit_bias)}
    if any(token >= vocab for token in bias):
        raise UsageError(f"--logit-bias names token ids the tokenizer does not have ({vocab} ids): "
                         f"{sorted(t for t in bias if t >= vocab)}")
    repetition = cfg.repetition_penalty or getattr(generation_config, "repetition_penalty", None) or 1.0
    return RowOptions(stop=tuple(cfg.stop), min_tokens=cfg.min_new_tokens, repetition_penalty=float(repetition),
                      frequency_penalty=cfg.frequency_penalty, presence_penalty=cfg.presence_penalty,
                      logit_bias=bias, logprobs=cfg.logprobs, grammar=run_grammar(cfg))


def lookahead(cfg: RunConfig) -> int:
    """The most positions a step verifies past a row's newest token (gamma_max: a chain, a tree's
    depth, a grammar's jump-forward)."""
    return cfg.gamma_max if cfg.mode == "spec" else 0


def models_context(cfg: RunConfig) -> int | None:
    """The longest sequence every model of the run takes, from their configs (no weights read)."""
    specs = [cfg.target] + ([cfg.draft_model, *cfg.more_drafts] if cfg.draft_model else [])
    lengths = (context_length(load_config(spec), lookahead(cfg)) for spec in specs)
    return min((n for n in lengths if n is not None), default=None)


def line_cap(cfg: RunConfig, context: int | None) -> int:
    """The most bytes an input line (or characters a prompt) may have: --max-line-bytes, else 64
    a token of the models' context and a MiB (JSON escapes and other fields included), else 64 MiB
    (a model that does not say its context). Longer ones are too_long rows, never parsed whole."""
    return cfg.max_line_bytes or ((1 << 20) + 64 * context if context else 1 << 26)


def encoder(cfg: RunConfig, tokenizer, context: int | None, options: RowOptions):
    """The run's bucketing encoder (buckets.make_encoder) with its chat template options."""
    problem = options.grammar and grammar_problem(options.grammar, tokenizer)
    if problem:
        raise UsageError(f"{GRAMMAR_OPTIONS[options.grammar.kind]}: {problem}")
    template = run_template_options(cfg.chat_template, cfg.chat_template_kwargs, cfg.continue_final_message, tokenizer)
    if cfg.chat and not (template.template or tokenizer.chat_template):  # every row would be an error
        raise UsageError(f"--chat: {NO_TEMPLATE}")
    if context is not None and cfg.max_new_tokens >= context:
        say(f"warning: --max-new-tokens {cfg.max_new_tokens} leaves no room for a prompt in the models' context of "
            f"{context} tokens: rows without a max_tokens of their own are too_long (--truncate cannot cut them)")
    cap = line_cap(cfg, context)
    bounds = Bounds(chars=cap) if cfg.trust_request_chat_template else None
    return make_encoder(tokenizer, context_length=context, max_new_tokens=cfg.max_new_tokens, truncate=cfg.truncate,
                        chat=cfg.chat, system=cfg.system, template=template, options=options,
                        request_templates=bounds, max_chars=cap)


def record_maker(cfg: RunConfig, tokenizer) -> RecordMaker:
    return RecordMaker(tokenizer, output_format=cfg.output_format, model=cfg.target, created=int(time.time()),
                       token_ids=cfg.token_ids, keep=cfg.keep_fields, keep_all=cfg.keep_all_fields, trace=cfg.trace)


def sample_id(row_id: str, index: int) -> str:
    """What seeds sample `index` of a row: the row id itself for the first (so n = 1 and the
    first of n samples agree), the id and the index for the others."""
    return row_id if index == 0 else f"{row_id}\x1f{index}"


def rows_config(options: dict) -> RunConfig:
    """A RunConfig from a Generator's keyword options (named as `batchspec run`'s, with `_`):
    `draft` may list several models, `keep_fields` and `stop` may be lists."""
    drafts = options.pop("draft", None)
    drafts = [drafts] if isinstance(drafts, str) or drafts is None else list(drafts)
    for name in ("keep_fields", "stop", "logit_bias"):
        if name in options:
            options[name] = tuple(options[name])
    known = {f.name for f in fields(RunConfig)} - {"input", "out", "more_drafts"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; a Generator takes batchspec run's options: "
                        f"{', '.join(sorted(known))}")
    return RunConfig(input=ROWS, out=ROWS, draft=drafts[0], more_drafts=tuple(drafts[1:]), **options)


def compiled_steps(cfg: RunConfig, pair: ModelPair) -> Compiled | None:
    """The run's compiled step forwards (--compile): a step's slots at most, tree nodes counted."""
    if not cfg.compile:
        return None
    width = max(cfg.tree_width, len(pair.drafts))
    return Compiled(slots=cfg.gamma_max * width + 1, after=cfg.compile_after, device_type=pair.target.device.type)


@dataclass
class Decoded:
    """One decoded batch: the records of its rows, and the error records of rows that failed
    while decoding (a grammar the engine could not hold to its end)."""

    batch: Batch
    output: BatchOutput
    records: list[dict]  # of the rows decoded to their end
    lines: list[int]  # their input lines, in the same order
    errors: list[RowError]


class Generator:
    """The models loaded once, and every option of `batchspec run`: rows in, records out.

        gen = Generator(target="HuggingFaceTB/SmolLM2-1.7B-Instruct", draft="...-360M-Instruct",
                        max_new_tokens=128, temperature=0)
        for record in gen.generate([{"id": "a", "prompt": "..."}, {"messages": [...]}]):
            ...

    generate() takes dicts shaped like input lines (prompt, messages, OpenAI-batch requests with
    their per-row options) and yields what `batchspec run` writes for them: a record, or an
    error record ({"id", "line", "error"}) for a bad row, in input order (or, ordered=False, as
    batches finish). map() serves datasets.Dataset.map(batched=True)."""

    def __init__(self, config: RunConfig | None = None, /, **options):
        if config is not None and options:
            raise TypeError("give a Generator a RunConfig or options, not both")
        cfg = with_default_models(config if config is not None else rows_config(options))
        check_options(cfg)
        self.config = cfg
        self.pair: ModelPair = load_pair(cfg.target, cfg.draft_model, cfg.more_drafts, dtype=cfg.dtype,
                                         device=cfg.device)
        check_pair(cfg, self.pair)
        sampling = resolve_sampling(self.pair.target.generation_config, temperature=cfg.temperature,
                                    top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p)
        if cfg.tree_width > 1 or cfg.more_drafts:
            problem = tree_problem([self.pair.target, *self.pair.drafts])
            if problem or not sampling.greedy:
                raise UsageError(problem or "trees (--tree-width, several --draft) verify greedily only (lossless "
                                 "sampling from several drafts is not built): use --temperature 0, or one draft's "
                                 "chain")
        self.decode_config = DecodeConfig(
            max_new_tokens=cfg.max_new_tokens, eos_token_ids=self.pair.eos_token_ids, sampling=sampling,
            gamma=decode_gamma(cfg), gamma_max=cfg.gamma_max, seed=cfg.seed, ngram=cfg.ngram_sizes,
            suffix=SuffixIndex() if cfg.lookup == SUFFIX else None,  # the run's: every batch drafts from it
            tree_width=cfg.tree_width, compiled=compiled_steps(cfg, self.pair), **self.pair.forced_tokens)
        self.policy = self.decode_config.policy(trees=cfg.tree_width > 1 or bool(cfg.more_drafts))  # the run's
        self.row_options = run_row_options(cfg, len(self.pair.tokenizer), self.pair.target.generation_config)
        self.encode = encoder(cfg, self.pair.tokenizer, self.pair.context_length(lookahead(cfg)), self.row_options)
        self.make_record = record_maker(cfg, self.pair.tokenizer)
        self.fields = Fields(prompt=cfg.prompt_field, id=cfg.id_field, messages=cfg.messages_field,
                             tools=cfg.tools_field)
        self.split_said = False  # a batch was split to fit memory, and the run said so

    def compile_summary(self) -> dict | None:
        """What --compile did so far: shapes compiled, seconds compiling and eager, and the models
        that kept a dynamic cache, with why (None: no --compile)."""
        compiled = self.decode_config.compiled
        if compiled is None:
            return None
        dynamic = [problem for model in (self.pair.target, *self.pair.drafts) if (problem := static_problem(model))]
        return {**compiled.summary(), "dynamic_cache": dynamic}

    @property
    def line_cap(self) -> int:
        return line_cap(self.config, self.pair.context_length(lookahead(self.config)))

    def decoded(self, items: Iterable[Row | RowError]) -> Iterator[Decoded | RowError]:
        """Parsed rows (and the errors met parsing them) -> error rows as they come, and the
        rows' records batch by batch: bucketed over windows, as the job does."""
        cfg = self.config
        for item in plan(items, self.encode, window=cfg.window, batch_size=cfg.batch_size,
                         max_batch_tokens=cfg.max_batch_tokens, max_new_tokens=cfg.max_new_tokens, samples=cfg.n):
            if isinstance(item, RowError):
                yield item
            else:
                yield from map(self.decode, self.fitting(item))

    def fitting(self, batch: Batch) -> list[Batch]:
        """The batch, or its halves (again, down to single rows) where its caches and a step's
        logits would not fit the device's free memory (memory.py); says so once per run."""
        rows = sum(r.options.get(SAMPLES, self.config.n) for r in batch.rows)
        limit = max(r.options.get("max_new_tokens") or self.config.max_new_tokens for r in batch.rows)
        width = max(self.config.tree_width, len(self.pair.drafts), 1)
        need = batch_bytes([self.pair.target, *self.pair.drafts], rows, max(map(len, batch.prompts)), limit,
                           self.config.gamma_max * width + 1, self.pair.target.config.get_text_config().vocab_size)
        free = HEADROOM * free_bytes(self.pair.target.device)
        if need <= free or len(batch.rows) == 1:
            return [batch]
        if not self.split_said:
            say(f"a batch of {rows} rows needs about {need / 2**30:.1f} GiB of caches and logits, "
                f"{free / 2**30:.1f} GiB is free: split in halves (a lower --batch-size avoids the split)")
            self.split_said = True
        half = len(batch.rows) // 2
        return [*self.fitting(Batch(batch.rows[:half], batch.prompts[:half])),
                *self.fitting(Batch(batch.rows[half:], batch.prompts[half:]))]

    def decode(self, batch: Batch) -> Decoded:
        """One batch through the decoder, with its rows' own options (OpenAI-batch requests):
        their sampling settings (shared within a batch), n (else the run's) and, over the run's,
        everything RowOptions holds. A row with n samples is decoded as n rows seeded apart (its
        prompt prefilled once). The gamma policy is the run's: what it measured carries over."""
        shared = batch.rows[0].options
        sampling = replace(self.decode_config.sampling, **{k: shared[k] for k in SAMPLING_KEYS if k in shared})
        counts = [r.options.get(SAMPLES, self.config.n) for r in batch.rows]
        own = [{k: v for k, v in r.options.items() if k not in (*SAMPLING_KEYS, SAMPLES)} for r in batch.rows]
        options = [replace(self.row_options, **o) for o, k in zip(own, counts) for _ in range(k)]
        prompts = [p for p, k in zip(batch.prompts, counts) for _ in range(k)]
        row_ids = [sample_id(r.id, i) for r, k in zip(batch.rows, counts) for i in range(k)]
        decoder = BatchDecoder(self.pair.target, self.pair.drafts, prompts, row_ids,
                               replace(self.decode_config, sampling=sampling), options, self.policy,
                               self.pair.tokenizer)
        while not decoder.done:
            decoder.step()
        output = decoder.output()
        done = Decoded(batch, output, [], [], [])
        for row, samples in zip(batch.rows, split(output.rows, counts)):
            failed = next((s.error for s in samples if s.error), None)
            if failed:
                done.errors.append(RowError(row.line, row.id, "grammar", failed))
            else:
                done.records.append(self.make_record(row, samples))
                done.lines.append(row.line)
        return done

    def generate(self, rows: Iterable[dict], *, ordered: bool = True, first_line: int = 1,
                 lines: Iterable[int] | None = None) -> Iterator[dict]:
        """Records (and error records) of input-line-shaped dicts, in input order unless
        `ordered` is False. Each row takes a line number (`lines`, else first_line, first_line +
        1, ...): a row without an id takes it as its id, as a JSONL line does."""
        return (result.record for result in self.results(rows, ordered=ordered, first_line=first_line, lines=lines))

    def results(self, rows: Iterable[dict], *, ordered: bool = True, first_line: int = 1,
                lines: Iterable[int] | None = None) -> Iterator["Result"]:
        """generate()'s records as Results: each with its line and whether it is an error record."""
        numbered_rows = zip(count(first_line) if lines is None else lines, rows)
        order: deque[int] = deque()  # the lines not out yet, in input order
        items = unique_ids(parse_object(row, line, self.fields) for line, row in noting(numbered_rows, order))
        held: dict[int, Result] = {}  # input line -> its result, until the lines before it are out
        for done in self.decoded(items):
            held.update((result.line, result) for result in results_of(done))
            if not ordered:
                order.clear()
                yield from held.values()
                held.clear()
            while order and order[0] in held:
                yield held.pop(order.popleft())

    def map(self, columns: dict[str, list], indices: list[int] | None = None) -> dict[str, list]:
        """For datasets.Dataset.map(batched=True) (with_indices=True: ids from the indices): the
        batch's columns in, the `as_columns` of its records out, in its order."""
        names = list(columns)
        rows = [dict(zip(names, values)) for values in zip(*columns.values())]
        return as_columns(list(self.generate(rows, first_line=indices[0] + 1 if indices else 1)), self.config.n)

    def __reduce__(self):
        """Pickled as its options (loading the models again where it is unpickled): what
        datasets hashes for its cache, and how a process pool or Ray ships it."""
        return Generator, (self.config,)


def check_pair(cfg: RunConfig, pair: ModelPair) -> None:
    if cfg.mode == "spec" and pair.target.config.model_type in SLOT_ALIBI:
        kind = pair.target.config.model_type.upper()
        raise UsageError(f"{cfg.target!r} is an {kind} model, whose ALiBi counts cache slots: the holes rejected "
                         "proposals leave would change its output; run it with --mode ar")
    window = rope_window(pair.target.config)
    if window is not None:
        say(f"warning: the target's rope rescales past {window} positions by the longest row of each forward "
            f"(transformers' dynamic NTK or LongRoPE): rows are decoded within {pair.context_length(lookahead(cfg))} "
            "tokens of prompt and completion, as generate() would decode them alone; longer ones are too_long "
            "errors (--truncate cuts them)")
    unapplied = unapplied_settings(pair.target)
    if unapplied:
        say(f"warning: the target's generation config sets {', '.join(unapplied)}, which batchspec does not apply "
            "(it decodes greedily or samples): outputs are generate()'s without them")


def noting(numbered_rows: Iterable[tuple[int, dict]], order: deque) -> Iterator[tuple[int, dict]]:
    """The (line, row) pairs as they are read, each line appended to `order` on the way."""
    for line, row in numbered_rows:
        order.append(line)
        yield line, row


class Result(NamedTuple):
    line: int  # the row's input line
    record: dict  # its record, or its error record
    failed: bool  # an error record


def results_of(done: Decoded | RowError) -> list[Result]:
    """The Results of everything a decoded item holds."""
    errors = [done] if isinstance(done, RowError) else done.errors
    records = zip(done.lines, done.records) if isinstance(done, Decoded) else ()
    return [*(Result(line, record, False) for line, record in records),
            *(Result(error.line, error.record(), True) for error in errors)]


def as_columns(records: list[dict], n: int) -> dict[str, list]:
    """Records as columns: `completion` (the text, "" for an error record; with n > 1 the list of
    texts), `finish_reason` ("error" for an error record) and `error` ("" or "type: message").
    Strings throughout, so that every batch of a dataset has the same column types."""
    out = {"completion": [], "finish_reason": [], "error": []}
    for record in records:
        texts, reasons = completions_of(record)
        failure = record.get("error") if not texts else None
        out["completion"].append(texts if n > 1 else texts[0] if texts else "")
        out["finish_reason"].append(reasons if n > 1 else reasons[0] if reasons else "error")
        out["error"].append(f"{failure['type']}: {failure['message']}" if failure else "")
    return out


def completions_of(record: dict) -> tuple[list[str], list[str]]:
    """A record's texts and finish reasons, in either output format ([] for an error record)."""
    if record.get("error") and not record.get("response"):
        return [], []
    if "response" in record:
        choices = record["response"]["body"]["choices"]
        return ([c["message"]["content"] if "message" in c else c["text"] for c in choices],
                [c["finish_reason"] for c in choices])
    samples = record.get("samples") or [record]
    return [s["completion"] for s in samples], [s["finish_reason"] for s in samples]
