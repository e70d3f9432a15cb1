"""Ray Data as the engine past one machine.

`GenerateStage` is a class-based `map_batches` stage: each actor loads the models once (a
Generator) and turns batches of rows into records. Use it in your own pipeline:

    ds = ray.data.read_parquet("s3://bucket/prompts/")
    ds = ds.map_batches(GenerateStage, fn_constructor_kwargs={"target": "...", "max_new_tokens": 256},
                        batch_size=1024, concurrency=8, num_gpus=1)
    ds.write_parquet("s3://bucket/completions/")

`batchspec run INPUT --out OUT --engine ray` (run_on_ray) builds that pipeline around its own
files: this process reads INPUT (resume: the ids already in OUT are skipped), the actors decode,
and this process writes every record into OUT as it comes back, durably, as a plain run does.
Ray restarts a lost actor and retries its batch; a run stopped or killed resumes like any other.
"""

import logging
import os
from dataclasses import replace

import orjson

from batchspec.api import (ROWS, Generator, as_columns, check_options, line_cap, models_context,
                           with_default_models)
from batchspec.config import RunConfig
from batchspec.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_ROW_ERRORS, StopSignals, Stopped, UsageError, say
from batchspec.merge import row_stats
from batchspec.sink import Sink, write_atomic
from batchspec.sources import RowError, input_size
from batchspec.stats import RunStats, progress_bar

LINE, ROW = "batchspec_line", "batchspec_row"  # run_on_ray's columns: a row's input line and its JSON text
RECORD, FAILED = "record", "failed"  # the stage's JSON record (or error record), and which ones are errors


def ray_module():
    """ray, or a UsageError naming the extra that installs it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise UsageError("--engine ray needs Ray Data: pip install 'batchspec[ray]'") from None
    return ray


class GenerateStage:
    """A map_batches stage: columns shaped like input lines in (prompt, messages, id, OpenAI-batch
    custom_id and body, ...), the same columns out with `completion`, `finish_reason` and `error`
    added (as Generator.map gives them) and `record`, each row's whole record (or error record)
    as JSON text. Built with a RunConfig or batchspec run's options as keywords."""

    def __init__(self, config: RunConfig | None = None, **options):
        self.generator = Generator(config, **options)

    def __call__(self, batch) -> dict:
        columns = batch_columns(batch)
        if ROW in columns:  # run_on_ray's rows: their JSON text and input lines
            rows = [orjson.loads(text) for text in columns[ROW]]
            results = list(self.generator.results(rows, lines=[int(n) for n in columns[LINE]], ordered=False))
            return {RECORD: [orjson.dumps(r.record).decode() for r in results], FAILED: [r.failed for r in results]}
        names = list(columns)
        rows = [dict(zip(names, values)) for values in zip(*columns.values())]
        records = list(self.generator.generate(rows))
        mapped = as_columns(records, self.generator.config.n)
        return {**columns, **mapped, RECORD: [orjson.dumps(r).decode() for r in records]}


def batch_columns(batch) -> dict[str, list]:
    """A Ray Data batch in any of its formats (numpy, pandas, pyarrow) as lists of Python values."""
    if hasattr(batch, "to_pydict"):  # a pyarrow Table
        return batch.to_pydict()
    if hasattr(batch, "to_dict"):  # a pandas DataFrame
        return batch.to_dict("list")
    return {name: values.tolist() if hasattr(values, "tolist") else list(values) for name, values in batch.items()}


def run_on_ray(cfg: RunConfig, stop: StopSignals) -> int:
    """`batchspec run --engine ray`: OUT locked, claimed and resumed here; decoding on Ray actors."""
    from batchspec.job import check_input, opened_out, with_shard  # (imports torch: only once the run starts)

    ray = ray_module()
    cfg = with_shard(with_default_models(cfg))
    check_input(cfg)
    check_options(cfg)
    if cfg.devices:
        raise UsageError("--engine ray places its workers itself: drop --devices (one GPU per worker: "
                         "--gpus-per-worker 1)")
    with opened_out(cfg) as sink:
        join_cluster(ray, cfg.ray_address)
        stop.take_back()
        try:
            return decode_on_ray(ray, cfg, sink, stop)
        finally:
            ray.shutdown()


