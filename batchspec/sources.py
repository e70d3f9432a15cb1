"""Rows in: a JSONL file (plain or .gz) read line by line, in constant memory.

Every non-blank line becomes either a Row or a RowError; nothing here stops the job.
"""

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import orjson

from batchspec.idset import IdSet

BOM = b"\xef\xbb\xbf"


@dataclass
class Row:
    id: str | int
    line: int  # 1-based line number in the input
    prompt: str | None  # raw text to complete, or None for a chat row
    fields: dict = field(repr=False)  # the whole input object
    messages: list[dict] | None = None  # [{role, content}, ...] for a chat row


@dataclass(frozen=True)
class Fields:
    """Which input fields hold what."""

    prompt: str = "prompt"
    id: str = "id"
    messages: str = "messages"


@dataclass
class RowError:
    line: int
    id: str | int | None
    type: str
    message: str

    def record(self) -> dict:
        return {"id": self.id, "line": self.line, "error": {"type": self.type, "message": self.message}}


def open_input(path: str):
    return gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb")


def count_lines(path: str) -> int | None:
    """Non-blank line count of a plain file, for the progress bar (None for .gz: not worth a pass)."""
    if str(path).endswith(".gz"):
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
        try:
            _, end = json.JSONDecoder().raw_decode(text.lstrip())
        except json.JSONDecodeError:
            raise ValueError("invalid_json", str(e)) from None
        raise ValueError("trailing_data", f"unexpected data after the JSON value at column {end + 1}") from None


def json_type(value) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def row_id(obj: dict, id_field: str, line: int):
    """The row's id: its id field (a string or an integer), or its line number when absent."""
    if id_field not in obj:
        return line
    value = obj[id_field]
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise ValueError("invalid_id", f"{id_field!r} must be a non-empty string or an integer, got {json_type(value)}")
    return value


def check_messages(messages, name: str) -> str | None:
    """Why `messages` is not a usable chat, or None when it is."""
    if not isinstance(messages, list) or not messages:
        return f"field {name!r} must be a non-empty list of {{role, content}} objects"
    for k, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return f"{name}[{k}] must be an object with string 'role' and 'content'"
    return None


def parse_line(raw: bytes, line: int, fields: Fields) -> Row | RowError:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return RowError(line, None, "invalid_utf8", f"invalid UTF-8 byte 0x{raw[e.start]:02x} at byte {e.start + 1}")
    try:
        obj = parse_json(text)
    except ValueError as e:
        return RowError(line, None, *e.args)
    if not isinstance(obj, dict):
        return RowError(line, None, "not_an_object", f"expected a JSON object, got {json_type(obj)}")
    try:
        rid = row_id(obj, fields.id, line)
    except ValueError as e:
        return RowError(line, None, *e.args)
    prompt = obj.get(fields.prompt)
    if prompt is None and obj.get(fields.messages) is not None:
        problem = check_messages(obj[fields.messages], fields.messages)
        if problem:
            return RowError(line, rid, "invalid_messages", problem)
        return Row(rid, line, None, obj, messages=obj[fields.messages])
    if prompt is None:
        what = "is null" if fields.prompt in obj else "is missing"
        return RowError(line, rid, "missing_prompt", f"field {fields.prompt!r} {what} (and no {fields.messages!r})")
    if not isinstance(prompt, str):
        return RowError(line, rid, "invalid_prompt", f"field {fields.prompt!r} must be a string, got {json_type(prompt)}")
    return Row(rid, line, prompt, obj)


def read_jsonl(path: str, fields: Fields = Fields()) -> Iterator[Row | RowError]:
    """Rows and errors in input order. Blank lines are skipped; a UTF-8 BOM and CRLF are fine."""
    seen = IdSet()
    with open_input(path) as f:
        for line, raw in enumerate(f, start=1):
            if line == 1 and raw.startswith(BOM):
                raw = raw[len(BOM) :]
            raw = raw.rstrip(b"\r\n")
            if not raw.strip():
                continue
            item = parse_line(raw, line, fields)
            if item.id is not None:
                if item.id in seen:
                    item = RowError(line, item.id, "duplicate_id", f"id {item.id!r} appears on an earlier line")
                else:
                    seen.add(item.id)
            yield item
