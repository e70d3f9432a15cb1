"""Static length buckets: tokenize a bounded window of rows, sort by length, cut batches.

Knows the tokenizer (through `encode`), nothing of models. Errors pass straight through.
"""

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields, replace

from batchspec.chat import Bounds, ChatError, TemplateOptions, render
from batchspec.errors import UsageError
from batchspec.decoding import RowOptions
from batchspec.decoding.grammar import grammar_problem
from batchspec.request_body import SAMPLES, SAMPLING_KEYS
from batchspec.sources import Row, RowError


@dataclass
class Batch:
    rows: list[Row]
    prompts: list[list[int]]  # token ids, one list per row

    @property
    def padding(self) -> tuple[int, int]:
        """(pad slots, all slots) of the left-padded prompt tensor."""
        width = max(map(len, self.prompts))
        return width * len(self.prompts) - sum(map(len, self.prompts)), width * len(self.prompts)


Encode = Callable[[list[Row]], list[list[int] | RowError]]
ROW_OPTIONS = {f.name for f in fields(RowOptions)}


def sampling_key(row: Row) -> tuple[float, ...]:
    """Rows whose own sampling settings differ go to different batches (-1: the run's value)."""
    return tuple(row.options.get(name, -1) for name in SAMPLING_KEYS)


def cut(encoded: list[tuple[Row, list[int]]], batch_size: int, max_batch_tokens: int | None, max_new_tokens: int,
        samples: int = 1):
    """Per sampling key, longest first (a batch that does not fit memory fails at once, not
    hours in), then fill each batch up to batch_size decoded rows (a request with n samples
    counts n; `samples`: the run's n) and, with a budget,
    rows * (longest prompt + max_new_tokens) <= max_batch_tokens (at least one request a batch)."""
    encoded = sorted(encoded, key=lambda pair: (sampling_key(pair[0]), -len(pair[1])))
    batch: list[tuple[Row, list[int]]] = []
    rows = 0  # decoded rows in the batch
    for row, ids in encoded:
        n = row.options.get(SAMPLES, samples)
        longest = len(batch[0][1]) if batch else len(ids)
        over_budget = max_batch_tokens is not None and (rows + n) * (longest + max_new_tokens) > max_batch_tokens
        new_key = batch and sampling_key(batch[0][0]) != sampling_key(row)
        if batch and (rows + n > batch_size or over_budget or new_key):
            yield Batch([r for r, _ in batch], [i for _, i in batch])
            batch, rows = [], 0
        batch.append((row, ids))
        rows += n
    if batch:
        yield Batch([r for r, _ in batch], [i for _, i in batch])


def plan(
    items: Iterable[Row | RowError],
    encode: Encode,
    *,
    window: int,
    batch_size: int,
    max_batch_tokens: int | None,
    max_new_tokens: int,
    samples: int = 1,
) -> Iterator[Batch | RowError]:
    """Errors as they come; rows in windows of `window`, each window cut into static batches
    (samples: the run's n, completions per row)."""

    def flush(rows: list[Row]):
        encoded = []
        for row, ids in zip(rows, encode(rows)):
            if isinstance(ids, RowError):
                yield ids
            else:
                encoded.append((row, ids))
        yield from cut(encoded, batch_size, max_batch_tokens, max_new_tokens, samples)

    rows: list[Row] = []
    for item in items:
        if isinstance(item, RowError):
            yield item
            continue
        rows.append(item)
        if len(rows) >= window:
            yield from flush(rows)
            rows = []
    if rows:
        yield from flush(rows)


REQUEST_TEMPLATE = ("a request's own chat_template is code of the request's author: refused unless the run passes "
                    "--trust-request-chat-template")


class TemplateCheck:
    """Whether the run's --chat-template renders any chat: one that failed on every chat row of
    the first window (before a batch is decoded) is the run's usage error, not each row's."""

    def __init__(self, template: TemplateOptions):
        self.pending = template.template is not None
        self.first_error: str | None = None

    def saw(self, row: Row, ids: list[int] | RowError) -> None:
        if self.pending and "template" not in row.chat:
            if not isinstance(ids, RowError):
                self.pending = False
            elif self.first_error is None:
                self.first_error = ids.message

    def window_done(self) -> None:
        if self.pending and self.first_error is not None:
            raise UsageError(f"--chat-template renders none of the first window's chats: {self.first_error}")
        self.pending = False


def text_size(row: Row) -> int:
    """Characters of a row's prompt or messages (as JSON): what tokenizing it would read."""
    return len(row.prompt) if row.messages is None else sum(len(str(m.get("content", ""))) for m in row.messages)


