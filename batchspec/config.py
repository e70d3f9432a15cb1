"""One object holding every run option; the CLI fills it, the job reads it."""

import hashlib
import json
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

NGRAM = "ngram"  # --draft ngram: prompt lookup drafting, no draft model
SUFFIX = "suffix"  # --draft suffix: the job's earlier completions and the row's own text, no draft model
LOOKUPS = (NGRAM, SUFFIX)  # the model-free drafters --draft names

FINGERPRINT_FIELDS = (
    "target", "draft", "ngram", "suffix", "ngram_min", "ngram_max", "mode", "gamma", "gamma_max", "max_new_tokens",
    "temperature", "top_k", "top_p", "min_p", "seed", "stop", "min_new_tokens", "repetition_penalty",
    "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "n", "dtype", "json_schema", "regex", "choice",
    "grammar",
    "split", "subset", "prompt_field", "id_field", "messages_field", "tools_field", "chat", "system", "chat_template",
    "chat_template_kwargs", "continue_final_message", "trust_request_chat_template", "truncate", "max_line_bytes",
    "token_ids", "trace",
    "output_format", "keep_fields", "keep_all_fields", "num_shards", "shard_index",
)  # what changes the records (or which rows a shard holds); batch size, window and device only change the speed


@dataclass(frozen=True)
class RunConfig:
    input: str
    out: str
    target: str | None = None  # None: the embedded default pair
    draft: str | None = None  # a draft model, or "ngram": prompt lookup, no model
    more_drafts: tuple[str, ...] = ()  # --draft again: more draft models, their chains checked as one tree
    ngram: bool = False  # with a draft model: n-gram lookup where a row has a match (hybrid)
    suffix: bool = False  # with a draft model: the suffix index where it is confident (hybrid)
    ngram_min: int = 2  # n-gram sizes looked up, longest first
    ngram_max: int = 4
    mode: str = "spec"  # "spec" or "ar"
    gamma: int | str = "auto"  # draft proposals per step, or "auto": chosen each step, 0..gamma_max
    gamma_max: int = 8
    tree_width: int = 1  # > 1: the draft proposes trees this wide (greedy only; no output change)
    tree_depth: int | None = None  # the trees' fixed depth (None: gamma's, auto or fixed)
    max_new_tokens: int = 256
    temperature: float | None = None  # None: from the target's generation_config
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int = 0
    stop: tuple[str, ...] = ()  # stop strings, for every row (a request's own replace them)
    min_new_tokens: int = 0
    repetition_penalty: float | None = None  # None: from the target's generation_config
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[str, ...] = ()  # "ID=BIAS" each
    logprobs: int | None = None  # each token's logprob and the top k
    json_schema: str | None = None  # a JSON schema file every row's output matches (a request's own replaces it)
    regex: str | None = None  # a regex every row's output matches
    choice: str | None = None  # "a,b,c": every row's output is one of them
    grammar: str | None = None  # a Lark or GBNF grammar file every row's output matches
    n: int = 1  # completions per row (a request's own n replaces it)
    batch_size: int = 8
    max_batch_tokens: int | None = None
    window: int = 1024
    dtype: str = "auto"
    device: str = "auto"
    devices: str | None = None  # "cuda:0,cuda:1": one worker process per device (workers.py)
    compile: bool = False  # static caches and compiled step forwards (decoding/compiled.py)
    compile_after: float = 30.0  # eager seconds at a step shape before it compiles
    engine: str = "local"  # "local": this process (or --devices' workers); "ray": Ray Data actors (ray.py)
    ray_address: str | None = None  # the Ray cluster to join ("auto": this machine's); None: start a local one
    workers: int = 1  # Ray actors, each holding the models
    gpus_per_worker: float | None = None  # None: 1 where the cluster has GPUs, else 0
    split: str = "train"  # for dataset inputs
    subset: str | None = None
    prompt_field: str = "prompt"
    id_field: str = "id"
    messages_field: str = "messages"
    tools_field: str | None = None  # a field of tools rendered with each chat row
    chat: bool = False  # wrap plain prompts as one user message
    system: str | None = None  # system message for chats that have none
    chat_template: str | None = None  # a Jinja file replacing the tokenizer's chat template
    chat_template_kwargs: str | None = None  # a JSON object of extra template variables, e.g. enable_thinking
    continue_final_message: bool = False  # chats end in an open assistant message to continue
    trust_request_chat_template: bool = False  # render a request's own chat_template (bounded) instead of refusing it
    truncate: str | None = None  # None, "left" or "right"
    max_line_bytes: int | None = None  # longer input lines are too_long error records (None: from the context)
    token_ids: bool = False
    trace: bool = False  # each record's stats get its steps, for `batchspec report`
    output_format: str = "batchspec"  # or "openai" (OpenAI-batch output lines)
    keep_fields: tuple[str, ...] = ()  # input fields copied into each record
    keep_all_fields: bool = False
    num_shards: int | None = None  # None: from a SLURM array, else 1
    shard_index: int | None = None
    overwrite: bool = False
    dry_run: bool = False
    progress: bool = True

    def options(self) -> dict:
        return asdict(self)

    def run_options(self) -> dict:
        """options() as `batchspec run --config` reads them back: several drafts as one list."""
        options = self.options()
        more = options.pop("more_drafts")
        if more:
            options["draft"] = [options["draft"], *more]
        return options

    def fingerprint(self) -> dict:
        """What a resumed run must share with the run that started OUT."""
        options = self.options()
        fingerprint = {"options": {k: options[k] for k in FINGERPRINT_FIELDS}, "input": input_identity(self.input)}
        for name in ("chat_template", "json_schema", "grammar"):  # what the file says, not only where it is
            if getattr(self, name) is not None:
                fingerprint[name] = file_identity(getattr(self, name))
        return orjson.loads(orjson.dumps(fingerprint))  # as it reads back from JSON (tuples are lists)

    def input_files(self) -> list[str]:
        """The files this run reads rows and settings from (OUT must be none of them)."""
        return [path for path in (self.input, self.chat_template, self.json_schema, self.grammar) if path]

    @property
    def draft_model(self) -> str | None:
        """The draft model to load: none for --mode ar, --draft ngram or --draft suffix."""
        return self.draft if self.mode == "spec" and self.draft not in LOOKUPS else None

    @property
    def lookup(self) -> str | None:
        """The model-free drafter, alone (--draft ngram|suffix) or beside a model (--ngram, --suffix)."""
        if self.mode != "spec":
            return None
        return self.draft if self.draft in LOOKUPS else NGRAM if self.ngram else SUFFIX if self.suffix else None

    @property
    def ngram_sizes(self) -> tuple[int, int] | None:
        """(n_min, n_max) when a lookup drafts: n-gram sizes, or those the suffix drafter looks a
        row's own text up with."""
        return (self.ngram_min, self.ngram_max) if self.lookup else None