def join_cluster(ray, address: str | None) -> None:
    """Join the cluster at `address` (auto: the one this machine belongs to), or start a local one."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")  # batchspec says what the run did; Ray's logs keep the rest
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR", configure_logging=False)
    except ConnectionError as e:
        raise UsageError(f"cannot join the Ray cluster at {address}: {e} (a cluster with token authentication "
                         "needs RAY_AUTH_MODE=token and its token here)") from None
    for name in ("ray", "ray.data"):
        logging.getLogger(name).setLevel(logging.ERROR)
    ray.data.DataContext.get_current().enable_progress_bars = False


def pending_rows(cfg: RunConfig, sink: Sink, stats: RunStats) -> list[dict]:
    """The input's rows not in OUT yet, as (line, JSON text); its bad lines go to the error file."""
    from batchspec.job import shard_items  # (the job's module imports torch: only once the run starts)

    rows = []
    for item in shard_items(cfg, line_cap(cfg, models_context(cfg))):
        if sink.is_done(item):
            stats.rows_skipped += 1
        elif isinstance(item, RowError):
            sink.error(item)
            stats.rows_error += 1
        else:
            rows.append({LINE: item.line, ROW: orjson.dumps(item.fields).decode()})
    return rows


def decode_on_ray(ray, cfg: RunConfig, sink: Sink, stop: StopSignals) -> int:
    stats = RunStats()
    with stop.waiting():
        rows = pending_rows(cfg, sink, stats)
    bar = progress_bar(input_size(cfg.input, cfg.split, cfg.subset), cfg.progress)
    bar.update(stats.rows_skipped + stats.rows_error)
    interrupted = False
    if rows:
        worker = replace(cfg, input=ROWS, out=ROWS, engine="local", progress=False)
        gpus = cfg.gpus_per_worker if cfg.gpus_per_worker is not None else min(1, ray.cluster_resources().get("GPU", 0))
        records = ray.data.from_items(rows).map_batches(
            GenerateStage, fn_constructor_args=(worker,), batch_size=cfg.window, num_gpus=gpus,
            compute=ray.data.ActorPoolStrategy(size=cfg.workers))
        try:
            for batch in stop.each(records.iter_batches(batch_size=None, batch_format="pyarrow")):
                write_batch(sink, stats, batch.column(RECORD).to_pylist(), batch.column(FAILED).to_pylist())
                bar.update(batch.num_rows)
        except Stopped:
            interrupted = True
    bar.close()
    sink.flush_errors()
    code = EXIT_INTERRUPTED if interrupted else EXIT_ROW_ERRORS if sink.error_lines else EXIT_OK
    summary = {"finished": not interrupted, "exit_code": code, "input": cfg.input, "out": str(sink.paths.out),
               "rows_in_output": len(sink.done), "errors_in_file": len(sink.error_lines), **stats.summary(),
               "engine": {"name": "ray", "workers": cfg.workers, "address": cfg.ray_address},
               "options": cfg.options()}
    write_atomic(sink.paths.summary, orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    say(("interrupted: rerun the same command to resume" if interrupted else "done")
        + f"\n  rows       {stats.rows_ok} ok, {stats.rows_error} errors, {stats.rows_skipped} already done"
        + f"\n  output     {sink.paths.out} (decoded by {cfg.workers} Ray workers)")
    return code


def write_batch(sink: Sink, stats: RunStats, texts: list[str], failed: list[bool]) -> None:
    """One batch of the stage's records into OUT (durably) and its error records into the error file."""
    records = [orjson.loads(text) for text in texts]
    for record in (r for r, bad in zip(records, failed) if bad):
        sink.error(RowError(record["line"], record["id"], record["error"]["type"], record["error"]["message"]))
        stats.rows_error += 1
    good = [r for r, bad in zip(records, failed) if not bad]
    sink.write(good)
    for record in good:
        stats.rows_ok += 1
        stats.rows.add(row_stats(record))
