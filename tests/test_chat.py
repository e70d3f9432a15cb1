"""Chat rows: messages rendered with the target's chat template, --chat and --system; content
parts, tools, tool turns, documents and the template's options as clients send them."""

import inspect
import shutil
from dataclasses import replace

import orjson
import pytest
import torch

from batchspec.buckets import make_encoder
from batchspec.chat import RESERVED_KWARGS, Bounds, TemplateOptions, chat_request, run_template_options, takes_parts
from batchspec.config import RunConfig
from batchspec.errors import UsageError
from batchspec.models import load_pair
from batchspec.sources import Fields, Row, RowError, read_jsonl
from test_job import run_here


@pytest.fixture(scope="module")
def pair(tiny_pair):
    target, draft = tiny_pair("qwen2")
    return load_pair(str(target), str(draft), dtype="float32", device="cpu")


def templated(tokenizer, messages):
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def test_messages_chat_and_system(pair):
    tok = pair.tokenizer
    user = [{"role": "user", "content": "the cat sat"}]
    with_system = [{"role": "system", "content": "be brief"}, *user]
    rows = [Row(1, 1, None, {}, messages=user), Row(2, 2, "the cat sat", {}), Row(3, 3, None, {}, messages=with_system)]
    plain = make_encoder(tok, context_length=None, max_new_tokens=8, truncate=None)(rows)
    assert plain == [templated(tok, user), tok("the cat sat")["input_ids"], templated(tok, with_system)]
    chat = make_encoder(tok, context_length=None, max_new_tokens=8, truncate=None, chat=True, system="be brief")(rows)
    assert chat == [templated(tok, with_system)] * 3  # a system message is added only where none is


def test_chat_rows_for_a_model_without_a_template_are_error_rows(tiny_pair, tmp_path):
    """A base model: a row with messages is an invalid_messages record and the plain rows around it
    are completed (one such row in a file must not stop the job, nor every rerun of it); --chat,
    which makes every row a chat, is the run's usage error before it starts."""
    target, _ = tiny_pair("qwen2")
    base = tmp_path / "base"
    shutil.copytree(target, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = orjson.loads((base / "tokenizer_config.json").read_bytes())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_bytes(orjson.dumps(config))
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b'{"id": "a", "prompt": "the cat"}\n'
                       b'{"id": "b", "messages": [{"role": "user", "content": "hi"}]}\n'
                       b'{"id": "c", "prompt": "a mat"}\n')
    common = [str(source), "--target", str(base), "--mode", "ar", "--max-new-tokens", "2", "--no-progress"]
    result = run_here(*common, "--out", str(out))
    assert result.exit_code == 3, result.output
    assert [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()] == ["a", "c"]
    error, = map(orjson.loads, (tmp_path / "out.errors.jsonl").read_bytes().splitlines())
    assert error["id"] == "b" and error["error"]["type"] == "invalid_messages"
    assert "no chat template" in error["error"]["message"]
    refused = run_here(*common, "--out", str(tmp_path / "chat.jsonl"), "--chat")
    assert refused.exit_code == 2 and "--chat: the target's tokenizer has no chat template" in refused.output
    assert not (tmp_path / "chat.jsonl").exists() or not (tmp_path / "chat.jsonl").read_bytes()


def test_bad_messages_are_error_rows(tmp_path):
    path = tmp_path / "in.jsonl"
    """The shape is checked as lines are read; contents as chats are rendered (below)."""
    path.write_bytes(b'{"id": 1, "messages": []}\n{"id": 2, "messages": [{"content": "hi"}]}\n'
                     b'{"id": 3, "messages": "hi"}\n{"id": 4, "messages": [{"role": "user", "content": "ok"}]}\n')
    items = list(read_jsonl(str(path)))
    assert [getattr(i, "type", "row") for i in items] == ["invalid_messages"] * 3 + ["row"]


