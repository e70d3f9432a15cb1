"""OpenAI-batch request bodies: every key is honored, accepted (it cannot change the output) or refused by name."""

import json
import re
from pathlib import Path

import orjson
import pytest

from batchspec.buckets import sampling_key
from batchspec.decoding.grammar import Grammar
from batchspec.request_body import HONORED_KEYS, NO_EFFECT_KEYS, UNHONORED
from batchspec.sources import Fields, Row, RowError, parse_line

CHAT_URL, TEXT_URL = "/v1/chat/completions", "/v1/completions"


def parse(url=CHAT_URL, **body) -> Row | RowError:
    given = {"messages": [{"role": "user", "content": "hi"}]} if url == CHAT_URL else {"prompt": "hi"}
    line = orjson.dumps({"custom_id": "r", "method": "POST", "url": url, "body": {**given, **body}})
    return parse_line(line, 1, Fields())


def refusal(url=CHAT_URL, **body) -> str:
    item = parse(url, **body)
    assert isinstance(item, RowError) and item.type == "invalid_request" and item.id == "r"
    return item.message


ACCEPTED = [
    {"model": "m", "user": "u", "metadata": {"k": "v"}, "store": True, "service_tier": "flex", "prompt_cache_key": "p",
     "safety_identifier": "s", "stream_options": {"include_usage": True}, "parallel_tool_calls": True},
    {"n": 1, "best_of": 1, "stop": None, "stop_token_ids": [], "logprobs": False, "top_logprobs": 0},
    {"stop": [], "logprobs": None, "top_logprobs": None, "logit_bias": {}, "min_p": 0, "min_tokens": 0},
    {"frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": None},
    {"ignore_eos": False, "skip_special_tokens": True, "include_stop_str_in_output": False, "use_beam_search": False},
    {"response_format": {"type": "text"}, "stream": False, "echo": False, "suffix": None, "reasoning_effort": None},
    {"tools": [], "tool_choice": "none", "functions": None, "function_call": "none", "documents": []},
    {"tools": None, "tool_choice": None, "chat_template_kwargs": {}, "add_generation_prompt": True,
     "continue_final_message": False, "modalities": ["text"], "audio": None},
]


@pytest.mark.parametrize("body", ACCEPTED)
def test_keys_that_cannot_change_the_output_are_accepted(body):
    assert isinstance(parse(**body), Row) and isinstance(parse(TEXT_URL, **body), Row)


REFUSED = [  # valid values of keys batchspec does not honor yet
    ("best_of", 3), ("use_beam_search", True), ("skip_special_tokens", False),
    ("echo", True), ("suffix", ""), ("functions", [{"name": "f"}]), ("function_call", {"name": "f"}),
    ("reasoning_effort", "low"), ("stream", True),
    ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy"}), ("prediction", {"type": "content"}),
    ("web_search_options", {}),
]


@pytest.mark.parametrize("key, value", REFUSED)
def test_keys_not_honored_yet_are_refused_by_name(key, value):
    message = refusal(**{key: value})
    assert message == (f"{key!r} is not supported by batchspec yet ({UNHONORED[key].feature}); "
                       "remove it or set it to null")


def test_every_unhonored_key_has_a_refused_value():
    assert {key for key, _ in REFUSED} == set(UNHONORED)


INVALID = [  # checked before support: a bad value is named as such
    ("n", 0), ("n", "2"), ("n", True), ("best_of", 1.0), ("top_logprobs", 50), ("top_logprobs", -1),
    ("logprobs", "yes"), ("logprobs", 21), ("stop", 5), ("stop", ["a", 1]), ("stop", ""), ("stop", ["a", ""]),
    ("frequency_penalty", 2.5), ("presence_penalty", -3), ("presence_penalty", False), ("logit_bias", [1]),
    ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}), ("logit_bias", {"5": "1"}), ("min_p", 1.5),
    ("repetition_penalty", 0), ("min_tokens", -1), ("stop_token_ids", [1, "2"]), ("stop_token_ids", 3),
    ("response_format", {"type": "yaml"}), ("response_format", "json"), ("stream", "no"), ("tools", {}),
    ("top_k", -2), ("top_k", 1.5), ("top_k", "5"), ("ignore_eos", "yes"), ("ignore_eos", 1),
]


@pytest.mark.parametrize("key, value", INVALID)
def test_bad_values_name_their_key(key, value):
    message = refusal(**{key: value})
    assert re.match(f"'?{key}'? must be ", message), message


@pytest.mark.parametrize("body, message", [
    ({"temprature": 0.5}, "unrecognized request argument 'temprature'"),
    ({"prompt": "also"}, "unrecognized request argument 'prompt'"),  # a chat request's input is its messages
    ({"max_new_tokens": 5, "Stop": "."}, "unrecognized request arguments 'Stop', 'max_new_tokens'"),
    ({"topp": 0.5, "echo": True, "n": 0, "temprature": 1, "audio": {"voice": "alloy"}},
     ("unrecognized request arguments 'temprature', 'topp'; 'audio', 'echo' "
      "are not supported by batchspec yet (audio, generation options); remove them or set them to null")),
])
def test_unknown_and_several_bad_keys_are_all_named_in_one_message(body, message):
    assert refusal(**body) == message


SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize("body, grammar", [
    ({"response_format": {"type": "json_object"}}, Grammar.json_schema({"type": "object"})),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     Grammar.json_schema(SCHEMA)),
    ({"guided_json": SCHEMA}, Grammar.json_schema(SCHEMA)),
    ({"guided_json": '{"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}'},
     Grammar.json_schema(SCHEMA)),
    ({"guided_regex": "a+"}, Grammar("regex", "a+")),
    ({"guided_choice": ["yes", "no"]}, Grammar.choice(["yes", "no"])),
    ({"guided_grammar": "root ::= \"a\" root?"}, Grammar("grammar", "root ::= \"a\" root?")),
    ({"structured_outputs": {"choice": ["a"], "disable_any_whitespace": True}}, Grammar.choice(["a"])),
    ({"structured_outputs": {"json_object": True}}, Grammar.json_schema({"type": "object"})),
    ({"response_format": {"type": "text"}, "guided_regex": "[0-9]+"}, Grammar("regex", "[0-9]+")),
])
def test_structured_outputs_become_the_rows_grammar(body, grammar):
    """Every way a client asks for one; a schema keeps its keys' order (the order written)."""
    for url in (CHAT_URL, TEXT_URL):
        assert parse(url, **body).options["grammar"] == grammar
    if grammar.kind == "json_schema":
        assert list(json.loads(grammar.text).get("properties", {})) in ([], ["b", "a"])


def test_a_completion_request_takes_no_messages():
    assert refusal(TEXT_URL, messages=[]) == "unrecognized request argument 'messages'"


@pytest.mark.parametrize("key, value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("documents", [{"text": "d"}]),
    ("chat_template", "{{ messages }}"), ("chat_template_kwargs", {"enable_thinking": False}),
    ("add_generation_prompt", False), ("continue_final_message", True),
])
def test_chat_keys_are_honored_for_chats_and_refused_for_completions(key, value):
    """How they render: test_chat.py."""
    assert isinstance(parse(**{key: value}), Row)
    assert refusal(TEXT_URL, **{key: value}) == f"{key!r} is for /v1/chat/completions"


def test_plain_rows_keep_other_fields_as_data():
    item = parse_line(b'{"id": 1, "prompt": "x", "stop": ".", "temprature": 2, "n": 0}', 1, Fields())
    assert isinstance(item, Row) and item.options == {} and item.fields["stop"] == "."


def test_stop_token_ids_and_ignore_eos_are_honored_per_row():
    assert [parse(stop_token_ids=ids).options for ids in ([5, 7], [], None)] == [
        {"stop_token_ids": (5, 7)}, {"stop_token_ids": ()}, {}]
    assert [parse(ignore_eos=v).options for v in (True, False, None)] == [
        {"ignore_eos": True}, {"ignore_eos": False}, {}]


def test_generation_options_are_read_per_row_as_the_decoder_names_them():
    body = {"stop": ["\n\n", "END"], "include_stop_str_in_output": True, "min_tokens": 3, "frequency_penalty": 1,
            "presence_penalty": -0.5, "repetition_penalty": 1.2, "logit_bias": {"7": -100, "9": 2.5}, "min_p": 0.1}
    assert parse(**body).options == {
        "stop": ("\n\n", "END"), "include_stop_str": True, "min_tokens": 3, "frequency_penalty": 1.0,
        "presence_penalty": -0.5, "repetition_penalty": 1.2, "logit_bias": {7: -100.0, 9: 2.5}, "min_p": 0.1}
    assert parse(stop=".").options == {"stop": (".",)}
    assert parse(n=4).options == {"n": 4} and refusal(n=129) == "n must be an integer in 1..128"
    chat = [parse(logprobs=True, top_logprobs=3), parse(logprobs=True), parse(logprobs=False, top_logprobs=0)]
    assert [item.options.get("logprobs") for item in chat] == [3, 0, None]
    text = [parse(TEXT_URL, logprobs=2), parse(TEXT_URL, logprobs=0), parse(TEXT_URL, logprobs=False)]
    assert [item.options.get("logprobs") for item in text] == [2, 0, None]
    assert refusal(top_logprobs=2) == "top_logprobs needs logprobs: true"
    assert refusal(TEXT_URL, logprobs=True).startswith("logprobs must be an integer in 0..20")
    assert refusal(TEXT_URL, top_logprobs=2).startswith("top_logprobs is for /v1/chat/completions")
    assert refusal(logprobs=2).startswith("logprobs must be a boolean")


def test_top_k_is_honored_per_row_and_batches_rows_apart():
    assert [parse(top_k=k).options for k in (5, 0, -1, None)] == [{"top_k": 5}, {"top_k": 0}, {"top_k": 0}, {}]
    keys = {sampling_key(parse(**body)) for body in ({"top_k": 5}, {"top_k": 40}, {"top_k": -1}, {})}
    assert len(keys) == 4  # off (-1) differs from the run's own top_k (absent)


def test_readme_names_every_body_key():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## Input", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", section))
    assert HONORED_KEYS | NO_EFFECT_KEYS | set(UNHONORED) | {"messages", "prompt"} <= named
