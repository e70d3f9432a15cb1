"""The batch job: source -> Generator (buckets -> decoder -> records) -> sink, with progress,
resume and clean stops."""

import os
import platform
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import orjson
import torch
import transformers

import batchspec
from batchspec import shards
from batchspec.api import (Decoded, Generator, check_options, encoder, line_cap, models_context, record_maker,
                           run_row_options, with_default_models)
from batchspec.buckets import plan
from batchspec.config import STDIN, RunConfig
from batchspec.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_ROW_ERRORS, StopSignals, Stopped, UsageError, say
from batchspec.models import load_tokenizer
from batchspec.sink import OutputPaths, Sink, claim, locked, output_paths, refuse_foreign, write_atomic
from batchspec.sources import Row, RowError, input_size, read_run_input
from batchspec.stats import RunStats, by_source, progress_bar


def check_input(cfg: RunConfig) -> None:
    if not (cfg.input.startswith("hf:") or cfg.input == STDIN or os.path.exists(cfg.input)):
        raise UsageError(f"input not found: {cfg.input}")


def shard_items(cfg: RunConfig, max_line_bytes: int):
    """This shard's rows and error lines of the input."""
    rows = read_run_input(cfg.input, cfg.options(), max_line_bytes)
    return with_warnings(shards.owned(rows, cfg.num_shards, cfg.shard_index), cfg.id_field)


def with_warnings(items, id_field: str = "id"):
    """The items as they come, with one warning at the first plain row that carries fields a
    request body would take as options (max_tokens, stop, ...): they are data there, and a run
    that drops what the user meant as options must not do it silently; and one at the first
    plain row without the --id-field named (not the default "id"), whose id is its line number."""
    warned, unnamed = False, id_field == "id"
    for item in items:
        plain = isinstance(item, Row) and item.endpoint is None
        if not warned and plain and item.unapplied:
            keys = ", ".join(map(repr, item.unapplied))
            say(f"warning: input row {item.line} has {keys} beside its prompt or messages; a plain row's other "
                "fields are data (--keep-fields), not options, so they are not applied. Give per-row options as "
                'OpenAI-batch lines ({"custom_id": ..., "body": {...}}) or every row\'s on the command line '
                "(batchspec run --help). Warned once.")
            warned = True
        if not unnamed and plain and id_field not in item.fields:
            say(f"warning: input row {item.line} has no field {id_field!r} (--id-field): its id is its line "
                "number. Warned once.")
            unnamed = True
        yield item


def with_shard(cfg: RunConfig) -> RunConfig:
    num_shards, shard_index, out = shards.resolve(cfg.num_shards, cfg.shard_index, cfg.out)
    return replace(cfg, num_shards=num_shards, shard_index=shard_index, out=out)


def run(cfg: RunConfig, stop: StopSignals) -> int:
    """The job; `stop` (active: the caller's) records the stop signals that end it: between two
    decode steps, or at once while it waits on its input."""
    cfg = with_shard(with_default_models(cfg))
    check_input(cfg)
    check_options(cfg)
    if cfg.dry_run:
        return dry_run(cfg, stop)
    with opened_out(cfg) as sink:
        return run_locked(cfg, sink, stop)


@contextmanager
def opened_out(cfg: RunConfig) -> Iterator[Sink]:
    """OUT locked for this run, started over (--overwrite) or claimed, its Sink open."""
    paths = output_paths(cfg.out, cfg.input_files())
    if not cfg.overwrite:
        refuse_foreign(paths)  # before a lock file is made beside a file batchspec did not write
    with locked(paths):
        if cfg.overwrite:
            for path in paths.all():
                path.unlink(missing_ok=True)
        claim(paths, cfg.fingerprint())
        sink = Sink(paths, id_key="custom_id" if cfg.output_format == "openai" else "id")
        if sink.resumed_rows or sink.resumed_errors:
            say(f"resuming {paths.out}: {sink.resumed_rows} rows and {sink.resumed_errors} errors already written")
        try:
            yield sink
        finally:
            sink.close()


def run_locked(cfg: RunConfig, sink: Sink, stop: StopSignals) -> int:
    generator = Generator(cfg)
    stats = RunStats()
    bar = progress_bar(input_size(cfg.input, cfg.split, cfg.subset), cfg.progress)

    def fresh(items):
        for item in items:
            if sink.is_done(item):
                stats.rows_skipped += 1
                bar.update(1)
            else:
                yield item

    interrupted, failure = False, None
    try:  # a stop ends the run at once where nothing is being written: reading, decoding
        for done in stop.each(generator.decoded(fresh(shard_items(cfg, generator.line_cap)))):
            for error in done.errors if isinstance(done, Decoded) else [done]:
                sink.error(error)
                stats.rows_error += 1
            if isinstance(done, Decoded):
                sink.write(done.records)
                stats.add_batch(done.batch, done.output)
                stats.rows_ok -= len(done.errors)  # rows whose grammar failed mid-row are error records
            bar.update(len(done.batch.rows) if isinstance(done, Decoded) else 1)
            bar.set_postfix(stats.postfix(), refresh=False)
    except Stopped:
        interrupted = True
    except UsageError as e:  # the input cannot be read on: what was written stands, the summary says so
        failure = e
    bar.close()
    sink.flush_errors()
    code = (failure.exit_code if failure else EXIT_INTERRUPTED if interrupted else
            EXIT_ROW_ERRORS if sink.error_lines else EXIT_OK)
    pair, sampling = generator.pair, generator.decode_config.sampling
    summary = {
        "finished": not (interrupted or failure),
        "exit_code": code,
        "input": cfg.input,
        "out": str(sink.paths.out),
        "rows_in_output": len(sink.done),
        "errors_in_file": len(sink.error_lines),
        **stats.summary(),
        "compile": generator.compile_summary(),
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
    write_atomic(sink.paths.summary, orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    if failure:
        raise failure
    print_summary(summary, sink.paths, interrupted)
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
        f"  acceptance {rate:.3f} ({by_source(summary)}"
        + (f"; {summary['tree_steps']} trees of {summary['tree_nodes'] / summary['tree_steps']:.1f} nodes"
           if summary["tree_steps"] else "") + ")" if rate is not None
        else "  acceptance n/a (no proposals)",
        f"  padding    {summary['padding_fraction']:.3f} of prompt slots, "
        f"{summary['wasted_cache_fraction']:.3f} of cache slots wasted",
        f"  output     {paths.out}",
    ]
    if summary["compile"] is not None:
        lines.insert(-1, compile_line(summary["compile"]))
    if summary["errors_in_file"]:
        lines.append(f"  errors     {paths.errors} ({summary['errors_in_file']} rows)")
    lines.append(f"  summary    {paths.summary}")
    say("\n".join(lines))


def compile_line(compile: dict) -> str:
    """--compile's summary line: e.g. "4 step shapes compiled in 95.1s; 120.3s of eager step forwards"."""
    line = (f"  compile    {compile['compiled_shapes']} step shapes compiled in {compile['compile_seconds']:.1f}s; "
            f"{compile['eager_seconds']:.1f}s of eager step forwards")
    return line + "".join(f"; {problem}" for problem in compile["dynamic_cache"])


def dry_run(cfg: RunConfig, stop: StopSignals) -> int:
    """Check the input, count rows and errors and show the batches, loading no weights (a stop
    signal ends it: Stopped, 75)."""
    tokenizer = load_tokenizer(cfg.target)
    record_maker(cfg, tokenizer)  # refuses --keep-fields that clash with the output's own
    context = models_context(cfg)
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