def test_chat_rows_through_the_cli_equal_target_generate(pair, tiny_pair, tmp_path):
    target, draft = tiny_pair("qwen2")
    source = tmp_path / "chat.jsonl"
    chats = [[{"role": "user", "content": "the old house"}],
             [{"role": "system", "content": "short"}, {"role": "user", "content": "read a book about water"}]]
    source.write_bytes(b"".join(orjson.dumps({"id": k, "messages": m}) + b"\n" for k, m in enumerate(chats)))
    out = tmp_path / "out.jsonl"
    result = run_here(str(source), "--out", str(out), "--target", str(target), "--draft", str(draft),
                      "--max-new-tokens", "16", "--token-ids", "--no-progress")
    assert result.exit_code == 0, result.output
    records = {r["id"]: r for r in map(orjson.loads, out.read_bytes().splitlines())}
    for k, messages in enumerate(chats):
        ids = torch.tensor([templated(pair.tokenizer, messages)])
        expected = pair.target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                                        pad_token_id=0)[0, ids.shape[1] :].tolist()
        record = records[str(k)]
        assert record["messages"] == messages and "prompt" not in record
        assert record["token_ids"] == expected
        assert record["stats"]["prompt_tokens"] == ids.shape[1]  # the templated length


# A template that renders tools, documents, tool calls and tool turns, and a custom flag
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% if documents %}<|im_start|>system\ndocs:{% for d in documents %} {{ d.title }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is defined %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)
KNOWS_DEVELOPER = TOOL_TEMPLATE + "{# passes the developer role through #}"
PARTS_TEMPLATE = (  # loops over content parts, as multimodal-style templates do
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TWO_PARTS = [{"type": "text", "text": "the cat"}, {"type": "text", "text": "sat"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": CITY}}]
USER = {"role": "user", "content": "the cat sat"}
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "the old house"}'}}]}
CALLED = {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "function": {"name": "get_weather",
                                                                        "arguments": {"city": "the old house"}}}]}
TOOL_TURN = {"role": "tool", "tool_call_id": "c1", "content": "hot"}

# (messages as the client writes them, body keys, the run's options) -> (messages and keyword
# arguments apply_chat_template must get for the same prompt)
CASES = {
    "text parts": ([{"role": "user", "content": TWO_PARTS}],
                   {}, TemplateOptions(), ([{"role": "user", "content": "the cat\nsat"}], {})),
    "parts to a template that loops over them": ([{"role": "user", "content": TWO_PARTS}],
                                                 {"chat_template": PARTS_TEMPLATE}, TemplateOptions(),
                                                 ([{"role": "user", "content": TWO_PARTS}],
                                                  {"chat_template": PARTS_TEMPLATE})),
    "tools": ([USER], {"tools": TOOLS, "tool_choice": "auto"}, TemplateOptions(), ([USER], {"tools": TOOLS})),
    "tool choice none": ([USER], {"tools": TOOLS, "tool_choice": "none"}, TemplateOptions(), ([USER], {})),
    "tool turns": ([USER, CALL, TOOL_TURN], {"tools": TOOLS}, TemplateOptions(),
                   ([USER, CALLED, TOOL_TURN], {"tools": TOOLS})),
    "documents": ([USER], {"documents": [{"title": "water", "text": "hot"}]}, TemplateOptions(),
                  ([USER], {"documents": [{"title": "water", "text": "hot"}]})),
    "template kwargs": ([USER], {"chat_template_kwargs": {"enable_thinking": False}}, TemplateOptions(),
                        ([USER], {"enable_thinking": False})),
    "row kwargs over the run's": ([USER], {"chat_template_kwargs": {"enable_thinking": True}},
                                  TemplateOptions(kwargs={"enable_thinking": False, "extra": 1}),
                                  ([USER], {"enable_thinking": True, "extra": 1})),
    "no generation prompt": ([USER], {"add_generation_prompt": False}, TemplateOptions(),
                             ([USER], {"add_generation_prompt": False})),
    "continue final message": ([USER, {"role": "assistant", "content": "the"}], {"continue_final_message": True},
                               TemplateOptions(), ([USER, {"role": "assistant", "content": "the"}],
                                                   {"continue_final_message": True, "add_generation_prompt": False})),
    "run continues": ([USER, {"role": "assistant", "content": "the"}], {}, TemplateOptions(continue_final_message=True),
                      ([USER, {"role": "assistant", "content": "the"}],
                       {"continue_final_message": True, "add_generation_prompt": False})),
    "developer as system": ([{"role": "developer", "content": "be brief"}, USER], {}, TemplateOptions(),
                            ([{"role": "system", "content": "be brief"}, USER], {})),
    "developer kept": ([{"role": "developer", "content": "be brief"}, USER], {"chat_template": KNOWS_DEVELOPER},
                       TemplateOptions(), ([{"role": "developer", "content": "be brief"}, USER],
                                           {"chat_template": KNOWS_DEVELOPER})),
}


