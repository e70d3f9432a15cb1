"""Command line: parse options into one RunConfig and call the job. The only module using click."""

import json
import math
import os
import sys
import tomllib
import traceback
from pathlib import Path

import click

from batchspec import __version__
from batchspec.config import RunConfig, as_toml
from batchspec.errors import EXIT_INTERRUPTED, StopSignals, Stopped, UserError, first_line


def option(name: str, **kwargs):
    """A --name option that can also come from BATCHSPEC_<NAME>, with its default shown in --help."""
    envvar = "BATCHSPEC_" + name.lstrip("-").split("/")[0].replace("-", "_").upper()
    return click.option(name, envvar=envvar, show_envvar=True, show_default=True, **kwargs)


def load_config_file(ctx, param, path):
    """--config FILE (TOML, keys named like the options, optionally under [run]) sets defaults:
    the command line beats the environment, which beats the file, which beats the defaults."""
    if path is None:
        return None
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise click.BadParameter(f"cannot read {path}: {e}", ctx=ctx, param=param) from None
    data = {k.replace("-", "_"): v for k, v in data.get("run", data).items()}
    unknown = sorted(set(data) - {p.name for p in ctx.command.params} - {"config"})
    if unknown:
        raise click.BadParameter(f"{path} has unknown option(s): {', '.join(unknown)}", ctx=ctx, param=param)
    integers = {p.name for p in ctx.command.params if isinstance(p.type, click.types.IntParamType)}
    loose = sorted(k for k in integers & set(data) if isinstance(data[k], (float, bool)))  # click would cut 3.7 to 3
    if loose:
        raise click.BadParameter(f"{path}: {', '.join(f'{k} = {data[k]!r}' for k in loose)}: give a whole number",
                                 ctx=ctx, param=param)
    if isinstance(data.get("draft"), str):  # --draft may be given several times
        data["draft"] = [data["draft"]]
    if isinstance(data.get("keep_fields"), list):
        data["keep_fields"] = ",".join(data["keep_fields"])
    ctx.default_map = {**(ctx.default_map or {}), **data}
    return path


class File(click.Path):
    """An existing regular file: a FIFO or a device given as a settings file would block the run
    or feed it without end."""

    def __init__(self):
        super().__init__(exists=True, dir_okay=False)

    def convert(self, value, param, ctx):
        path = super().convert(value, param, ctx)
        if not os.path.isfile(path):
            self.fail(f"{path!r} is not a regular file", param, ctx)
        return path


class Finite(click.FloatRange):
    """A FloatRange that also refuses nan and inf (no comparison refuses nan)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class Gamma(click.ParamType):
    """--gamma: "auto" or a whole number of draft proposals per step, 1..64."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        if value == "auto":
            return value
        return click.IntRange(1, 64).convert(value, param, ctx)


class Bias(click.ParamType):
    """--logit-bias ID=BIAS: a token id and a number in [-100, 100] added to its logit."""

    name = "ID=BIAS"

    def convert(self, value, param, ctx):
        token, _, bias = str(value).partition("=")
        try:
            token_id, number = int(token), float(bias)
        except ValueError:
            self.fail(f"expected ID=BIAS (e.g. 50256=-100), got {value!r}", param, ctx)
        if token_id < 0 or not -100 <= number <= 100:
            self.fail(f"need a token id >= 0 and a bias in [-100, 100], got {value!r}", param, ctx)
        return f"{token_id}={number:g}"


class JsonObject(click.ParamType):
    """--chat-template-kwargs: a JSON object (or a table in --config), kept as canonical JSON text."""

    name = "JSON"

    def convert(self, value, param, ctx):
        try:
            obj = value if isinstance(value, dict) else json.loads(value)
        except ValueError as e:
            self.fail(f"not JSON ({e}): {value!r}", param, ctx)
        if not isinstance(obj, dict):
            self.fail(f"expected a JSON object, e.g. '{{\"enable_thinking\": false}}', got {value!r}", param, ctx)
        return json.dumps(obj, sort_keys=True)


