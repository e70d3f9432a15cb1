"""The JSONL source: every non-blank line is a Row or exactly one RowError, in input order."""

import gzip

import pytest

from batchspec.buckets import Batch, cut, make_encoder, plan
from batchspec.idset import IdSet
from batchspec.sources import Fields, Row, RowError, read_jsonl

BAD_LINES = [
    (b'{"id": 1, "prompt": "fine"}', None),
    (b'{"id": 2, "prompt": "unterminated', "invalid_json"),
    (b'{"id": 3, "prompt": "x"} and more', "trailing_data"),
    (b'["a", "list"]', "not_an_object"),
    (b'"just a string"', "not_an_object"),
    (b'{"id": 6}', "missing_prompt"),
    (b'{"id": 7, "prompt": null}', "missing_prompt"),
    (b'{"id": 8, "prompt": ["not", "text"]}', "invalid_prompt"),
    (b'{"id": 9, "prompt": "caf\xe9"}', "invalid_utf8"),
    (b'{"id": 1, "prompt": "again"}', "duplicate_id"),
    (b'{"id": true, "prompt": "bool id"}', "invalid_id"),
    (b'{"id": 12.5, "prompt": "float id"}', "invalid_id"),
    (b'{"id": 13, "prompt": "x", "temperature": NaN}', "invalid_json"),  # Python's json would take these two
    (b'{"id": 14, "prompt": "\\ud800 alone"}', "invalid_json"),
    (b'{"custom_id": "r15", "body": "not an object"}', "invalid_request"),  # a request, not a row without prompt
    (b'{"custom_id": "r16", "url": "/v1/completions", "body": {"prompt": [1, 2]}}', "invalid_prompt"),
    (b'{"prompt": "no id: the line number is the id"}', None),
]


def write(tmp_path, lines: list[bytes], name="in.jsonl", newline=b"\n") -> str:
    path = tmp_path / name
    data = newline.join(lines) + newline
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    return str(path)


@pytest.mark.parametrize("name", ["in.jsonl", "in.jsonl.gz"])
def test_each_bad_line_gets_one_typed_error(tmp_path, name):
    items = list(read_jsonl(write(tmp_path, [line for line, _ in BAD_LINES], name)))
    assert [i.line for i in items] == list(range(1, len(BAD_LINES) + 1))
    for item, (_, kind) in zip(items, BAD_LINES):
        if kind is None:
            assert isinstance(item, Row)
        else:
            assert isinstance(item, RowError) and item.type == kind and item.message
    assert items[-1].id == str(len(BAD_LINES))  # the 1-based line number, as a string
    assert (items[14].id, items[15].id) == ("r15", "r16") and "token ids is not supported" in items[15].message
    assert items[5].record() == {"id": "6", "line": 6, "error": {"type": "missing_prompt", "message": items[5].message}}


def test_bom_crlf_and_blank_lines(tmp_path):
    lines = [b'\xef\xbb\xbf{"id": "a", "prompt": "first"}', b"", b"   ", b'{"id": "b", "prompt": "second"}', b""]
    items = list(read_jsonl(write(tmp_path, lines, newline=b"\r\n")))
    assert [(i.id, i.line, i.prompt) for i in items] == [("a", 1, "first"), ("b", 4, "second")]


def test_plain_rows_name_their_option_fields(tmp_path):
    """A plain row's fields named like request body keys are listed as unapplied (job warns); its
    configured prompt, id and tools fields and a request's body keys are not."""
    lines = [b'{"id": "a", "prompt": "x", "max_tokens": 3, "tools": [], "topic": "t", "n": 2}',
             b'{"id": "b", "messages": [{"role": "user", "content": "x"}], "stop": "."}',
             b'{"custom_id": "c", "body": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}}',
             b'{"seed": "d", "stop": "y", "tools": []}']
    items = list(read_jsonl(write(tmp_path, lines[:3])))
    text_body, = read_jsonl(write(tmp_path, [b'{"custom_id": 1, "body": "an email", "prompt": "Sum it up:"}']))
    assert text_body.prompt == "Sum it up:"  # a plain row whose data has a text body, not a request
    assert [i.unapplied for i in items] == [("max_tokens", "n", "tools"), ("stop",), ()]
    custom, = read_jsonl(write(tmp_path, lines[3:]), Fields(prompt="stop", id="seed", tools="tools"))
    assert custom.prompt == "y" and custom.unapplied == ()


def test_custom_fields_and_numeric_ids(tmp_path):
    path = write(tmp_path, [b'{"qid": 10, "question": "q1"}', b'{"qid": "10", "question": "q2"}', b'{"question": "q3"}'])
    items = list(read_jsonl(path, Fields(prompt="question", id="qid")))
    assert (items[0].id, items[0].prompt) == ("10", "q1")  # ids are strings: one type per output file
    assert items[1].type == "duplicate_id"  # so 10 and "10" are the same id
    assert items[2].id == "3"


def test_idset_holds_many_ids():
    ids = IdSet()
    for i in range(200_000):
        ids.add(f"row-{i}")
    assert len(ids) == 200_000
    assert all(f"row-{i}" in ids for i in range(0, 200_000, 997))
    assert "row-200000" not in ids and 5 not in ids


def rows(lengths):
    return [(Row(i, i + 1, "p", {}), [7] * n) for i, n in enumerate(lengths)]


def test_cut_sorts_and_respects_batch_size_and_budget():
    batches = list(cut(rows([3, 50, 10, 4, 40, 5]), batch_size=2, max_batch_tokens=None, max_new_tokens=10))
    assert [[len(p) for p in b.prompts] for b in batches] == [[50, 40], [10, 5], [4, 3]]
    budget = list(cut(rows([3, 50, 10, 4, 40, 5]), batch_size=8, max_batch_tokens=130, max_new_tokens=10))
    assert [[len(p) for p in b.prompts] for b in budget] == [[50, 40], [10, 5, 4, 3]]  # 2 x 60, 4 x 20 <= 130
    assert Batch([], [[1, 2, 3], [1]]).padding == (2, 6)


def test_plan_windows_and_errors(tmp_path):
    class Tok:
        def __call__(self, texts):
            return {"input_ids": [[1] * len(t) for t in texts]}

    encode = make_encoder(Tok(), context_length=20, max_new_tokens=10, truncate=None)
    items = [Row(i, i + 1, "x" * n, {}) for i, n in enumerate([5, 0, 11, 3, 9])]
    items.insert(2, RowError(99, None, "invalid_json", "bad"))
    out = list(plan(items, encode, window=3, batch_size=8, max_batch_tokens=None, max_new_tokens=10))
    kinds = [o.type if isinstance(o, RowError) else [r.id for r in o.rows] for o in out]
    # the source error passes straight through; window 1 (rows 0-2) has an empty and a too long
    # prompt; window 2 (rows 3, 4) is one batch, longest first
    assert kinds == ["invalid_json", "empty_prompt", "too_long", [0], [4, 3]]
    left = make_encoder(Tok(), context_length=20, max_new_tokens=10, truncate="left")
    assert left([Row(0, 1, "x" * 15, {})]) == [[1] * 10]