@pytest.fixture(scope="module")
def tool_tokenizer(pair):
    """The tiny target's tokenizer with TOOL_TEMPLATE as its own, saved and loaded back."""
    return pair.tokenizer.__class__.from_pretrained(pair.tokenizer.name_or_path, chat_template=TOOL_TEMPLATE)


@pytest.mark.parametrize("case", CASES)
def test_prompt_ids_equal_apply_chat_template(tool_tokenizer, case):
    messages, body, run_options, (expected_messages, kwargs) = CASES[case]
    row = Row(1, 1, None, {}, messages=messages, chat=chat_request(body))
    encode = make_encoder(tool_tokenizer, context_length=None, max_new_tokens=8, truncate=None, template=run_options,
                          request_templates=Bounds())  # a request's own template: rendered in a bounded child
    expected = tool_tokenizer.apply_chat_template(expected_messages, **{"add_generation_prompt": True, **kwargs},
                                                  return_dict=False)
    assert encode([row]) == [list(expected)]
    assert messages == CASES[case][0]  # the row's own messages (its record's) are left as they came


@pytest.mark.parametrize("template, parts", [
    (TOOL_TEMPLATE, False), (PARTS_TEMPLATE, True),
    ("{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{{ p.text }}{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{% for p in m.content | selectattr('type', 'eq', 'text') %}{{ p.text }}{% endfor %}"
     "{% endfor %}", True),
    ("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}", False),
])
def test_templates_that_loop_over_content_take_parts(template, parts):
    assert takes_parts(template) is parts


def test_reserved_kwargs_cover_apply_chat_templates_own_arguments(tool_tokenizer):
    own = set(inspect.signature(tool_tokenizer.apply_chat_template).parameters) - {"kwargs"}
    assert own <= RESERVED_KWARGS


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": "required"}, "forcing a tool call"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "forcing a tool call"),
    ({"tools": [1]}, "tools must be a list of objects"),
    ({"chat_template_kwargs": {"tools": []}}, "cannot set 'tools'"),
    ({"chat_template_kwargs": "x"}, "must be an object"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "cannot both be true"),
    ({"continue_final_message": "yes"}, "must be a boolean"),
])
def test_bad_chat_keys_are_refused(body, message):
    with pytest.raises(ValueError, match=message):
        chat_request(body)


@pytest.mark.parametrize("messages, body, kind, message", [
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]}],
     {}, "invalid_request", "content[1] is a 'image_url' part; the target is a text model"),
    ([{"role": "user", "content": [{"type": "input_audio"}]}], {}, "invalid_request", "'input_audio' part"),
    ([{"role": "user", "content": [{"text": "hi"}]}], {}, "invalid_messages", "with a string 'type'"),
    ([{"role": "user"}], {}, "invalid_messages", "must be a string or a list of content parts"),
    ([USER, {**CALL, "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}], {}, "invalid_messages",
     "arguments is not valid JSON"),
    ([USER], {"tools": TOOLS, "chat_template": "{{ messages[0].content }}"}, "invalid_request",
     "does not render tools"),
    ([USER], {"chat_template": "{% if %}"}, "invalid_request", "does not compile"),
    ([USER], {"chat_template": "{{ raise_exception('roles must alternate') }}"}, "invalid_messages",
     "roles must alternate"),
])
def test_chats_the_template_cannot_take_are_error_rows(tool_tokenizer, messages, body, kind, message):
    encode = make_encoder(tool_tokenizer, context_length=None, max_new_tokens=8, truncate=None,
                          request_templates=Bounds())
    rows = [Row(1, 1, None, {}, messages=messages, chat=chat_request(body)), Row(2, 2, None, {}, messages=[USER])]
    bad, good = encode(rows)
    assert isinstance(bad, RowError) and bad.type == kind and message in bad.message, bad
    assert good == encode([rows[1]])[0] and not isinstance(good, RowError)  # the rest go on


def test_run_template_options(pair, tmp_path):
    good, broken = tmp_path / "good.jinja", tmp_path / "broken.jinja"
    good.write_text(TOOL_TEMPLATE)
    broken.write_text("{% for m in messages %}")
    options = run_template_options(str(good), '{"enable_thinking": false}', True, pair.tokenizer)
    assert options == TemplateOptions(template=TOOL_TEMPLATE, kwargs={"enable_thinking": False},
                                      continue_final_message=True)
    with pytest.raises(UsageError, match="--chat-template .*broken.jinja"):
        run_template_options(str(broken), None, False, pair.tokenizer)
    with pytest.raises(UsageError, match="cannot set 'chat_template'"):
        run_template_options(None, '{"chat_template": "x"}', False, pair.tokenizer)