GAMMA_HELP = ("Draft tokens proposed per step: auto chooses 0..--gamma-max before every step from the measured "
              "acceptance and step costs; N fixes it.")


def fail(message: str, error: BaseException, debug: bool, code: int) -> None:
    if debug:
        traceback.print_exception(error)
    click.echo(f"batchspec: {message}", err=True)
    sys.exit(code)


def guarded(job, debug: bool) -> int:
    """Run job(); user errors and crashes become one line on stderr and an exit code."""
    try:
        return job()
    except UserError as e:
        fail(f"error: {e}", e, debug, e.exit_code)
    except (KeyboardInterrupt, Stopped) as e:
        fail("interrupted; rerun the same command to resume", e, debug, EXIT_INTERRUPTED)
    except Exception as e:  # noqa: BLE001 - the one place that turns crashes into a clean exit 1
        fail(f"error: {type(e).__name__}: {first_line(e)} (--debug shows the traceback)", e, debug, 1)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="batchspec")
def main():
    """batchspec: JSONL prompts in, JSONL completions out, by lossless batched speculative decoding."""


@main.command()
@click.option("--config", type=File(), is_eager=True, expose_value=False,
              callback=load_config_file, envvar="BATCHSPEC_CONFIG", show_envvar=True,
              help="TOML file of options (CLI > environment > file > defaults).")
@click.argument("input", envvar="BATCHSPEC_INPUT")
@option("--out", required=True, type=click.Path(dir_okay=False),
        help="Output JSONL (errors, summary beside it); may hold a {shard} placeholder.")
@option("--target", default=None,
        help="Target model: Hub id, local folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct.")
@option("--draft", multiple=True,
        help="Draft model sharing the target's tokenizer, for --mode spec, or 'ngram': prompt lookup, or 'suffix': "
        "the job's earlier completions and the row's own text (no model). "
        "Default: the embedded draft, when the target is the default. Given again: more draft models, each "
        "proposing a chain, checked together as one tree (greedy only).")
@option("--ngram/--no-ngram", default=False,
        help="With a draft model: propose by n-gram lookup for rows whose context has a match, by the model "
        "elsewhere (hybrid).")
@option("--suffix/--no-suffix", default=False,
        help="With a draft model: propose from the job's earlier completions (and the row's own text) where that "
        "is confident, by the model elsewhere (hybrid).")
@option("--ngram-min", type=click.IntRange(1), default=2, help="Shortest n-gram looked up (--draft ngram, --ngram).")
@option("--ngram-max", type=click.IntRange(1), default=4, help="Longest n-gram looked up; longer matches win.")
@option("--mode", type=click.Choice(["spec", "ar"]), default="spec",
        help="spec: draft proposes, target verifies. ar: the target alone.")
@option("--gamma", type=Gamma(), default="auto", help=GAMMA_HELP)
@option("--gamma-max", type=click.IntRange(1, 64), default=8, help="The most draft tokens --gamma auto proposes.")
@option("--tree-width", type=click.IntRange(1, 64), default=1,
        help="N > 1: the draft proposes a token tree, its N likeliest paths at every depth, verified in one target "
        "forward (greedy only; batches of sampled requests draft a chain).")
@option("--tree-depth", type=click.IntRange(1, 64), default=None,
        help="The trees' fixed depth. Default: --gamma's (auto chooses 0..--gamma-max).")
@option("--max-new-tokens", type=click.IntRange(1), default=256, help="Most tokens generated per row.")
@option("--temperature", type=Finite(0), default=None,
        help="0 = greedy. Default: the target's generation_config (greedy unless it samples).")
@option("--top-k", type=click.IntRange(0), default=None, help="Top-k filter, 0 = off. Default: generation_config.")
@option("--top-p", type=Finite(0, 1, min_open=True), default=None,
        help="Nucleus filter, 1 = off. Default: generation_config.")
@option("--min-p", type=Finite(0, 1), default=None,
        help="Drop tokens less likely than this times the likeliest, 0 = off. Default: generation_config.")
@option("--seed", type=click.IntRange(-(2**63), 2**63 - 1), default=0,  # 64 bits: it is written in the summary
        help="With the row id, seeds each row's own sampling.")
