"""Chat rows: messages rendered with the target's chat template, --chat and --system."""

import orjson
import pytest
import torch

from batchspec.buckets import make_encoder
from batchspec.errors import UsageError
from batchspec.models import load_pair
from batchspec.sources import Row, read_jsonl
from test_job import run_cli


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


def test_tokenizer_without_template_is_a_clear_usage_error(pair):
    tok = pair.tokenizer
    saved, tok.chat_template = tok.chat_template, None
    try:
        encode = make_encoder(tok, context_length=None, max_new_tokens=8, truncate=None)
        with pytest.raises(UsageError, match="no chat template"):
            encode([Row(1, 1, None, {}, messages=[{"role": "user", "content": "hi"}])])
    finally:
        tok.chat_template = saved


def test_bad_messages_are_error_rows(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": 1, "messages": []}\n{"id": 2, "messages": [{"role": "user"}]}\n'
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
    result = run_cli(str(source), "--out", str(out), "--target", str(target), "--draft", str(draft),
                     "--max-new-tokens", "16", "--token-ids", "--no-progress")
    assert result.returncode == 0, result.stderr
    records = {r["id"]: r for r in map(orjson.loads, out.read_bytes().splitlines())}
    for k, messages in enumerate(chats):
        ids = torch.tensor([templated(pair.tokenizer, messages)])
        expected = pair.target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                                        pad_token_id=0)[0, ids.shape[1] :].tolist()
        record = records[str(k)]
        assert record["messages"] == messages and "prompt" not in record
        assert record["token_ids"] == expected
        assert record["stats"]["prompt_tokens"] == ids.shape[1]  # the templated length