def test_fingerprint_covers_the_chat_template_options(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(TOOL_TEMPLATE)
    base = RunConfig(input=str(tmp_path / "in.jsonl"), out="o.jsonl", chat_template=str(template))
    (tmp_path / "in.jsonl").write_text("{}\n")
    before = base.fingerprint()
    assert replace(base, chat_template_kwargs='{"enable_thinking": false}').fingerprint() != before
    assert replace(base, continue_final_message=True).fingerprint() != before
    template.write_text(KNOWS_DEVELOPER)  # the same path, another template
    assert base.fingerprint() != before


def test_chat_requests_through_the_cli(pair, tiny_pair, tmp_path):
    """OpenAI-batch chat lines with --chat-template and --chat-template-kwargs: a text-part row
    writes what its plain-string twin writes, tool and continued chats are rendered as
    apply_chat_template renders them, every completion is the target's own, and an image part
    is an error record while the run goes on."""
    target, draft = tiny_pair("qwen2")
    template = tmp_path / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    parts = [{"type": "text", "text": "the old"}, {"type": "text", "text": "house"}]
    bodies = {
        "plain": {"messages": [{"role": "user", "content": "the old\nhouse"}]},
        "parts": {"messages": [{"role": "user", "content": parts}]},
        "tools": {"messages": [USER, CALL, TOOL_TURN], "tools": TOOLS},
        "continue": {"messages": [USER, {"role": "assistant", "content": "the"}], "continue_final_message": True},
        "image": {"messages": [{"role": "user", "content": [*parts, {"type": "image_url", "image_url": {"url": "x"}}]}
                               ]},
    }
    source = tmp_path / "requests.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"custom_id": k, "method": "POST", "url": "/v1/chat/completions",
                                              "body": body}) + b"\n" for k, body in bodies.items()))
    out = tmp_path / "out.jsonl"
    result = run_here(str(source), "--out", str(out), "--target", str(target), "--draft", str(draft),
                      "--max-new-tokens", "8", "--token-ids", "--no-progress", "--chat-template", str(template),
                      "--chat-template-kwargs", '{"enable_thinking": false}')
    assert result.exit_code == 3, result.output  # done, one row in the error file
    records = {r["id"]: r for r in map(orjson.loads, out.read_bytes().splitlines())}
    [error] = map(orjson.loads, out.with_name("out.errors.jsonl").read_bytes().splitlines())
    assert error["id"] == "image" and error["error"]["type"] == "invalid_request"
    assert "'image_url' part; the target is a text model" in error["error"]["message"]
    tok = pair.tokenizer.__class__.from_pretrained(pair.tokenizer.name_or_path, chat_template=TOOL_TEMPLATE)
    prompts = {
        "plain": tok.apply_chat_template(bodies["plain"]["messages"], add_generation_prompt=True,
                                         enable_thinking=False),
        "tools": tok.apply_chat_template([USER, CALLED, TOOL_TURN], tools=TOOLS, add_generation_prompt=True,
                                         enable_thinking=False),
        "continue": tok.apply_chat_template(bodies["continue"]["messages"], continue_final_message=True,
                                            enable_thinking=False),
    }
    assert records["parts"]["token_ids"] == records["plain"]["token_ids"]
    for name, ids in prompts.items():
        ids = torch.tensor([ids["input_ids"]])
        expected = pair.target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                                        pad_token_id=0)[0, ids.shape[1] :].tolist()
        assert records[name]["stats"]["prompt_tokens"] == ids.shape[1], name
        assert records[name]["token_ids"] == expected, name


