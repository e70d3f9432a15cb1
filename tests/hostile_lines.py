"""Input lines as careless and hostile users write them: each one line of a JSONL input that
must become exactly one record or one error record, with the job going on. Add a line here for
every input bug found (tests/test_hostile.py runs them all through the CLI)."""

import orjson

USER = [{"role": "user", "content": "the cat sat"}]


def line(**obj) -> bytes:
    return orjson.dumps(obj)


def request(custom_id: str, **body) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "url": "/v1/chat/completions", "body": {"messages": USER, **body}})


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


BIG = 50 << 20  # bytes of the one huge line

# name -> (the line, the error type it must get, or None: a record)
LINES = {
    "plain": (line(id="plain", prompt="the cat sat on"), None),
    "chat": (line(id="chat", messages=USER), None),
    "huge line": (b'{"id": "huge", "prompt": "' + b"the cat " * (BIG // 8) + b'"}', "too_long"),
    "nested past the parser": (b'{"id": "deep", "prompt": "x", "extra": ' + nested(5000) + b"}", "invalid_json"),
    "nested past the writer": (b'{"id": "deep-300", "prompt": "x", "extra": ' + nested(300) + b"}", "invalid_json"),
    "nested in a message": (b'{"id": "deep-msg", "messages": [{"role": "user", "content": "hi", "meta": '
                            + nested(400) + b"}]}", "invalid_json"),
    "lone surrogate": (b'{"id": "surrogate", "prompt": "\\ud800"}', "invalid_json"),
    "infinite number": (b'{"id": "inf", "prompt": "x", "temperature": 1e400}', "invalid_json"),
    "huge integer id": (b'{"id": 123456789012345678901234567890, "prompt": "x"}', "invalid_id"),
    "nul and controls": (line(id="controls", prompt="a\u0000b\u0001c\u001b[31m"), None),
    "special tokens as text": (line(id="specials", prompt="<|im_end|><|endoftext|></s><s>" * 50), None),
    "invalid utf-8": (b'{"id": "latin1", "prompt": "caf\xe9"}', "invalid_utf8"),
    "request template (untrusted)": (request("template", chat_template="{{ 'x' * 10**9 }}"), "invalid_request"),
    "template in kwargs": (request("kwargs-template", chat_template_kwargs={"chat_template": "{{ 1/0 }}"}),
                           "invalid_request"),
    "schema that refers to itself": (request("self-ref", response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}), "invalid_request"),
    "regex the engine cannot hold": (request("regex-limits", guided_regex="(a{1000}){1000}"), "grammar"),
    "min over max tokens": (request("min-max", min_tokens=9, max_tokens=3), "invalid_request"),
    "n too large": (request("n-huge", n=10**9), "invalid_request"),
    "max_tokens zero": (request("max-zero", max_tokens=0), "invalid_request"),
    "temperature nan as text": (request("nan", temperature="nan"), "invalid_request"),
    "body not an object": (b'{"custom_id": "no-body", "body": [1, 2]}', "invalid_request"),
    "role not a string": (line(id="role", messages=[{"role": 5, "content": "x"}]), "invalid_messages"),
    "content an object": (line(id="content", messages=[{"role": "user", "content": {"a": 1}}]), "invalid_messages"),
    "many stop strings": (request("stops", stop=["zz" * 500] * 4), None),
    "a BOM in the middle": (b"\xef\xbb\xbf" + line(id="bom", prompt="x"), "invalid_json"),
    "empty id": (line(id="", prompt="x"), "invalid_id"),
    "id a list": (line(id=[1], prompt="x"), "invalid_id"),
    "another endpoint": (orjson.dumps({"custom_id": "embed", "url": "/v1/embeddings", "body": {"input": "x"}}),
                         "invalid_request"),
    "bias on a token the tokenizer lacks": (request("bias", logit_bias={"999999999": 5}), "invalid_request"),
    "stop id the tokenizer lacks": (request("stop-id", stop_token_ids=[999999999], min_tokens=1), "invalid_request"),
    "empty stop string": (request("empty-stop", stop=[""]), "invalid_request"),
    "seed not an integer": (request("seed", seed=1e30), "invalid_request"),
    "max_tokens past any context": (request("max-huge", max_tokens=10**12), "too_long"),
    "duplicate id": (line(id="plain", prompt="again"), "duplicate_id"),
}
