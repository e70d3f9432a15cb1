"""Inputs people have: Hub-layout dataset folders, OpenAI-batch files; kept fields; output as a dataset."""

import os

import orjson
import pytest
import torch

from openai.types import Completion
from openai.types.chat import ChatCompletion

from batchspec.buckets import cut
from batchspec.errors import UsageError
from batchspec.models import load_pair
from batchspec.records import by_text
from batchspec.sources import Fields, Row, read_input
from test_job import run_here

README = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*.parquet
  - split: test
    path: data/test-*.parquet
- config_name: hard
  data_files:
  - split: train
    path: hard/*.parquet
---
# a tiny dataset laid out like a Hub repository
"""
WORDS = "the cat sat on a mat and then went home to read a small book".split()


def question(k: int) -> str:
    return " ".join(WORDS[(k * 3 + j) % len(WORDS)] for j in range(2 + k % 7))


@pytest.fixture(scope="module")
def dataset_folder(tmp_path_factory):
    """Two train shards, a test shard and a second config, written as parquet."""
    from datasets import Dataset

    root = tmp_path_factory.mktemp("hub") / "owner__name"
    (root / "data").mkdir(parents=True)
    (root / "hard").mkdir()
    (root / "README.md").write_text(README)
    for shard, ks in (("train-00000-of-00002", range(0, 12)), ("train-00001-of-00002", range(12, 25)),
                      ("test-00000-of-00001", range(100, 104))):
        Dataset.from_dict({"qid": [f"q{k}" for k in ks], "question": [question(k) for k in ks],
                           "topic": [f"t{k % 3}" for k in ks]}).to_parquet(root / "data" / f"{shard}.parquet")
    Dataset.from_dict({"qid": ["h1", "h2"], "question": ["the old book", "a small cat"],
                       "topic": ["x", "y"]}).to_parquet(root / "hard" / "part.parquet")
    return root


@pytest.fixture(scope="module")
def models(tiny_pair):
    target, draft = tiny_pair("llama")
    # a fixed gamma: under --gamma auto the gamma sequence, and with it which sample a row draws, follows timing
    return ["--target", str(target), "--draft", str(draft), "--gamma", "3", "--max-new-tokens", "12",
            "--no-progress", "--token-ids"]


def records(path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_dataset_folder_streams_every_row_and_resumes(dataset_folder, models, tmp_path):
    out = tmp_path / "out.jsonl"
    args = [str(dataset_folder), "--split", "train", "--prompt-field", "question", "--id-field", "qid",
            "--out", str(out), *models]
    result = run_here(*args)
    assert result.exit_code == 0, result.output
    first = sorted(out.read_bytes().splitlines())
    assert sorted(r["id"] for r in map(orjson.loads, first)) == sorted(f"q{k}" for k in range(25))
    out.write_bytes(b"".join(line + b"\n" for line in first[:10]))  # as if killed after 10 rows
    result = run_here(*args)
    assert result.exit_code == 0, result.output
    assert "resuming" in result.output and sorted(out.read_bytes().splitlines()) == first


def test_dataset_split_and_subset(dataset_folder, models, tmp_path):
    out = tmp_path / "test.jsonl"
    base = [str(dataset_folder), "--prompt-field", "question", "--id-field", "qid", *models]
    assert run_here(*base, "--split", "test", "--out", str(out)).exit_code == 0
    assert {r["id"] for r in records(out)} == {"q100", "q101", "q102", "q103"}
    out = tmp_path / "hard.jsonl"
    assert run_here(*base, "--subset", "hard", "--out", str(out)).exit_code == 0
    assert {r["id"] for r in records(out)} == {"h1", "h2"}


@pytest.mark.parametrize("args, message", [
    (["--split", "validation"], "cannot open dataset"),
    (["--prompt-field", "nope"], "has no 'nope' or 'messages' field"),
    (["--subset", "missing"], "cannot open dataset"),
])
def test_dataset_errors_are_one_line_and_exit_2(dataset_folder, models, tmp_path, args, message):
    result = run_here(str(dataset_folder), "--id-field", "qid", "--out", str(tmp_path / "o.jsonl"), *models, *args)
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_hub_dataset_offline_is_a_clear_error(models, tmp_path):
    result = run_here("hf:someone/no-such-dataset", "--out", str(tmp_path / "o.jsonl"), *models)
    assert result.exit_code == 2 and os.environ["HF_DATASETS_OFFLINE"] == "1"  # conftest's: never the network
    assert "cannot open dataset 'someone/no-such-dataset'" in result.output and "Traceback" not in result.output


def request(custom_id, body, url="/v1/chat/completions"):
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + b"\n"


def test_openai_batch_rows_with_per_row_options(tiny_pair, models, tmp_path):
    chat = [{"role": "user", "content": "the cat sat on a mat"}]
    pair = load_pair(models[1], dtype="float32", device="cpu")
    ids = torch.tensor([list(pair.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))])
    full = pair.target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                                pad_token_id=0)[0, ids.shape[1] :].tolist()
    text = pair.tokenizer.decode(full, skip_special_tokens=True)
    boundary = len(pair.tokenizer.decode(full[:3], skip_special_tokens=True))
    stop = text[boundary - 1 : boundary + 2]  # spans tokens 3 and 4
    stop_at = next(j for j in range(1, len(full) + 1)
                   if stop in pair.tokenizer.decode(full[:j], skip_special_tokens=True))
    source = tmp_path / "batch.jsonl"
    source.write_bytes(
        request("short", {"model": "m", "messages": chat, "max_tokens": 3})
        + request("long", {"model": "m", "messages": chat, "max_tokens": 10})
        + request("text", {"model": "m", "prompt": "the old house", "max_tokens": 5}, url="/v1/completions")
        + request("hot", {"model": "m", "messages": chat, "temperature": 1.0, "seed": 7, "max_tokens": 10})
        + request("hot3", {"model": "m", "messages": chat, "temperature": 1.0, "seed": 7, "max_tokens": 10, "n": 3})
        + request("top1", {"model": "m", "messages": chat, "temperature": 1.0, "seed": 7, "max_tokens": 10, "top_k": 1})
        + request("bad", {"model": "m", "messages": chat, "max_tokens": -1})
        + request("stop", {"model": "m", "messages": chat, "max_tokens": 10, "stop": ["never", stop]})
        + request("lp", {"model": "m", "messages": chat, "max_tokens": 10, "logprobs": True, "top_logprobs": 2})
        + request("textlp", {"model": "m", "prompt": "the old house", "max_tokens": 5, "logprobs": 3},
                  url="/v1/completions")
        + request("bias", {"model": "m", "messages": chat, "max_tokens": 10, "logit_bias": {str(full[0]): -100}})
        + request("badbias", {"model": "m", "messages": chat, "logit_bias": {"123456789": 5}})
        + request("stopid", {"model": "m", "messages": chat, "max_tokens": 10, "stop_token_ids": [full[4]]})
        + request("noeos", {"model": "m", "messages": chat, "max_tokens": 10, "ignore_eos": True})
        + request("embed", {"model": "m", "input": "x"}, url="/v1/embeddings")
    )
    out = tmp_path / "out.jsonl"
    result = run_here(str(source), "--out", str(out), *models, "--output-format", "openai")
    assert result.exit_code == 3, result.output
    by_id = {r["custom_id"]: r for r in records(out)}
    assert set(by_id) == {"short", "long", "text", "hot", "hot3", "top1", "stop", "stopid", "noeos", "lp", "textlp",
                          "bias"}
    errors = {e["id"]: e["error"] for e in records(tmp_path / "out.errors.jsonl")}
    assert {i: e["type"] for i, e in errors.items()} == dict.fromkeys(("bad", "embed", "badbias"), "invalid_request")
    assert "logit_bias names token ids the tokenizer does not have" in errors["badbias"]["message"]
    for record in by_id.values():  # every line parses with the official client's types
        body = record["response"]["body"]
        (ChatCompletion if body["object"] == "chat.completion" else Completion).model_validate(body)

    stopped = by_id["stop"]["response"]["body"]  # a stop string across tokens: cut right before it
    assert stopped["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert stopped["batchspec"]["token_ids"] == full[:stop_at] and stopped["choices"][0]["finish_reason"] == "stop"
    content = by_id["lp"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert [len(entry["top_logprobs"]) for entry in content] == [2] * 10
    assert all(entry["logprob"] == entry["top_logprobs"][0]["logprob"] <= 0 for entry in content)  # greedy: the top 1
    textlp = by_id["textlp"]["response"]["body"]["choices"][0]
    assert len(textlp["logprobs"]["tokens"]) == len(textlp["logprobs"]["text_offset"]) == 5
    assert "".join(textlp["logprobs"]["tokens"]) == textlp["text"] and textlp["logprobs"]["text_offset"][0] == 0
    assert by_id["bias"]["response"]["body"]["batchspec"]["token_ids"][0] != full[0]  # -100: never chosen

    for name, limit in (("short", 3), ("long", 10)):  # batch mates with different max_tokens
        body = by_id[name]["response"]["body"]
        assert body["batchspec"]["token_ids"] == full[:limit]
        assert body["usage"]["completion_tokens"] == limit
        assert body["choices"][0]["finish_reason"] == "length"
    record = by_id["long"]
    assert record["error"] is None and record["response"]["status_code"] == 200
    assert record["id"].startswith("batch_req_") and record["response"]["body"]["object"] == "chat.completion"
    assert record["response"]["body"]["choices"][0]["message"]["content"] == pair.tokenizer.decode(
        full, skip_special_tokens=True)
    assert by_id["text"]["response"]["body"]["object"] == "text_completion"
    assert "text" in by_id["text"]["response"]["body"]["choices"][0]
    hot = by_id["hot"]["response"]["body"]["batchspec"]["token_ids"]
    assert hot != full  # sampled at the row's own temperature, not greedy
    hot3 = by_id["hot3"]["response"]["body"]  # n: 3 choices in one line, usage summed
    samples = [s["token_ids"] for s in hot3["batchspec"]["samples"]]
    assert [c["index"] for c in hot3["choices"]] == [0, 1, 2]
    assert len(set(map(tuple, samples))) == 3 and hot not in samples  # each seeded on its own (and by its row id)
    assert hot3["usage"]["completion_tokens"] == sum(map(len, samples)) == hot3["batchspec"]["completion_tokens"]
    assert by_id["top1"]["response"]["body"]["batchspec"]["token_ids"] == full  # its own top_k 1: the greedy tokens
    stopped = by_id["stopid"]["response"]["body"]
    assert stopped["batchspec"]["token_ids"] == full[: full.index(full[4]) + 1]  # its own stop id ends it, kept
    assert stopped["choices"][0]["finish_reason"] == "stop"
    unstopped = by_id["noeos"]["response"]["body"]  # runs to max_tokens, through any EOS
    assert unstopped["batchspec"]["token_ids"][: len(full)] == full and unstopped["usage"]["completion_tokens"] == 10
    assert unstopped["choices"][0]["finish_reason"] == "length"
    again = tmp_path / "again.jsonl"
    assert run_here(str(source), "--out", str(again), *models, "--output-format", "openai").exit_code == 3
    hot_again = {r["custom_id"]: r for r in records(again)}["hot"]["response"]["body"]["batchspec"]["token_ids"]
    assert hot_again == hot  # the row's seed fixes its sample


def test_rows_with_their_own_sampling_are_batched_apart():
    def row(k, **options):
        return Row(str(k), k, "p", {}, options=options), [1] * (10 - k)

    batches = list(cut([row(0), row(1, temperature=0.7), row(2), row(3, temperature=0.7, top_p=0.9),
                        row(4, max_new_tokens=3), row(5, temperature=0.7, top_k=5), row(6, temperature=0.7, top_k=5)],
                       batch_size=8, max_batch_tokens=None, max_new_tokens=5))
    assert sorted(sorted(r.id for r in b.rows) for b in batches) == [["0", "2", "4"], ["1"], ["3"], ["5", "6"]]


def test_keep_fields_and_output_loads_as_a_dataset(models, tmp_path):
    from datasets import load_dataset

    source = tmp_path / "mixed.jsonl"
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in [
        {"id": 7, "prompt": "the cat", "topic": "pets", "score": 1.5},
        {"id": "b", "messages": [{"role": "user", "content": "a mat"}], "topic": "home"},
        {"prompt": "then went home", "score": 2.0},
    ]))
    out = tmp_path / "out.jsonl"
    result = run_here(str(source), "--out", str(out), *models, "--keep-fields", "topic,score")
    assert result.exit_code == 0, result.output
    rows = {r["id"]: r for r in records(out)}
    assert set(rows) == {"7", "b", "3"}  # ids are strings: one type per file
    assert rows["7"]["topic"] == "pets" and rows["b"]["score"] is None and rows["3"]["score"] == 2.0
    dataset = load_dataset("json", data_files=str(out), split="train")
    assert dataset.num_rows == 3 and {"id", "completion", "topic", "score", "stats"} <= set(dataset.column_names)
    every = tmp_path / "every.jsonl"
    assert run_here(str(source), "--out", str(every), *models, "--keep-all-fields").exit_code == 0
    assert {r["id"]: r.get("topic") for r in records(every)} == {"7": "pets", "b": "home", "3": None}
    clash = run_here(str(source), "--out", str(tmp_path / "c.jsonl"), *models, "--keep-fields", "completion")
    assert clash.exit_code == 2 and "already an output field" in clash.output


def test_read_input_refuses_a_missing_path(tmp_path):
    with pytest.raises(UsageError, match="input not found"):
        read_input(str(tmp_path / "nothing.jsonl"), Fields())


def test_a_completions_top_logprobs_keeps_the_likeliest_of_tokens_that_read_the_same():
    """Two byte pieces both read U+FFFD: the dict OpenAI's completions format holds keeps the
    likelier's logprob, not the last one's."""
    text = {5: "\ufffd", 6: "\ufffd", 7: "a"}.__getitem__
    assert by_text([(5, -0.5), (7, -1.0), (6, -2.0)], text) == {"\ufffd": -0.5, "a": -1.0}
