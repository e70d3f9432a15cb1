"""The benchmark runs end to end on a tiny pair and reports every column (no timing asserted)."""

from pathlib import Path

from batchspec.bench import bench

PLAIN_PROMPTS = Path(__file__).resolve().parents[1] / "sample_data" / "plain_prompts.jsonl"


def test_bench_table(tiny_pair):
    target, draft = tiny_pair("llama")
    table = bench(target=str(target), draft=str(draft), prompts=str(PLAIN_PROMPTS),
                  batch_sizes=[1, 3], gamma=3, max_new_tokens=8, repeats=1, dtype="float32", device="cpu")
    lines = table.splitlines()
    assert "| batch | spec tok/s | ar tok/s | hf generate tok/s | spec/ar | spec/hf | acceptance |" in lines
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| ") and not line.startswith("| batch")]
    assert [r[0].strip() for r in rows] == ["1", "3"]
    for r in rows:
        assert all(float(cell.strip().rstrip("x")) > 0 for cell in r[1:6])
        assert 0 <= float(r[6]) <= 1