@option("--stop", multiple=True, default=(),
        help="Stop string (repeatable): a row ends right before the first one in its text.")
@option("--min-new-tokens", type=click.IntRange(0), default=0, help="No EOS or stop id before this many tokens.")
@option("--repetition-penalty", type=Finite(0, min_open=True), default=None,
        help="transformers' repetition penalty on prompt and output tokens, 1 = off. Default: generation_config.")
@option("--frequency-penalty", type=Finite(-2, 2), default=0.0,
        help="OpenAI's: minus this times each token's count in the output.")
@option("--presence-penalty", type=Finite(-2, 2), default=0.0,
        help="OpenAI's: minus this for each token already in the output.")
@option("--logit-bias", type=Bias(), multiple=True, default=(), help="ID=BIAS added to a token's logit (repeatable).")
@option("--n", type=click.IntRange(1, 128), default=1,
        help="Completions per row, each sampled on its own (the prompt is prefilled once).")
@option("--logprobs", type=click.IntRange(0, 20), default=None,
        help="Record each token's logprob (the target's raw log-softmax) and the top K.")
@option("--json-schema", type=File(), default=None,
        help="A JSON schema file every row's output matches (compact JSON); a request's own response_format wins.")
@option("--regex", default=None, help="A regular expression every row's output matches.")
@option("--choice", default=None, help="Comma-separated texts: every row's output is one of them.")
@option("--grammar", type=File(), default=None,
        help="A Lark or GBNF grammar file every row's output matches.")
@option("--batch-size", type=click.IntRange(1), default=8, help="Rows per static batch.")
@option("--max-batch-tokens", type=click.IntRange(1), default=None,
        help="Budget per batch: rows x (longest prompt + max new tokens).")
@option("--window", type=click.IntRange(1), default=1024, help="Rows read, sorted by length and batched at a time.")
@option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
        help="auto: bfloat16 on a GPU that has it, float32 on CPU.")
@option("--device", default="auto", help="auto, cpu, cuda or cuda:N.")
@option("--compile", is_flag=True, default=False,
        help="Static caches and compiled step forwards (torch.compile; CUDA graphs on a GPU). Each step shape "
        "compiles once its eager forwards have cost --compile-after seconds.")
@option("--compile-after", type=click.FloatRange(0), default=30.0,
        help="With --compile: eager seconds at a step shape before it compiles (0: at once).")
@option("--devices", default=None,
        help="Comma-separated devices (cuda:0,cuda:1,...): one worker process each, a shard apiece, merged "
        "into OUT at the end.")
@option("--engine", type=click.Choice(["local", "ray"]), default="local",
        help="local: this process (or --devices' workers); ray: Ray Data actors on a Ray cluster (pip install "
        "'batchspec[ray]'), records merged into OUT here.")
@option("--ray-address", default=None,
        help="With --engine ray: the cluster to join (auto: the one this machine is part of). Default: a local one.")
@option("--workers", type=click.IntRange(1), default=1, help="With --engine ray: actors, each holding the models.")
@option("--gpus-per-worker", type=Finite(0), default=None,
        help="With --engine ray: GPUs each actor takes. Default: 1 where the cluster has GPUs, else 0.")
@option("--split", default="train", help="Dataset split, for dataset inputs.")
@option("--subset", default=None, help="Dataset configuration (subset), for dataset inputs.")
@option("--prompt-field", default="prompt", help="Input field holding the prompt text.")
@option("--id-field", default="id", help="Input field holding the row id (else the line number).")
@option("--messages-field", default="messages",
        help="Input field holding a chat ([{role, content}]), used when a row has no prompt.")
@option("--tools-field", default=None,
        help="Input field holding a chat row's tools (a list of OpenAI function tools, or it as JSON text).")
@option("--chat", is_flag=True, default=False, help="Wrap plain prompts as one user message (chat template).")
@option("--system", default=None, help="System message added to every chat that has none.")
@option("--chat-template", type=File(), default=None,
        help="Jinja chat template file replacing the tokenizer's (a request's chat_template replaces both).")
