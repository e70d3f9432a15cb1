"""The batch job: source -> buckets -> decoder -> sink, with progress, resume and clean stops."""

import os
import platform
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import orjson
import torch
import transformers

import batchspec
from batchspec import shards
from batchspec.buckets import Batch, make_encoder, plan
from batchspec.chat import Bounds, run_template_options
from batchspec.config import NGRAM, STDIN, RunConfig
from batchspec.decoding import DecodeConfig, RowOptions, resolve_sampling
from batchspec.decoding.drafters import tree_problem
from batchspec.decoding.engine import BatchDecoder, split
from batchspec.decoding.grammar import Grammar, grammar_problem
from batchspec.decoding.kv_cache import SLOT_ALIBI
from batchspec.decoding.policy import GammaPolicy
from batchspec.defaults import default_draft, default_target
from batchspec.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_ROW_ERRORS, StopSignals, Stopped, UsageError, say
from batchspec.models import context_length, load_config, load_pair, load_tokenizer, unapplied_settings
from batchspec.records import RecordMaker
from batchspec.request_body import SAMPLES, SAMPLING_KEYS
from batchspec.sink import OutputPaths, Sink, claim, locked, output_paths, write_atomic
from batchspec.sources import Row, RowError, input_size, read_run_input
from batchspec.stats import RunStats, progress_bar


def with_default_models(cfg: RunConfig) -> RunConfig:
    """No --target: the embedded SmolLM2-135M-Instruct, with the embedded draft for --mode spec."""
    if cfg.target is not None:
        return cfg
    wants_draft = cfg.mode == "spec" and cfg.draft is None and not cfg.dry_run
    return replace(cfg, target=default_target(), draft=default_draft() if wants_draft else cfg.draft)


