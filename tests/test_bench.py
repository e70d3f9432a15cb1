"""The benchmark runs end to end on a tiny pair and reports every column (no timing asserted)."""

from pathlib import Path

from batchspec.bench import bench

PLAIN_PROMPTS = Path(__file__).resolve().parents[1] / "sample_data" / "plain_prompts.jsonl"


def test_bench_table(tiny_pair):
    target, draft = tiny_pair("llama")
    report = bench(target=str(target), draft=str(draft), prompts=str(PLAIN_PROMPTS), rows=3, batch_sizes=[1, 3],
                   drafters=["model", "ngram", "hybrid"], gammas=[2], gamma_max=3, ngram_min=1, ngram_max=3,
                   max_new_tokens=8, repeats=1, dtype="float32", device="cpu", with_options=True, samples=3)
    lines = report.splitlines()
    assert "3 prompts" in lines[2]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines
            if line.startswith("| ") and not line.startswith("| batch")]
    assert [r[:2] for r in rows] == [
        ["1", "hf generate"], ["1", "hf assisted"], ["1", "hf prompt lookup"], ["1", "ar"], ["1", "spec gamma=2"],
        ["1", "spec auto"], ["1", "ngram auto"], ["1", "hybrid auto"], ["1", "ar + options"],
        ["1", "spec auto + options"], ["1", "ar x3 copies"], ["1", "ar n=3"],
        ["3", "hf generate"], ["3", "ar"], ["3", "spec gamma=2"], ["3", "spec auto"], ["3", "ngram auto"],
        ["3", "hybrid auto"], ["3", "ar + options"], ["3", "spec auto + options"], ["3", "ar x3 copies"],
        ["3", "ar n=3"],
    ]  # assisted generation and prompt lookup take one row at a time
    for r in rows:
        assert all(float(cell) > 0 for cell in r[2:5])  # tok/s, x ar, x hf
        assert r[5] == "3/3"  # greedy float32: every method's completions equal ar's (+ options: ar's with
        # them; n=3, its one prompt prefilled once: the copies', each prefilled)
        if "auto" in r[1] or r[1].endswith("gamma=2"):
            alpha, accepted, used, ideal, achieved = r[6:]
            shares = dict(part.split(":") for part in used.split())
            assert sum(int(share.rstrip("%")) for share in shares.values()) in (99, 100, 101)
            assert "auto" in r[1] or shares == {"2": "100%"}
            if shares != {"0": "100%"}:  # auto may have found plain steps faster throughout
                assert 0 <= float(alpha) <= 1 and 0 <= float(accepted) <= 3
            if r[1] != "hybrid auto":  # a hybrid's steps mix costs: no ideal
                assert float(ideal) > 0 and float(achieved) > 0
        else:
            assert r[6:] == ["", "", "", "", ""]
    verdicts = [line for line in lines if line.startswith("batch ")]
    assert [v.split(":")[0] for v in verdicts] == ["batch 1", "batch 3"]
    assert all("best fixed (spec gamma=2)" in v and "ngram auto" in v and "hybrid auto" in v for v in verdicts)
    assert all("ar + options" in v and "spec auto + options" in v and "ar n=3 " in v and "x 3 copies" in v
               for v in verdicts)


def test_bench_without_a_draft_model(tiny_pair):
    """--drafters ngram needs no draft: ar, transformers' generate and prompt lookup, ngram auto."""
    target, _ = tiny_pair("llama")
    report = bench(target=str(target), draft=None, prompts=str(PLAIN_PROMPTS), rows=2, batch_sizes=[1],
                   drafters=["ngram"], gammas=[2], gamma_max=3, ngram_min=1, ngram_max=3, max_new_tokens=6,
                   repeats=1, dtype="float32", device="cpu")
    methods = [line.split("|")[2].strip() for line in report.splitlines() if line.startswith("| 1 ")]
    assert methods == ["hf generate", "hf prompt lookup", "ar", "ngram auto"]
    assert all(line.split("|")[6].strip() == "2/2" for line in report.splitlines() if line.startswith("| 1 "))