def test_a_tools_field_renders_each_rows_tools(tool_tokenizer, tmp_path):
    """--tools-field: a dataset's tools column (a list, or the list as JSON text) goes to the
    template with the row's messages; a bad one, or tools on a row that is not a chat, is an
    error record."""
    path = tmp_path / "calls.jsonl"
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in [
        {"id": "list", "messages": [USER], "tools": TOOLS},
        {"id": "text", "messages": [USER], "tools": orjson.dumps(TOOLS).decode()},
        {"id": "none", "messages": [USER]},
        {"id": "bad", "messages": [USER], "tools": "{oops"},
        {"id": "prompt", "prompt": "the cat", "tools": TOOLS},
    ]))
    items = list(read_jsonl(str(path), Fields(tools="tools")))
    assert isinstance(items[3], RowError) and items[3].type == "invalid_request" and "'tools'" in items[3].message
    rows = [items[k] for k in (0, 1, 2, 4)]
    encoded = make_encoder(tool_tokenizer, context_length=None, max_new_tokens=8, truncate=None)(rows)
    with_tools = tool_tokenizer.apply_chat_template([USER], tools=TOOLS, add_generation_prompt=True, return_dict=False)
    plain = tool_tokenizer.apply_chat_template([USER], add_generation_prompt=True, return_dict=False)
    assert encoded[:3] == [list(with_tools), list(with_tools), list(plain)]
    assert isinstance(encoded[3], RowError) and "give the row messages, or --chat" in encoded[3].message


HOSTILE_TEMPLATES = {
    "memory": "{{ 'x' * 10**9 }}",
    "time": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "division": "{{ 1 / 0 }}",
}


def test_a_requests_own_template_is_refused_unless_the_run_trusts_it(pair):
    row = Row(1, 1, None, {}, messages=[{"role": "user", "content": "hi"}],
              chat=chat_request({"chat_template": "{{ messages[0].content }}"}))
    refused, = make_encoder(pair.tokenizer, context_length=None, max_new_tokens=8, truncate=None)([row])
    assert isinstance(refused, RowError) and refused.type == "invalid_request"
    assert "--trust-request-chat-template" in refused.message
    trusted, = make_encoder(pair.tokenizer, context_length=None, max_new_tokens=8, truncate=None,
                            request_templates=Bounds())([row])
    assert trusted == pair.tokenizer("hi", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("name", HOSTILE_TEMPLATES)
def test_a_trusted_hostile_template_costs_its_row_only(pair, name):
    """Rendered in a child bounded in time (1 s here), memory and output: the row gets an error
    record, the process does not grow, and the next row renders."""
    import resource
    import time

    hostile = Row(1, 1, None, {}, messages=[{"role": "user", "content": "hi"}],
                  chat=chat_request({"chat_template": HOSTILE_TEMPLATES[name]}))
    good = Row(2, 2, None, {}, messages=[{"role": "user", "content": "hi"}])
    encode = make_encoder(pair.tokenizer, context_length=None, max_new_tokens=8, truncate=None,
                          request_templates=Bounds(seconds=1.0, memory=256 << 20, chars=1 << 20))
    grown_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    bad, fine = encode([hostile, good])
    assert time.monotonic() - started < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - grown_before < 100 << 10  # KiB: under 100 MiB
    assert isinstance(bad, RowError) and bad.type in ("invalid_request", "invalid_messages"), bad
    assert fine == templated(pair.tokenizer, good.messages)


def test_a_run_template_that_fails_on_every_chat_is_a_usage_error(pair, tmp_path):
    """Found in the first window, before a batch is decoded; one that fails on some chats only
    is those rows' error."""
    chats = [Row(k, k, None, {}, messages=[{"role": "user", "content": text}]) for k, text in enumerate(["a", "bb"])]
    for source in ("{{ 1 / 0 }}", "{% for m in messages %}{{ m.content }}{% endfor %}{{ 1 / (messages|length - 1) }}"):
        path = tmp_path / "t.jinja"
        path.write_text(source)
        options = run_template_options(str(path), None, False, pair.tokenizer)  # compiles: the probe passes
        encode = make_encoder(pair.tokenizer, context_length=None, max_new_tokens=8, truncate=None, template=options)
        with pytest.raises(UsageError, match="--chat-template renders none of the first window's chats.*division"):
            encode(chats)
    some = tmp_path / "some.jinja"
    some.write_text("{% for m in messages %}{{ 1 / (m.content|length - 1) }}{% endfor %}")
    encode = make_encoder(pair.tokenizer, context_length=None, max_new_tokens=8, truncate=None,
                          template=run_template_options(str(some), None, False, pair.tokenizer))
    failed, rendered = encode(chats)
    assert isinstance(failed, RowError) and "ZeroDivisionError" in failed.message
    assert not isinstance(rendered, RowError)
    assert isinstance(encode(chats[:1])[0], RowError)  # later windows: row errors, the template proven