def check_options(cfg: RunConfig) -> None:
    if not (cfg.input.startswith("hf:") or cfg.input == STDIN or os.path.exists(cfg.input)):
        raise UsageError(f"input not found: {cfg.input}")
    if cfg.min_new_tokens > cfg.max_new_tokens:
        raise UsageError(f"--min-new-tokens {cfg.min_new_tokens} is over --max-new-tokens {cfg.max_new_tokens}")
    if cfg.mode not in ("spec", "ar"):
        raise UsageError(f"--mode must be spec or ar, got {cfg.mode!r}")
    if cfg.mode == "spec" and not cfg.draft and not cfg.dry_run:
        raise UsageError("--mode spec needs a --draft model or --draft ngram (or use --mode ar)")
    if cfg.ngram and cfg.mode != "spec":
        raise UsageError("--ngram drafts for --mode spec; --mode ar has no draft")
    if not 1 <= cfg.ngram_min <= cfg.ngram_max:
        raise UsageError(f"need 1 <= --ngram-min <= --ngram-max, got {cfg.ngram_min} and {cfg.ngram_max}")
    for name in ("gamma_max", "max_new_tokens", "batch_size", "window", "tree_width"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if cfg.gamma != "auto" and not (isinstance(cfg.gamma, int) and 1 <= cfg.gamma):
        raise UsageError(f"--gamma must be auto or a whole number >= 1, got {cfg.gamma!r}")
    check_tree(cfg)
    if any(not stop for stop in cfg.stop):
        raise UsageError("--stop strings must not be empty")
    if run_grammar(cfg) is not None and cfg.min_new_tokens:
        raise UsageError("--min-new-tokens cannot be combined with a structured output: the grammar decides where "
                         "the output ends")


def check_tree(cfg: RunConfig) -> None:
    if cfg.tree_width > 1 and (cfg.mode != "spec" or cfg.draft == NGRAM or cfg.ngram):
        raise UsageError("--tree-width needs --mode spec with a draft model: the draft grows the trees (no n-gram "
                         "lookup beside it)")
    if cfg.more_drafts and (cfg.mode != "spec" or NGRAM in (cfg.draft, *cfg.more_drafts) or cfg.ngram
                            or cfg.tree_width > 1):
        raise UsageError("several --draft models need --mode spec, and each proposes one chain: no 'ngram', "
                         "--ngram or --tree-width beside them")
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


GRAMMAR_OPTIONS = {"json_schema": "--json-schema", "regex": "--regex", "choice": "--choice", "grammar": "--grammar"}


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


def line_cap(cfg: RunConfig, context: int | None) -> int:
    """The most bytes an input line (or characters a prompt) may have: --max-line-bytes, else 64
    a token of the models' context and a MiB (JSON escapes and other fields included), else 64 MiB
    (a model that does not say its context). Longer ones are too_long rows, never parsed whole."""
    return cfg.max_line_bytes or ((1 << 20) + 64 * context if context else 1 << 26)


def shard_items(cfg: RunConfig, max_line_bytes: int):
    """This shard's rows and error lines of the input."""
    rows = read_run_input(cfg.input, cfg.options(), max_line_bytes)
    return warn_unapplied(shards.owned(rows, cfg.num_shards, cfg.shard_index))


def warn_unapplied(items):
    """The items as they come, with one warning at the first plain row that carries fields a
    request body would take as options (max_tokens, stop, ...): they are data there, and a run
    that drops what the user meant as options must not do it silently."""
    warned = False
    for item in items:
        if not warned and isinstance(item, Row) and item.unapplied:
            keys = ", ".join(map(repr, item.unapplied))
            say(f"warning: input row {item.line} has {keys} beside its prompt or messages; a plain row's other "
                "fields are data (--keep-fields), not options, so they are not applied. Give per-row options as "
                'OpenAI-batch lines ({"custom_id": ..., "body": {...}}) or every row\'s on the command line '
                "(batchspec run --help). Warned once.")
            warned = True
        yield item


def encoder(cfg: RunConfig, tokenizer, context: int | None, options: RowOptions):
    problem = options.grammar and grammar_problem(options.grammar, tokenizer)
    if problem:
        raise UsageError(f"{GRAMMAR_OPTIONS[options.grammar.kind]}: {problem}")
    template = run_template_options(cfg.chat_template, cfg.chat_template_kwargs, cfg.continue_final_message, tokenizer)
    cap = line_cap(cfg, context)
    bounds = Bounds(chars=cap) if cfg.trust_request_chat_template else None
    return make_encoder(tokenizer, context_length=context, max_new_tokens=cfg.max_new_tokens, truncate=cfg.truncate,
                        chat=cfg.chat, system=cfg.system, template=template, options=options,
                        request_templates=bounds, max_chars=cap)


def sample_id(row_id: str, index: int) -> str:
    """What seeds sample `index` of a row: the row id itself for the first (so n = 1 and the
    first of n samples agree), the id and the index for the others."""
    return row_id if index == 0 else f"{row_id}\x1f{index}"


def decode(pair, batch: Batch, config: DecodeConfig, run_options: RowOptions, samples: int, policy: GammaPolicy,
           stop: StopSignals):
    """One batch through the decoder, with its rows' own options (OpenAI-batch requests): their
    sampling settings (shared within a batch), n (else `samples`: the run's) and, over the
    run's, everything RowOptions holds. A row with n samples is decoded as n rows seeded apart
    (its prompt prefilled once). The gamma policy is the run's: what it measured carries over
    from batch to batch. Returns the BatchOutput and, per row, its samples' outputs; None when a
    stop signal came first."""
    shared = batch.rows[0].options
    sampling = replace(config.sampling, **{k: shared[k] for k in SAMPLING_KEYS if k in shared})
    counts = [r.options.get(SAMPLES, samples) for r in batch.rows]
    own = [{k: v for k, v in r.options.items() if k not in (*SAMPLING_KEYS, SAMPLES)} for r in batch.rows]
    options = [replace(run_options, **o) for o, k in zip(own, counts) for _ in range(k)]
    prompts = [p for p, k in zip(batch.prompts, counts) for _ in range(k)]
    row_ids = [sample_id(r.id, i) for r, k in zip(batch.rows, counts) for i in range(k)]
    decoder = BatchDecoder(pair.target, pair.drafts, prompts, row_ids, replace(config, sampling=sampling), options,
                           policy, pair.tokenizer)
    while not decoder.done:
        if stop.received:
            return None
        decoder.step()
    output = decoder.output()
    return output, split(output.rows, counts)


def record_maker(cfg: RunConfig, tokenizer) -> RecordMaker:
    return RecordMaker(tokenizer, output_format=cfg.output_format, model=cfg.target, created=int(time.time()),
                       token_ids=cfg.token_ids, keep=cfg.keep_fields, keep_all=cfg.keep_all_fields, trace=cfg.trace)


def with_shard(cfg: RunConfig) -> RunConfig:
    num_shards, shard_index, out = shards.resolve(cfg.num_shards, cfg.shard_index, cfg.out)
    return replace(cfg, num_shards=num_shards, shard_index=shard_index, out=out)


def run(cfg: RunConfig, stop: StopSignals) -> int:
    """The job; `stop` (active: the caller's) records the stop signals that end it between two
    decode steps."""
    cfg = with_shard(with_default_models(cfg))
    check_options(cfg)
    if cfg.dry_run:
        return dry_run(cfg, stop)
    paths = output_paths(cfg.out, cfg.input_files())
    with locked(paths):
        if cfg.overwrite:
            for path in paths.all():
                path.unlink(missing_ok=True)
        claim(paths, cfg.fingerprint())
        sink = Sink(paths, id_key="custom_id" if cfg.output_format == "openai" else "id")
        try:
            return run_locked(cfg, paths, sink, stop)
        finally:
            sink.close()


def run_locked(cfg: RunConfig, paths: OutputPaths, sink: Sink, stop: StopSignals) -> int:
    if sink.resumed_rows or sink.resumed_errors:
        say(f"resuming {paths.out}: {sink.resumed_rows} rows and {sink.resumed_errors} errors already written")
    pair = load_pair(cfg.target, cfg.draft_model, cfg.more_drafts, dtype=cfg.dtype, device=cfg.device)
    if cfg.mode == "spec" and pair.target.config.model_type in SLOT_ALIBI:
        kind = pair.target.config.model_type.upper()
        raise UsageError(f"{cfg.target!r} is an {kind} model, whose ALiBi counts cache slots: the holes rejected "
                         "proposals leave would change its output; run it with --mode ar")
    unapplied = unapplied_settings(pair.target)
    if unapplied:
        say(f"warning: the target's generation config sets {', '.join(unapplied)}, which batchspec does not apply "
            "(it decodes greedily or samples): outputs are generate()'s without them")
    make_record = record_maker(cfg, pair.tokenizer)
    sampling = resolve_sampling(pair.target.generation_config, temperature=cfg.temperature, top_k=cfg.top_k,
                                top_p=cfg.top_p, min_p=cfg.min_p)
    if cfg.tree_width > 1 or cfg.more_drafts:
        problem = tree_problem([pair.target, *pair.drafts])
        if problem or not sampling.greedy:
            raise UsageError(problem or "trees (--tree-width, several --draft) verify greedily only (lossless sampling "
                             "from several drafts is not built): use --temperature 0, or one draft's chain")
    config = DecodeConfig(max_new_tokens=cfg.max_new_tokens, eos_token_ids=pair.eos_token_ids, sampling=sampling,
                          gamma=decode_gamma(cfg), gamma_max=cfg.gamma_max, seed=cfg.seed, ngram=cfg.ngram_sizes,
                          tree_width=cfg.tree_width, **pair.forced_tokens)
    policy = config.policy(trees=cfg.tree_width > 1 or bool(cfg.more_drafts))
    run_options = run_row_options(cfg, len(pair.tokenizer), pair.target.generation_config)
    encode = encoder(cfg, pair.tokenizer, pair.context_length, run_options)
    stats = RunStats()
    bar = progress_bar(input_size(cfg.input, cfg.split, cfg.subset), cfg.progress)

    def fresh(items):
        for item in items:
            if sink.is_done(item):
                stats.rows_skipped += 1
                bar.update(1)
            else:
                yield item

    interrupted = False
    items = shard_items(cfg, line_cap(cfg, pair.context_length))
    batches = plan(fresh(items), encode, window=cfg.window, batch_size=cfg.batch_size,
                   max_batch_tokens=cfg.max_batch_tokens, max_new_tokens=cfg.max_new_tokens, samples=cfg.n)
    try:
        for item in stop.each(batches):  # a stop while the input is read ends the run at once
            if isinstance(item, RowError):
                sink.error(item)
                stats.rows_error += 1
                bar.update(1)
                continue
            decoded = decode(pair, item, config, run_options, cfg.n, policy, stop)
            if decoded is None:
                interrupted = True
                break
            output, samples = decoded
            sink.write([make_record(r, s) for r, s in zip(item.rows, samples)])
            stats.add_batch(item, output)
            bar.update(len(item.rows))
            bar.set_postfix(stats.postfix(), refresh=False)
    except Stopped:
        interrupted = True
    bar.close()
    sink.flush_errors()
    code = EXIT_INTERRUPTED if interrupted else EXIT_ROW_ERRORS if sink.error_lines else EXIT_OK
    summary = {
        "finished": not interrupted,
        "exit_code": code,
        "input": cfg.input,
        "out": str(paths.out),
        "rows_in_output": len(sink.done),
        "errors_in_file": len(sink.error_lines),
        **stats.summary(),
        "models": {
            "target": cfg.target,
            "draft": cfg.draft_model,
            "more_drafts": list(cfg.more_drafts),
            "ngram": cfg.ngram_sizes,
            "dtype": str(pair.target.dtype).removeprefix("torch."),
            "device": str(pair.target.device),
            "sampling": vars(sampling) | {"greedy": sampling.greedy},
            "eos_token_ids": list(pair.eos_token_ids),
        },
        "options": cfg.options(),
        "versions": versions(),
    }
    write_atomic(paths.summary, orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    print_summary(summary, paths, interrupted)
    return code


def versions() -> dict:
    return {"batchspec": batchspec.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def print_summary(summary: dict, paths: OutputPaths, interrupted: bool) -> None:
    rate = summary["acceptance_rate"]
    lines = [
        "interrupted: rerun the same command to resume" if interrupted else "done",
        f"  rows       {summary['rows_ok']} ok, {summary['rows_error']} errors, {summary['rows_skipped']} already done",
        f"  tokens     {summary['completion_tokens']} generated in {summary['seconds']:.1f}s "
        f"({summary['tokens_per_s']:.1f} tok/s)",
        f"  acceptance {rate:.3f} (proposals: {summary['model_steps']} row-steps from the model, "
        f"{summary['ngram_steps']} from n-gram lookup, {summary['jump_steps']} jump-forward"
        + (f"; {summary['tree_steps']} trees of {summary['tree_nodes'] / summary['tree_steps']:.1f} nodes"
           if summary["tree_steps"] else "") + ")" if rate is not None
        else "  acceptance n/a (no proposals)",
        f"  padding    {summary['padding_fraction']:.3f} of prompt slots, "
        f"{summary['wasted_cache_fraction']:.3f} of cache slots wasted",
        f"  output     {paths.out}",
    ]
    if summary["errors_in_file"]:
        lines.append(f"  errors     {paths.errors} ({summary['errors_in_file']} rows)")
    lines.append(f"  summary    {paths.summary}")
    say("\n".join(lines))


def dry_run(cfg: RunConfig, stop: StopSignals) -> int:
    """Check the input, count rows and errors and show the batches, loading no weights (a stop
    signal ends it: Stopped, 75)."""
    tokenizer = load_tokenizer(cfg.target)
    record_maker(cfg, tokenizer)  # refuses --keep-fields that clash with the output's own
    specs = [cfg.target] + ([cfg.draft_model, *cfg.more_drafts] if cfg.draft_model else [])
    context = min((n for n in (context_length(load_config(spec)) for spec in specs) if n is not None), default=None)
    encode = encoder(cfg, tokenizer, context, run_row_options(cfg, len(tokenizer), None))
    errors, lengths, batch_sizes = Counter(), Counter(), Counter()
    rows = pads = slots = 0
    for item in stop.each(plan(shard_items(cfg, line_cap(cfg, context)), encode, window=cfg.window,
                               batch_size=cfg.batch_size, max_batch_tokens=cfg.max_batch_tokens,
                               max_new_tokens=cfg.max_new_tokens, samples=cfg.n)):
        if isinstance(item, RowError):
            if sum(errors.values()) < 20:
                say(f"line {item.line}: {item.type}: {item.message}")
            errors[item.type] += 1
            continue
        rows += len(item.rows)
        batch_sizes[len(item.rows)] += 1
        pads, slots = pads + item.padding[0], slots + item.padding[1]
        for ids in item.prompts:
            lengths[1 << (len(ids) - 1).bit_length()] += 1
    say(f"dry run of {cfg.input}: {rows} rows ok, {sum(errors.values())} errors"
        + "".join(f"\n  {kind}: {n}" for kind, n in errors.most_common()))
    say("prompt tokens (up to)  rows\n" + "\n".join(f"  {k:>20}  {lengths[k]}" for k in sorted(lengths)))
    say(f"batches: {sum(batch_sizes.values())} (rows per batch: "
        + ", ".join(f"{size}x{n}" for size, n in sorted(batch_sizes.items(), reverse=True))
        + f"), padding fraction {pads / slots if slots else 0:.3f}")
    return EXIT_ROW_ERRORS if errors else EXIT_OK