STDIN = "-"  # INPUT "-": standard input


def is_stream(path: str) -> bool:
    """Standard input, a FIFO or another file that can be read only once, front to back."""
    if path == STDIN:
        return True
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def input_identity(source: str) -> dict:
    """What the input is: a Hub dataset's name; for a file its size and a hash of its first and
    last 64 KiB (cheap, changes when the data does, survives moving it); for a dataset folder
    the same for each of its files."""
    if source.startswith("hf:"):
        return {"dataset": source.removeprefix("hf:")}
    if is_stream(source):  # read once, front to back: only its name is known up front
        return {"stream": source}
    if os.path.isdir(source):
        root = Path(source)
        files = sorted(p for p in root.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.parts))
        return {"files": {str(p.relative_to(root)): file_identity(p) for p in files}}
    return file_identity(source)


def file_identity(path, sample: int = 1 << 16) -> dict:
    size = os.path.getsize(path)
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        digest.update(f.read(sample))
        if size > sample:
            f.seek(max(sample, size - sample))
            digest.update(f.read(sample))
    return {"size": size, "blake2b_head_tail": digest.hexdigest()}


def as_toml(options: dict) -> str:
    """The resolved options as a TOML file that --config reads back (unset ones commented)."""
    lines = []
    for key, value in options.items():
        if value is None:
            lines.append(f"# {key} = (unset)")
        elif isinstance(value, bool):
            lines.append(f"{key} = {str(value).lower()}")
        elif isinstance(value, (list, tuple)):
            lines.append(f"{key} = [{', '.join(json.dumps(v) for v in value)}]")
        elif isinstance(value, str):
            lines.append(f"{key} = {json.dumps(value)}")
        else:
            lines.append(f"{key} = {value}")
    return "\n".join(lines)
