"""Rows in: a JSONL file (plain or .gz) read line by line, in constant memory.

Every non-blank line becomes either a Row or a RowError; nothing here stops the job.
"""

import gzip
import json
import os
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import orjson

from batchspec.chat import CHAT_KEYS, chat_request
from batchspec.config import STDIN, is_stream
from batchspec.errors import UsageError, first_line
from batchspec.idset import IdSet
from batchspec.request_body import HONORED_KEYS, body_problem, request_options

BOM = b"\xef\xbb\xbf"


@dataclass
class Row:
    id: str
    line: int  # 1-based line number in the input
    prompt: str | None  # raw text to complete, or None for a chat row
    fields: dict = field(repr=False)  # the whole input object
    messages: list[dict] | None = None  # [{role, content}, ...] for a chat row
    options: dict = field(default_factory=dict)  # per-row RowOptions and SamplingParams fields (request_options)
    chat: dict = field(default_factory=dict)  # per-row TemplateOptions fields (chat_request)
    endpoint: str | None = None  # an OpenAI-batch request's url
    unapplied: tuple[str, ...] = ()  # a plain row's fields named like request options: data, not options


@dataclass(frozen=True)
class Fields:
    """Which input fields hold what."""

    prompt: str = "prompt"
    id: str = "id"
    messages: str = "messages"
    tools: str | None = None  # a field of tools for the row's chat (--tools-field)


@dataclass
class RowError:
    line: int
    id: str | None
    type: str
    message: str

    def record(self) -> dict:
        return {"id": self.id, "line": self.line, "error": {"type": self.type, "message": self.message}}


def open_input(path: str):
    raw = sys.stdin.buffer if path == STDIN else open(path, "rb")
    return gzip.open(raw, "rb") if str(path).endswith(".gz") else raw


def count_lines(path: str) -> int | None:
    """Non-blank line count of a plain file, for the progress bar (None for .gz and streams: not
    worth a pass, or not possible)."""
    if str(path).endswith(".gz") or is_stream(path):
        return None
    count = 0
    with open(path, "rb") as f:
        for line in f:
            count += bool(line.strip())
    return count