def make_encoder(
    tokenizer, *, context_length: int | None, max_new_tokens: int, truncate: str | None,
    chat: bool = False, system: str | None = None, template: TemplateOptions = TemplateOptions(),
    options: RowOptions = RowOptions(), request_templates: Bounds | None = None, max_chars: int | None = None,
) -> Encode:
    """Token ids per row. Chat rows (and, with `chat`, plain prompts as one user message) are
    rendered by the chat template (chat.render) with the run's `template` options and the row's
    own over them (a row's own template only with `request_templates`, the bounds it renders
    within); other prompts are raw text (with the tokenizer's own special tokens, e.g. a BOS).
    `system` adds a system message to chats that have none. A row whose text has over
    `max_chars` characters is too_long before it is tokenized. Then prompt tokens +
    max_new_tokens (the row's own, else the run's) <= context_length, or the prompt is cut on
    the `truncate` side ("left" keeps its end, "right" keeps its start). A row's own options must
    combine with the run's `options`, and its grammar must compile for this tokenizer."""
    check = TemplateCheck(template)

    def chat_ids(row: Row) -> list[int] | RowError:
        own = "template" in row.chat
        if own and request_templates is None:
            return RowError(row.line, row.id, "invalid_request", REQUEST_TEMPLATE)
        try:
            ids = render(tokenizer, row.messages or [{"role": "user", "content": row.prompt}],
                         template.over(row.chat), system, request_templates if own else None)
        except ChatError as e:
            ids = RowError(row.line, row.id, e.kind, str(e))
        check.saw(row, ids)
        return ids

    def fit(row: Row, ids: list[int] | RowError) -> list[int] | RowError:
        if isinstance(ids, RowError):
            return ids
        if row.chat and row.messages is None and not chat:
            return RowError(row.line, row.id, "invalid_request", "tools are rendered by the chat template: give the "
                            "row messages, or --chat to make its prompt one")
        if not ids:
            return RowError(row.line, row.id, "empty_prompt", "the prompt has no tokens")
        for name in ("logit_bias", "stop_token_ids"):  # ids no row can meet (and no tensor index)
            unknown = sorted(t for t in row.options.get(name, ()) if t >= len(tokenizer))
            if unknown:
                return RowError(row.line, row.id, "invalid_request",
                                f"{name} names token ids the tokenizer does not have ({len(tokenizer)} ids): {unknown}")
        problem = options_problem(row)
        if problem:
            return RowError(row.line, row.id, "invalid_request", problem)
        new_tokens = row.options.get("max_new_tokens", max_new_tokens)
        limit = None if context_length is None else context_length - new_tokens
        if limit is None or len(ids) <= limit:
            return ids
        if truncate is not None and limit > 0:
            return ids[len(ids) - limit :] if truncate == "left" else ids[:limit]
        message = (f"prompt has {len(ids)} tokens; with max_new_tokens {new_tokens} it exceeds the target's context "
                   f"of {context_length}" + (" (use --truncate left|right to cut it)" if truncate is None else ""))
        return RowError(row.line, row.id, "too_long", message)

    def options_problem(row: Row) -> str | None:
        try:
            own = replace(options, **{k: v for k, v in row.options.items() if k in ROW_OPTIONS})
        except ValueError as e:
            return str(e)
        new_tokens = row.options.get("max_new_tokens", max_new_tokens)
        if own.min_tokens > new_tokens:
            return f"min_tokens {own.min_tokens} is over max_tokens {new_tokens}"
        return own.grammar and grammar_problem(own.grammar, tokenizer)

    def oversized(row: Row) -> RowError | None:
        size = text_size(row)
        if max_chars is None or size <= max_chars:
            return None
        return RowError(row.line, row.id, "too_long", f"the prompt has {size} characters, over the cap of "
                        f"{max_chars} (derived from the models' context; --max-line-bytes sets it)")

    def encode(rows: list[Row]) -> list[list[int] | RowError]:
        too_long = {id(r): e for r in rows if (e := oversized(r))}
        raw = [r for r in rows if r.messages is None and not chat and id(r) not in too_long]
        raw_ids = iter(tokenizer([r.prompt for r in raw])["input_ids"] if raw else [])
        out = []
        for row in rows:
            if id(row) in too_long:
                out.append(too_long[id(row)])
                continue
            ids = chat_ids(row) if row.messages is not None or chat else next(raw_ids)
            out.append(fit(row, ids))
        check.window_done()
        return out

    return encode