@option("--chat-template-kwargs", type=JsonObject(), default=None,
        help="JSON object of extra chat template variables, e.g. '{\"enable_thinking\": false}' (a request's "
        "own are merged over it).")
@option("--continue-final-message", is_flag=True, default=False,
        help="Leave each chat's final (assistant) message open and continue it instead of opening a new turn.")
@option("--trust-request-chat-template", is_flag=True, default=False,
        help="Render a request's own chat_template (in a child process, bounded in time, memory and output) "
        "instead of refusing the row: the template is code its author wrote.")
@option("--truncate", type=click.Choice(["left", "right"]), default=None,
        help="Cut prompts too long for the context (left keeps the end) instead of an error record.")
@option("--max-line-bytes", type=click.IntRange(1), default=None,
        help="Input lines (and prompts) longer than this are too_long error records, never parsed. Default: 64 "
        "bytes per token of the models' context, plus 1 MiB.")
@option("--token-ids", is_flag=True, default=False, help="Add the generated token ids to each record.")
@option("--trace", is_flag=True, default=False,
        help="Add each row's steps to its stats (proposals, accepted, token offsets), for `batchspec report`.")
@option("--output-format", type=click.Choice(["batchspec", "openai"]), default="batchspec",
        help="Record schema: batchspec's own, or OpenAI-batch output lines (custom_id, response, error).")
@option("--keep-fields", default="", help="Comma-separated input fields copied into each record.")
@option("--keep-all-fields", is_flag=True, default=False, help="Copy every input field into each record.")
@option("--num-shards", type=click.IntRange(1), default=None,
        help="Split the input into N shards by a stable hash of the row id. Default: SLURM array size, else 1.")
@option("--shard-index", type=click.IntRange(0), default=None,
        help="This run's shard, 0..N-1. Default: SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN.")
@option("--overwrite", is_flag=True, default=False, help="Start OUT over instead of resuming it.")
@option("--dry-run", is_flag=True, default=False, help="Check the input and show batches; load no weights.")
@option("--progress/--no-progress", default=True, help="Progress bar on stderr.")
@option("--print-config", is_flag=True, default=False, help="Print the resolved options as TOML and exit.")
@option("--debug", is_flag=True, default=False, help="Show tracebacks.")
def run(input, debug, print_config, **options):
    """Complete every prompt of INPUT into OUT, resuming OUT if it exists.

    INPUT is a JSONL file (or .jsonl.gz), - for standard input (or a FIFO: read once, as a
    stream), a local folder laid out like a Hugging Face dataset repository, or hf:OWNER/NAME
    (streamed with datasets).

    Exit codes: 0 all rows done; 3 done, some rows in the error file; 75 interrupted (rerun to
    resume); 2 usage error; 1 any other failure.
    """
    keep = tuple(name.strip() for name in options.pop("keep_fields").split(",") if name.strip())
    drafts = options.pop("draft")
    config = RunConfig(input=input, keep_fields=keep, draft=drafts[0] if drafts else None, more_drafts=drafts[1:],
                       **options)
    if print_config:
        click.echo(as_toml(config.run_options()))
        sys.exit(0)
    if config.devices and not config.dry_run:
        from batchspec.workers import run_on_devices  # the workers load the models; this process merges

        sys.exit(guarded(lambda: run_on_devices(config), debug))
    if config.engine == "ray" and not config.dry_run:
        with StopSignals() as stop:
            from batchspec.ray import run_on_ray  # the actors load the models; this process writes OUT

            sys.exit(guarded(lambda: run_on_ray(config, stop), debug))
    with StopSignals() as stop:  # a stop while torch and transformers load ends the run before its first batch
        from batchspec import job  # torch and transformers load only once the options are fine

        sys.exit(guarded(lambda: job.run(config, stop), debug))


