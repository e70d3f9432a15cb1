"""The Python API over rows: a Generator's records are `batchspec run`'s for the same rows, error
rows and OpenAI-batch rows included, in input order or as batches finish, and through
datasets.Dataset.map."""

import orjson
import pytest

from batchspec import Generator
from test_job import run_here, sidecar

ROWS = [
    {"id": "plain", "prompt": "the cat sat on the mat and"},
    {"id": "chat", "messages": [{"role": "user", "content": "tell me about the old house"}]},
    {"id": "no-prompt"},
    {"custom_id": "request", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "a small book"}], "max_tokens": 5, "logprobs": True}},
    {"custom_id": "bad-request", "body": {"messages": [{"role": "user", "content": "x"}], "n": 0}},
    {"id": "long", "prompt": "water in the old house " * 6},
    {"id": "chat", "prompt": "a duplicate id"},
    {"id": 7, "prompt": "then it went home"},
    {"prompt": "no id: the line number is the id"},
]
VOLATILE = ("created", "finished_at")  # a record's clock readings


def steady(record):
    """A record without its clock readings."""
    if isinstance(record, dict):
        return {k: steady(v) for k, v in record.items() if k not in VOLATILE}
    return [steady(v) for v in record] if isinstance(record, list) else record


@pytest.fixture(scope="module")
def options(tiny_pair) -> dict:
    target, draft = tiny_pair("llama")
    return {"target": str(target), "draft": str(draft), "gamma": 3, "max_new_tokens": 12, "batch_size": 3,
            "token_ids": True}


@pytest.fixture(scope="module")
def generator(options) -> Generator:
    return Generator(**options, progress=False)


@pytest.fixture(scope="module")
def run_output(options, tmp_path_factory):
    """What `batchspec run` writes for ROWS (one JSONL line each): (records by id, error lines)."""
    root = tmp_path_factory.mktemp("api")
    source, out = root / "in.jsonl", root / "out.jsonl"
    source.write_bytes(b"\n".join(orjson.dumps(row) for row in ROWS) + b"\n")
    flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in options.items()]
    result = run_here(str(source), "--out", str(out), "--no-progress", *flags)
    assert result.exit_code == 3, result.output
    records = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    errors = [orjson.loads(line) for line in sidecar(out, ".errors.jsonl").read_bytes().splitlines()]
    return records, errors


def key(record: dict):
    return record.get("line") if "error" in record and "line" in record else record.get("custom_id", record["id"])


def test_generator_records_equal_the_runs(generator, run_output):
    records, errors = run_output
    written = {key(r): steady(r) for r in records + errors}
    generated = list(generator.generate(ROWS))
    assert [key(r) for r in generated] == ["plain", "chat", 3, "request", 5, "long", 7, "7", "9"]  # input order
    assert {key(r): steady(r) for r in generated} == written


def test_completion_order_yields_the_same_records(generator):
    ordered = [steady(r) for r in generator.generate(ROWS)]
    as_done = [steady(r) for r in generator.generate(ROWS, ordered=False)]
    assert sorted(map(orjson.dumps, as_done)) == sorted(map(orjson.dumps, ordered))


def test_datasets_map_gives_the_same_completions(generator, run_output):
    import datasets

    records, _ = run_output
    prompts = [r["prompt"] for r in records if "prompt" in r]
    dataset = datasets.Dataset.from_dict({"prompt": prompts + [None]})  # a row without a prompt: an error
    mapped = dataset.map(generator.map, batched=True, batch_size=2, with_indices=True)
    assert mapped["completion"][:-1] == [r["completion"] for r in records if "prompt" in r]
    assert mapped["completion"][-1] == "" and mapped["error"][-1].startswith("missing_prompt: ")
    assert mapped["finish_reason"][-1] == "error" and mapped["error"][:-1] == [""] * len(prompts)
    assert set(mapped["finish_reason"][:-1]) <= {"stop", "length"}


def test_unknown_options_are_named(options):
    with pytest.raises(TypeError, match="unknown option.*max_tokens"):
        Generator(**options, max_tokens=5)


def test_a_batch_that_would_not_fit_memory_is_split(generator, monkeypatch, capsys):
    """Batches whose caches and logits would not fit the free memory are halved down to single
    rows, said once: the same completions."""
    whole = {key(r): r.get("completion") for r in generator.generate(ROWS)}
    sizes = []
    decode = generator.decode
    monkeypatch.setattr(generator, "decode", lambda batch: sizes.append(len(batch.rows)) or decode(batch))
    monkeypatch.setattr("batchspec.api.free_bytes", lambda device: 0)  # no batch of several rows fits
    monkeypatch.setattr(generator, "split_said", False)
    assert {key(r): r.get("completion") for r in generator.generate(ROWS)} == whole
    assert sizes and set(sizes) == {1}
    assert capsys.readouterr().err.count("split in halves") == 1