def parse_json(text: str):
    """orjson's parse, with trailing garbage told apart from plainly invalid JSON."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as e:
        stripped = text.strip()
        try:
            _, end = json.JSONDecoder().raw_decode(stripped)
        except RecursionError:
            raise ValueError("invalid_json", "the JSON value is nested too deeply") from None
        except json.JSONDecodeError:
            end = len(stripped)
        if end == len(stripped):  # no value before the error, or one only Python's json takes (NaN, "\ud800")
            raise ValueError("invalid_json", str(e)) from None
        raise ValueError("trailing_data", f"unexpected data after the JSON value at column {end + 1}") from None


def json_type(value) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def row_id(obj: dict, id_field: str, line: int) -> str:
    """The row's id: its id field (a string or an integer), or its line number when absent.
    Always a string, so that one output file never mixes id types (5 and "5" are one id)."""
    value = obj.get(id_field)
    if value is None:
        return str(line)
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        got = json_type(value)
        if type(value) is float:  # orjson reads an integer past 64 bits as a float
            got = f"{value!r}, a fraction or an integer past 64 bits: give the id as a string"
        raise ValueError("invalid_id", f"{id_field!r} must be a non-empty string or an integer, got {got}")
    return str(value)


def check_messages(messages, name: str) -> str | None:
    """Why `messages` is not a chat, or None when it is (its contents are checked as it is
    rendered: chat.render)."""
    if not isinstance(messages, list) or not messages:
        return f"field {name!r} must be a non-empty list of {{role, content}} objects"
    for k, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            return f"{name}[{k}] must be an object with a string 'role'"
    return None


def parse_line(raw: bytes, line: int, fields: Fields) -> Row | RowError:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return RowError(line, None, "invalid_utf8", f"invalid UTF-8 byte 0x{raw[e.start]:02x} at byte {e.start + 1}")
    try:
        obj = parse_json(text)
        orjson.dumps(obj)  # what a record copies from it must write back: orjson writes 254 levels deep at most
    except orjson.JSONEncodeError:
        return RowError(line, None, "invalid_json", "the JSON value is nested too deeply (over 254 levels)")
    except ValueError as e:
        return RowError(line, None, *e.args)
    return parse_object(obj, line, fields)


OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")


def parse_request(obj: dict, line: int) -> Row | RowError:
    """An OpenAI-batch request line: custom_id, method, url and body."""
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return RowError(line, None, "invalid_id", "'custom_id' must be a non-empty string")
    url, method = obj.get("url", OPENAI_URLS[0]), obj.get("method", "POST")
    if url not in OPENAI_URLS or method != "POST":
        return RowError(line, custom_id, "invalid_request",
                        f"unsupported request {method} {url}; batchspec serves POST {' and '.join(OPENAI_URLS)}")
    body = obj["body"]
    if not isinstance(body, dict):
        return RowError(line, custom_id, "invalid_request", f"'body' must be an object, got {json_type(body)}")
    input_key = "messages" if url == OPENAI_URLS[0] else "prompt"
    problem = body_problem(body, input_key)
    if problem:
        return RowError(line, custom_id, "invalid_request", problem)
    try:
        options = request_options(body, chat=input_key == "messages")
        chat = chat_request(body) if input_key == "messages" else {}
    except ValueError as e:
        return RowError(line, custom_id, "invalid_request", str(e))
    if input_key == "messages":
        problem = check_messages(body.get("messages"), "body.messages")
        if problem:
            return RowError(line, custom_id, "invalid_messages", problem)
        return Row(custom_id, line, None, obj, messages=body["messages"], options=options, chat=chat, endpoint=url)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        listed = " (a list of prompts or of token ids is not supported: one request per prompt)"
        return RowError(line, custom_id, "invalid_prompt",
                        f"'body.prompt' must be a string, got {json_type(prompt)}{listed * isinstance(prompt, list)}")
    return Row(custom_id, line, body["prompt"], obj, options=options, endpoint=url)


OPTION_KEYS = HONORED_KEYS | set(CHAT_KEYS)  # a request body's keys that change the output


def unapplied_keys(obj: dict, fields: Fields) -> tuple[str, ...]:
    """The fields of a plain prompt/messages row that a request body would take as options (its
    max_tokens, stop, tools, ...): a plain row's other fields are data (--keep-fields), so these
    are not applied, and the job says so (job.with_warnings)."""
    return tuple(sorted(obj.keys() & OPTION_KEYS - {fields.prompt, fields.messages, fields.id, fields.tools}))


def is_request(obj: dict, fields: Fields) -> bool:
    """An OpenAI-batch request line: a custom_id and a body that is an object, or any body where
    the row has no prompt or messages of its own (a malformed request, not a plain row whose
    data has a text `body`)."""
    own_input = {fields.prompt, fields.messages} & obj.keys()
    return "custom_id" in obj and "body" in obj and (isinstance(obj["body"], dict) or not own_input)


def parse_object(obj, line: int, fields: Fields) -> Row | RowError:
    """One input object (a JSONL line's value, a dataset example) -> Row or RowError."""
    if not isinstance(obj, dict):
        return RowError(line, None, "not_an_object", f"expected a JSON object, got {json_type(obj)}")
    if is_request(obj, fields):
        return parse_request(obj, line)
    try:
        rid = row_id(obj, fields.id, line)
    except ValueError as e:
        return RowError(line, None, *e.args)
    try:
        chat = row_tools(obj.get(fields.tools)) if fields.tools else {}
    except ValueError as e:
        return RowError(line, rid, "invalid_request", f"field {fields.tools!r}: {e}")
    prompt = obj.get(fields.prompt)
    if prompt is None and obj.get(fields.messages) is not None:
        problem = check_messages(obj[fields.messages], fields.messages)
        if problem:
            return RowError(line, rid, "invalid_messages", problem)
        return Row(rid, line, None, obj, messages=obj[fields.messages], chat=chat,
                   unapplied=unapplied_keys(obj, fields))
    if prompt is None:
        what = "is null" if fields.prompt in obj else "is missing"
        return RowError(line, rid, "missing_prompt", f"field {fields.prompt!r} {what} (and no {fields.messages!r})")
    if not isinstance(prompt, str):
        return RowError(line, rid, "invalid_prompt",
                        f"field {fields.prompt!r} must be a string, got {json_type(prompt)}")
    return Row(rid, line, prompt, obj, chat=chat, unapplied=unapplied_keys(obj, fields))


def row_tools(value) -> dict:
    """A --tools-field value (a list of tools, or that list as JSON text, as many datasets keep
    it) as the row's chat options (ValueError when it is neither)."""
    if isinstance(value, str):
        value = orjson.loads(value)  # a JSONDecodeError is a ValueError
    return chat_request({"tools": value})


def unique_ids(items: Iterator[Row | RowError]) -> Iterator[Row | RowError]:
    """A later line reusing an id already seen becomes a duplicate_id error."""
    seen = IdSet()
    for item in items:
        if item.id is not None:
            if item.id in seen:
                item = RowError(item.line, item.id, "duplicate_id", f"id {item.id!r} appears on an earlier line")
            else:
                seen.add(item.id)
        yield item


def capped_lines(f, cap: int) -> Iterator[bytes | int]:
    """The file's lines, each read whole only up to `cap` bytes: a longer line is skipped in
    chunks and stands as its length (an int), so that no line costs more memory than the cap."""
    while line := f.readline(cap + 1):
        yield line if len(line) <= cap or line.endswith(b"\n") else len(line) + skip_line(f)


def skip_line(f) -> int:
    """Read past the rest of a line, a MiB at a time; its bytes."""
    size = 0
    while chunk := f.readline(1 << 20):
        size += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return size


def too_long_line(line: int, size: int, cap: int) -> RowError:
    return RowError(line, None, "too_long", f"the line has {size} bytes, over the cap of {cap} (derived from the "
                    "models' context; --max-line-bytes sets it); it was not parsed")


def jsonl_items(path: str, fields: Fields, max_line_bytes: int) -> Iterator[Row | RowError]:
    line = 0
    try:
        with open_input(path) as f:
            for line, raw in enumerate(capped_lines(f, max_line_bytes), start=1):
                if isinstance(raw, int):
                    yield too_long_line(line, raw, max_line_bytes)
                    continue
                if line == 1 and raw.startswith(BOM):
                    raw = raw[len(BOM) :]
                raw = raw.rstrip(b"\r\n")
                if raw.strip():
                    yield parse_line(raw, line, fields)
    except (OSError, EOFError, zlib.error) as e:  # a corrupt .gz, a read error
        raise UsageError(f"cannot read {path} after line {line}: {first_line(e)} (the rows written stand: rerun "
                         "to resume once it reads; a file put in its place is another input, which --overwrite "
                         "starts over)") from None


MAX_LINE_BYTES = 1 << 30  # no cap of our own: a caller that knows the models' context gives one


def read_jsonl(path: str, fields: Fields = Fields(), max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[Row | RowError]:
    """Rows and errors in input order. Blank lines are skipped; a UTF-8 BOM and CRLF are fine;
    a line over max_line_bytes is a too_long error, never parsed."""
    return unique_ids(jsonl_items(path, fields, max_line_bytes))


HUB_PREFIX = "hf:"


def is_dataset(source: str) -> bool:
    """hf:OWNER/NAME, or a local folder laid out like a Hub dataset repository."""
    return source.startswith(HUB_PREFIX) or os.path.isdir(source)


def open_dataset(source: str, split: str, subset: str | None):
    """A streaming datasets.IterableDataset; any failure (unknown dataset, offline, no such
    split) is one clear UsageError."""
    import datasets  # heavy: only for dataset inputs

    name = source.removeprefix(HUB_PREFIX)
    try:
        return datasets.load_dataset(name, subset, split=split, streaming=True)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; all mean "cannot open"
        raise UsageError(f"cannot open dataset {name!r} (split {split!r}{f', subset {subset!r}' if subset else ''}): "
                         f"{first_line(e)}") from None


def dataset_items(source: str, split: str, subset: str | None, fields: Fields) -> Iterator[Row | RowError]:
    """Examples as rows, numbered from 1 like lines."""
    dataset = open_dataset(source, split, subset)
    columns = list(dataset.features or {})
    if columns and fields.prompt not in columns and fields.messages not in columns:
        raise UsageError(f"dataset {source!r} has no {fields.prompt!r} or {fields.messages!r} field (it has "
                         f"{', '.join(columns)}); choose one with --prompt-field or --messages-field")
    examples = iter(dataset)
    line = 0
    while True:
        try:
            example = next(examples)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - a failing download or a bad shard mid-stream
            raise UsageError(f"reading dataset {source!r} failed after {line} rows: {first_line(e)}") from None
        line += 1
        yield parse_object(example, line, fields)


def dataset_size(source: str, split: str, subset: str | None) -> int | None:
    info = open_dataset(source, split, subset).info
    split_info = (info.splits or {}).get(split) if info else None
    return getattr(split_info, "num_examples", None) or None


def input_size(source: str, split: str, subset: str | None) -> int | None:
    """Rows in the input, for progress bars, when cheap to know."""
    return dataset_size(source, split, subset) if is_dataset(source) else count_lines(source)


def read_input(source: str, fields: Fields, *, split: str = "train", subset: str | None = None,
               max_line_bytes: int = MAX_LINE_BYTES):
    """Rows and errors of a JSONL file (or stream) or a dataset, ids checked for duplicates."""
    if is_dataset(source):
        return unique_ids(dataset_items(source, split, subset, fields))
    if not (os.path.isfile(source) or is_stream(source)):
        raise UsageError(f"input not found: {source} (a JSONL file, a dataset folder, or hf:OWNER/NAME)")
    return unique_ids(jsonl_items(source, fields, max_line_bytes))


def read_run_input(source: str, options: dict, max_line_bytes: int = MAX_LINE_BYTES):
    """read_input with a run's own fields, split and subset (RunConfig.options(), or the
    options in a run's summary)."""
    fields = Fields(prompt=options["prompt_field"], id=options["id_field"], messages=options["messages_field"],
                    tools=options.get("tools_field"))  # (a summary written before --tools-field has none)
    return read_input(source, fields, split=options["split"], subset=options["subset"], max_line_bytes=max_line_bytes)