def int_list(text: str, name: str) -> list[int]:
    """"1,4,8" -> [1, 4, 8], each at least 1."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=name) from None
    if min(values) < 1:
        raise click.BadParameter(f"every value must be at least 1, got {text!r}", param_hint=name)
    return values


@main.command()
@option("--target", default=None, help="Target model. Default: the embedded SmolLM2-135M-Instruct.")
@option("--draft", default=None, help="Draft model. Default: the embedded draft.")
@option("--prompts", type=File(), default="sample_data/prompts.jsonl",
        help="JSONL rows to take prompts from.")
@option("--rows", type=click.IntRange(1), default=None,
        help="Prompts decoded by every method at every batch size (cycled from the file). Default: the largest "
        "batch size.")
@option("--batch-sizes", default="1,4,8", help="Comma-separated batch sizes.")
@option("--drafters", default="model,ngram,hybrid",
        help="Comma-separated drafters run with --gamma auto: model (the draft), ngram (prompt lookup), hybrid, "
        "suffix (the earlier completions of the same pass), suffix-hybrid (suffix beside the model).")
@option("--gammas", default="1,3,5,8", help="Comma-separated fixed gammas of the draft model ('' for none).")
@option("--tree-widths", default="",
        help="Comma-separated tree widths: the draft's trees at each fixed gamma (as depth) and with auto, beside "
        "its chains.")
@option("--ngram-min", type=click.IntRange(1), default=2, help="Shortest n-gram looked up.")
@option("--ngram-max", type=click.IntRange(1), default=4, help="Longest n-gram looked up.")
@option("--gamma-max", type=click.IntRange(1, 64), default=8, help="The most draft tokens auto proposes.")
@option("--max-new-tokens", type=click.IntRange(1), default=64, help="Most tokens generated per row.")
@option("--repeats", type=click.IntRange(1), default=2,
        help="Timed passes over the batches (see --interleave); each batch's fastest run counts (tok/s), "
             "and methods' speeds are compared pass by pass.")
@option("--min-runs", type=click.IntRange(1), default=4,
        help="Each method's timed runs of a batch at every batch size, at least: passes are added at a batch size "
        "with fewer batches than that over --repeats (one batch's runs move by 10-15 % on a noisy machine).")
@option("--interleave", type=click.Choice(["step", "batch"]), default="step",
        help="step: the methods decode each batch in lockstep, a step at a time, so that the machine's phases "
        "slow them alike; batch: each decodes it whole in turn (holds one batch's caches at a time).")
@option("--compile", is_flag=True, default=False,
        help="Also transformers' generate on a static cache with a compiled forward, and ar and spec auto with "
        "compiled step forwards.")
@option("--compile-after", type=click.FloatRange(0), default=0.0,
        help="With --compile: eager seconds at a step shape before it compiles. 0: when first met, mostly in the "
        "warm-up batch, so that no compile runs beside the other cells' timed steps; 30: as a run does.")
@option("--control", is_flag=True, default=False,
        help="Also ar again, side by side with ar: its speed over ar is how far the machine's noise moves a ratio.")
@option("--with-options", is_flag=True, default=False,
        help="Also ar and spec auto with every logits processor (too weak to change a token) and 5 logprobs.")
@option("--samples", type=click.IntRange(1, 128), default=1,
        help="N > 1: also ar over rows that repeat each prompt N times, prefilled once (as n: N) and each.")
@option("--json-schema", type=File(), default=None,
        help="A JSON schema file: also ar and spec auto (with and without jump-forward) with every row's output "
             "constrained by it.")
@option("--out-dir", type=click.Path(file_okay=False), default=None,
        help="Also write results.csv, results.json (every pass, mismatches) and PNG plots here.")
@option("--write-config", type=click.Path(dir_okay=False), default=None,
        help="Write the fastest setting per batch size as a --config TOML (several sizes: FILE-b<N>.toml).")
@option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto", help="Model dtype.")
@option("--device", default="auto", help="auto, cpu, cuda or cuda:N.")
@option("--debug", is_flag=True, default=False, help="Show tracebacks.")
def bench(debug, batch_sizes, drafters, gammas, tree_widths, compile, compile_after, **options):
    """Greedy tokens/s of spec (the draft at fixed gammas, and each drafter with auto) vs ar vs
    transformers' generate, assisted generation and prompt lookup, side by side in one process,
    with acceptance, the gammas auto chose and the speed-up the measured acceptance and step
    costs promise."""
    from batchspec.bench import DRAFTERS, bench as run_bench

    sizes, fixed = int_list(batch_sizes, "--batch-sizes"), int_list(gammas, "--gammas") if gammas else []
    widths = tuple(int_list(tree_widths, "--tree-widths")) if tree_widths else ()
    kinds = [kind.strip() for kind in drafters.split(",") if kind.strip()]
    if not kinds or set(kinds) - set(DRAFTERS):
        raise click.BadParameter(f"expected some of {', '.join(DRAFTERS)}, got {drafters!r}", param_hint="--drafters")
    if compile_after and not compile:
        raise click.BadParameter("says when --compile compiles: give --compile too", param_hint="--compile-after")

    def job():
        click.echo(run_bench(batch_sizes=sizes, drafters=kinds, gammas=fixed, tree_widths=widths,
                             compile=compile_after if compile else None, **options))
        return 0

    sys.exit(guarded(job, debug))


@main.command()
@click.argument("shards")
@option("--out", required=True, type=click.Path(dir_okay=False), help="The merged output JSONL.")
@option("--allow-partial", is_flag=True, default=False, help="Merge even if a shard is missing or unfinished.")
@option("--overwrite", is_flag=True, default=False,
        help="Replace OUT even when it is not an earlier merge's output.")
@option("--order-by-input", type=click.Path(exists=True), default=None,
        help="Write records in the order of this input (the shards' INPUT).")
@option("--debug", is_flag=True, default=False, help="Show tracebacks.")
def merge(shards, out, allow_partial, overwrite, order_by_input, debug):
    """Combine the outputs of a sharded run into OUT (atomic: written aside, then renamed).

    SHARDS is the --out template the shard runs used, e.g. 'out/part-{shard:05d}.jsonl'.
    Exit codes: 0 merged; 3 a shard is missing or unfinished (see --allow-partial).
    """
    from batchspec.merge import merge as merge_shards

    def job():
        summary = merge_shards(shards, out, allow_partial=allow_partial, order_by_input=order_by_input,
                               overwrite=overwrite)
        click.echo(f"merged {len(summary['shards'])} shards into {out}: {summary['rows_ok']} rows, "
                   f"{summary['rows_error']} errors", err=True)
        return 0

    sys.exit(guarded(job, debug))


@main.command()
@click.argument("out")
@option("--debug", is_flag=True, default=False, help="Show tracebacks.")
def status(out, debug):
    """Rows done, errors, rows remaining, acceptance, tokens/s and state of OUT, or of every
    shard of a sharded run ('out/part-{shard:05d}.jsonl'). Reads files only: safe while running."""
    from batchspec.status import status as shard_states, table

    def job():
        states = shard_states(out)
        click.echo(table(states) if states else f"no shard of {out!r} has started (no file matches it)")
        return 0

    sys.exit(guarded(job, debug))


@main.command()
@click.argument("out")
@option("--html", type=click.Path(dir_okay=False), default=None,
        help="The page to write. [default: OUT's name with .report.html]")
@option("--rows", type=click.IntRange(0, 100_000), default=200, help="Rows shown token by token (a uniform sample).")
@option("--seed", type=int, default=0, help="Seed of the row sample.")
@option("--debug", is_flag=True, default=False, help="Show tracebacks.")
def report(out, html, rows, seed, debug):
    """One self-contained HTML page about a run's OUT (opens from disk, no network): summary,
    throughput and acceptance over the run, histograms, errors by type with examples, and rows
    whose tokens are coloured by origin (draft accepted, target corrected, bonus). Throughput and
    the token view need records written with `batchspec run --trace`."""
    from batchspec.report import report as write_report

    def job():
        path, found = write_report(out, html, rows, seed)
        click.echo(f"wrote {path}: {found.records} rows ({len(found.sampled)} shown), "
                   f"{sum(found.errors.values())} errors", err=True)
        return 0

    sys.exit(guarded(job, debug))
