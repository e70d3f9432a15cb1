"""The benchmark runs end to end on a tiny pair and reports every column, writes its files and
plots (no timing asserted); its fidelity and memory measures."""

import csv
import json
import math
import random
import re
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from batchspec import bench as bench_module
from batchspec.bench import (AR, ASSISTED, AUTO, HF, Cell, ForwardCosts, PeakMemory, Run, bench, best_of, faster,
                             geometric_alpha, ideal_speedup, interleaved, settle, verdicts)
from batchspec.decoding import DecodeConfig
from batchspec.bench_files import COLUMNS
from batchspec.cli import main
from batchspec.errors import UsageError
from batchspec.fidelity import jensen_shannon, mean_jsd, mismatches
from batchspec.models import load_pair

PLAIN_PROMPTS = Path(__file__).resolve().parents[1] / "sample_data" / "plain_prompts.jsonl"


def test_bench_table(tiny_pair, tmp_path):
    target, draft = tiny_pair("llama")
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}')
    report = bench(target=str(target), draft=str(draft), prompts=str(PLAIN_PROMPTS), rows=3, batch_sizes=[1, 3],
                   drafters=["model", "ngram", "hybrid"], gammas=[2], gamma_max=3, ngram_min=1, ngram_max=3,
                   max_new_tokens=8, repeats=1, dtype="float32", device="cpu", with_options=True, samples=3,
                   json_schema=str(schema), tree_widths=(2,))
    lines = report.splitlines()
    assert "3 prompts" in lines[2] and "methods in lockstep" in lines[2]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines
            if line.startswith("| ") and not line.startswith("| batch")]
    assert [r[:2] for r in rows] == [
        ["1", "hf generate"], ["1", "hf assisted"], ["1", "hf prompt lookup"], ["1", "ar"], ["1", "spec gamma=2"],
        ["1", "spec tree w=2 gamma=2"], ["1", "spec tree w=2 auto"], ["1", "spec auto"], ["1", "ngram auto"],
        ["1", "hybrid auto"], ["1", "ar + options"],
        ["1", "spec auto + options"], ["1", "ar + schema"], ["1", "spec auto + schema"],
        ["1", "spec auto + schema, no jump"], ["1", "ar x3 copies"], ["1", "ar n=3"],
        ["3", "hf generate"], ["3", "ar"], ["3", "spec gamma=2"], ["3", "spec tree w=2 gamma=2"],
        ["3", "spec tree w=2 auto"], ["3", "spec auto"], ["3", "ngram auto"],
        ["3", "hybrid auto"], ["3", "ar + options"], ["3", "spec auto + options"], ["3", "ar + schema"],
        ["3", "spec auto + schema"], ["3", "spec auto + schema, no jump"], ["3", "ar x3 copies"], ["3", "ar n=3"],
    ]  # assisted generation and prompt lookup take one row at a time
    for r in rows:
        assert all(float(cell) > 0 for cell in r[2:5])  # tok/s, x ar, x hf
        assert r[5] == "3/3"  # greedy float32: every method's completions equal ar's (+ options, + schema:
        # ar's with them; n=3, its one prompt prefilled once: the copies', each prefilled)
        if "auto" in r[1] or r[1].endswith("gamma=2"):
            alpha, tokens_per_step, accepted, used, ideal, achieved = r[6:]
            shares = dict(part.split(":") for part in used.split())
            assert sum(int(share.rstrip("%")) for share in shares.values()) in (99, 100, 101)
            assert "auto" in r[1] or shares == {"2": "100%"}
            if shares != {"0": "100%"}:  # auto may have found plain steps faster throughout
                assert 0 <= float(alpha) <= 1 and 0 <= float(accepted) <= 3 and 1 <= float(tokens_per_step) <= 4
            if r[1] != "hybrid auto":  # a hybrid's steps mix costs: no ideal
                assert float(ideal) > 0 and float(achieved) > 0
        else:
            assert r[6:] == ["", "", "", "", "", ""]
    verdicts = [line for line in lines if line.startswith("batch ")]
    assert [v.split(":")[0] for v in verdicts] == ["batch 1", "batch 3"]
    assert all("best fixed (spec gamma=2)" in v and "ngram auto" in v and "hybrid auto" in v for v in verdicts)
    assert all(re.search(r"fastest tree spec tree w=2 (auto|gamma=2) [\d.]+x the chain \(spec (auto|gamma=2)\)", v)
               for v in verdicts)
    assert all("ar + options" in v and "spec auto + options" in v and "ar n=3 " in v and "x 3 copies" in v
               for v in verdicts)
    assert all(re.search(r"ar \+ schema [\d.]+x ar \(masks \d+ us/token\), spec auto \+ schema [\d.]+x it, "
                         r"[\d.]+x without jump-forward", v) for v in verdicts)
    schema.write_text('{"type": "array", "uniqueItems": true}')  # a keyword the engine cannot enforce
    with pytest.raises(UsageError, match="--json-schema: .*uniqueItems"):
        bench(target=str(target), draft=str(draft), prompts=str(PLAIN_PROMPTS), rows=1, batch_sizes=[1],
              drafters=["model"], gammas=[], gamma_max=3, ngram_min=1, ngram_max=3, max_new_tokens=8, repeats=1,
              dtype="float32", device="cpu", json_schema=str(schema))


def test_bench_without_a_draft_model(tiny_pair):
    """--drafters ngram,suffix need no draft: ar, transformers' generate and prompt lookup, ngram
    and suffix auto (each priced at the target's forwards alone);
    here each decoding whole batches in turn (--interleave batch), and ar again (--control),
    which the verdict sets against ar and never names the fastest."""
    target, _ = tiny_pair("llama")
    report = bench(target=str(target), draft=None, prompts=str(PLAIN_PROMPTS), rows=2, batch_sizes=[1],
                   drafters=["ngram", "suffix"], gammas=[2], gamma_max=3, ngram_min=1, ngram_max=3, max_new_tokens=6,
                   repeats=1, dtype="float32", device="cpu", interleave="batch", control=True)
    assert "each method a whole batch in turn" in report.splitlines()[2]
    methods = [line.split("|")[2].strip() for line in report.splitlines() if line.startswith("| 1 ")]
    assert methods == ["hf generate", "hf prompt lookup", "ar", "ar again", "ngram auto", "suffix auto"]
    verdict = next(line for line in report.splitlines() if line.startswith("batch 1:"))
    assert re.search(r"; ar again [\d.]+x ar \(the noise of these ratios\)$", verdict)
    assert not verdict.startswith("batch 1: fastest ar again")
    assert all(line.split("|")[6].strip() == "2/2" for line in report.splitlines() if line.startswith("| 1 "))


def test_bench_files_plots_and_best_configs(tiny_pair, tmp_path):
    """--out-dir: every column filled where it applies, each pass kept, plots that are real
    images; --write-config: one --config file per batch size that `batchspec run` reads back."""
    target, draft = tiny_pair("llama")
    report = bench(target=str(target), draft=str(draft), prompts=str(PLAIN_PROMPTS), rows=2, batch_sizes=[1, 2],
                   drafters=["model", "ngram"], gammas=[1, 2], gamma_max=3, ngram_min=1, ngram_max=3,
                   max_new_tokens=6, repeats=2, dtype="float32", device="cpu", out_dir=str(tmp_path / "out"),
                   write_config=str(tmp_path / "best.toml"))
    with open(tmp_path / "out" / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == COLUMNS and len(rows) == 8 + 6  # hf (3 at batch 1), ar, gammas 1, 2, auto, ngram auto
    mismatch = [c for c in COLUMNS if c.startswith("first_mismatch")]
    for column in set(COLUMNS) - set(mismatch):
        assert any(row[column] != "" for row in rows), column
    assert all(row["rows_equal_ar"] == row["rows"] == "2" and all(row[c] == "" for c in mismatch) for row in rows)
    spec = [row for row in rows if row["method"] == "spec"]
    assert {row["gamma"] for row in spec} == {"1", "2", "auto"}
    assert all(float(row["wasted_cache_fraction"]) >= 0 and float(row["target_forwards_per_token"]) > 0 for row in spec)
    assert 0 < float(rows[0]["jsd_target_draft"]) < math.log(2)
    results = json.loads((tmp_path / "out" / "results.json").read_text())["results"]
    assert all(len(r["times"]) == 2 for r in results)
    for name in ("speedup_vs_gamma.png", "alpha_vs_gamma.png", "throughput_vs_batch.png"):
        with Image.open(tmp_path / "out" / name) as image:
            assert image.width >= 400 and image.height >= 300, name
            assert len(image.convert("RGB").getcolors(maxcolors=1 << 20)) > 50, name  # lines, text, not blank
        assert f"wrote {tmp_path / 'out' / name}" in report
    for size in (1, 2):
        path = tmp_path / f"best-b{size}.toml"
        fastest = max((r for r in rows if r["batch_size"] == str(size) and r["method"] in ("ar", "spec", "ngram")),
                      key=lambda r: float(r["speedup_vs_ar"]))
        printed = CliRunner().invoke(main, ["run", "in.jsonl", "--out", "o.jsonl", "--config", str(path),
                                            "--print-config"]).output
        assert f"batch_size = {size}" in printed and f'target = "{target}"' in printed
        assert ('mode = "ar"' if fastest["method"] == "ar" else 'mode = "spec"') in printed, (fastest, printed)


def test_mismatches_name_the_position_and_the_targets_margin(tiny_pair):
    pair = load_pair(*map(str, tiny_pair("llama")), dtype="float32", device="cpu")
    prompt = pair.tokenizer("the cat sat")["input_ids"]
    ids = torch.tensor([prompt])
    greedy = pair.target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=5,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    wrong = greedy[:2] + [(greedy[2] + 1) % 50] + greedy[3:]
    [found] = mismatches(pair.target, [prompt, prompt], [greedy, wrong], [greedy, greedy])
    logits = pair.target(torch.tensor([prompt + greedy[:2]])).logits[0, -1]
    top = logits.topk(2).values
    assert found["row"] == 1 and found["position"] == 2 and abs(found["margin"] - (top[0] - top[1]).item()) < 1e-4
    assert mean_jsd(pair.target, pair.target, [prompt], [greedy]) < 1e-6  # a draft that is the target
    assert mean_jsd(pair.target, pair.draft, [prompt], [greedy]) > 1e-4
    vocab = pair.draft.get_input_embeddings().num_embeddings
    pair.draft.resize_token_embeddings(vocab - 8)  # a draft that covers part of the target's ids
    assert 0 < mean_jsd(pair.target, pair.draft, [prompt], [greedy[:2] + [vocab - 1] + greedy[2:]]) < math.log(2)


def test_alpha_is_the_per_proposal_acceptance_whatever_the_gammas():
    """Steps of gamma 1, 3 and 8 whose proposals are each accepted with probability 0.8 until the
    first rejection: the fit finds 0.8 (accepted / drafted would say ~0.6)."""
    rng = random.Random(0)
    gammas = [rng.choice([1, 3, 8]) for _ in range(20000)]
    accepted = [next((i for i in range(g) if rng.random() >= 0.8), g) for g in gammas]
    shares = {g: gammas.count(g) / len(gammas) for g in (1, 3, 8)}
    assert geometric_alpha(sum(accepted) / len(gammas), shares) == pytest.approx(0.8, abs=0.01)
    assert sum(accepted) / sum(gammas) < 0.65
    assert geometric_alpha(5.0, {5: 1.0}) == pytest.approx(1.0) and geometric_alpha(0.0, {5: 1.0}) == pytest.approx(0)


def test_the_ideal_counts_every_forward_a_run_takes():
    """alpha 0.5, gamma 1: E = 1.5 tokens per step of 3 s against 1 s a plain step. Rows of 1 + 300
    tokens with a 10 s prefill (the draft's: 5 s): ar 10 + 300, spec 10 + 5 + 300 / 1.5 * 3; no
    prefill: E / 3 = 0.5; n-gram lookup: the target's forward over 2 tokens, no draft prefill."""
    costs = ForwardCosts(target=[1.0, 2.0], step=[3.0], prefill=(10.0, 5.0))
    assert costs.ideal(0.5, 1, tokens=301) == pytest.approx(310 / 615)
    assert costs.ideal(0.5, 1, tokens=301, drafts=False) == pytest.approx(310 / 410)
    assert ForwardCosts([1.0, 2.0], [3.0], (0.0, 0.0)).ideal(0.5, 1, tokens=301) == pytest.approx(0.5)
    assert costs.ideal(0.5, 1, tokens=1) == pytest.approx(10 / 15)  # the prefill's token only


def test_autos_ideal_takes_the_alpha_most_proposals_measured():
    """auto's two probes at batch 1 both missed (alpha 0): its ideal is priced at the alpha 0.4
    that gamma 1 measured on 100 proposals (E 1.4 for a step of 1.2 plain steps), not at 1 (plain
    steps), and not at another batch size's or another drafter's alpha."""
    def cell(size, config, histogram, accepted, draft="draft"):
        stats = {"gamma_histogram": histogram, "accepted_tokens": accepted, "draft_tokens": sum(histogram[1:])}
        c = Cell(size, AUTO if config.gamma is None else f"spec gamma={config.gamma}", config, draft,
                 outputs=[[7] * 101], stats=[stats])
        c.policy = config.policy()
        return c

    base = DecodeConfig(max_new_tokens=101)
    auto, fixed = cell(1, base, [98, 2], 0), cell(1, DecodeConfig(101, gamma=1), [1, 100], 40)
    others = [cell(4, DecodeConfig(101, gamma=1), [1, 400], 360),
              cell(1, DecodeConfig(101, gamma=1, ngram=(1, 3)), [1, 400], 360, draft=None)]
    costs = ForwardCosts(target=[1.0] + [1.1] * 8, step=[1.2] + [10.0] * 7, prefill=(0.0, 0.0))  # gamma 0..8
    assert auto.alpha == pytest.approx(0, abs=1e-6) and fixed.alpha == pytest.approx(0.4)
    assert ideal_speedup(auto, [auto, fixed, *others], costs) == pytest.approx(1.4 / 1.2)
    assert ideal_speedup(auto, [auto, *others], costs) == 1.0


def test_bare_forwards_are_timed_among_the_passes_and_their_medians_priced(tiny_pair, monkeypatch):
    """Bare forwards are timed once a pass on the batches as wide as the first, between the
    methods' runs of them (5 prompts at batch 2: the batches of 2, not the last of 1), on
    COST_BATCHES of them a pass at most, and the ideal prices the costs' medians over those
    samples (ForwardCosts.median: below)."""
    target, draft = tiny_pair("llama")
    pair = load_pair(str(target), str(draft), dtype="float32", device="cpu")
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13], [14, 15, 16], [17, 18]]
    stalled = ForwardCosts([30.0, 40.0], [90.0], (70.0, 50.0))
    first, second, last = (ForwardCosts([1.0, 2.0], [3.0], (4.0, 1.0)), ForwardCosts([1.2, 1.8], [2.8], (3.0, 2.0)),
                           ForwardCosts([0.8, 2.2], [3.4], (5.0, 1.5)))
    fakes = iter([first, second, stalled, last])
    timed_on, order = [], []

    def fake_costs(pair, batch, gamma_max, repeats=5):
        timed_on.append(batch)
        order.append("costs")
        return next(fakes)

    start, hf_generate = bench_module.start, bench_module.hf_generate

    def logged(pair, cell, batch):
        order.append(cell.method)
        return start(pair, cell, batch)

    def logged_hf(pair, batch, config, method, streamer=None):
        order.append(method)
        return hf_generate(pair, batch, config, method, streamer)

    monkeypatch.setattr(bench_module, "forward_costs", fake_costs)
    monkeypatch.setattr(bench_module, "start", logged)
    monkeypatch.setattr(bench_module, "hf_generate", logged_hf)
    base = DecodeConfig(max_new_tokens=4, eos_token_ids=pair.eos_token_ids, gamma_max=1)
    cells = bench_module.bench_size(pair, prompts, 2, ["model"], [1], base, (1, 3), repeats=2, with_options=False,
                                    samples=1)
    assert timed_on == [prompts[0:2], prompts[2:4]] * 2
    timed = order[len(cells):]  # after the warm-ups: 3 batches a pass, each every method's and the costs' turn
    assert len(timed) == 2 * 3 * len(cells) + 4 and timed.count("costs") == 4
    assert timed[: len(cells) + 1].count("costs") == 1  # the first batch's turn
    median = ForwardCosts.median([first, second, stalled, last])
    assert median.step[0] / median.target[0] == pytest.approx(3.0)  # of 2.33, 3.0, 3.0 and 4.25 a plain forward
    for cell in cells:
        if cell.policy is not None:
            assert cell.ideal == pytest.approx(ideal_speedup(cell, cells, median))
    timed_on.clear()
    fakes = iter([first, second])
    monkeypatch.setattr(bench_module, "COST_BATCHES", 2)  # 3 batches a pass: the first's turn and the third's
    bench_module.bench_size(pair, prompts, 2, ["model"], [1], base, (1, 3), repeats=1, with_options=False, samples=1)
    assert timed_on == [prompts[0:2]]  # the third batch holds one prompt


def test_each_cost_is_priced_against_its_own_samples_plain_forward():
    """A step costs 1.1 plain forwards. The second sample ran in a phase twice as slow, the
    third's plain forward in a stall: medians taken apart read a step at 0.55 plain forwards, the
    medians of each sample's costs over its own plain forward 1.1, in seconds at the median
    plain forward (2.0); the stalled sample moves nothing."""
    samples = [ForwardCosts([1.0, 1.05], [1.1], (4.0, 0.5)), ForwardCosts([2.0, 2.1], [2.2], (8.0, 1.0)),
               ForwardCosts([2.0, 1.05], [1.1], (4.0, 0.5))]
    median = ForwardCosts.median(samples)
    assert (median.target, median.step, median.prefill) == (pytest.approx([2.0, 2.1]), pytest.approx([2.2]),
                                                            pytest.approx((8.0, 1.0)))


def test_a_batch_size_of_few_batches_is_timed_in_more_passes(tiny_pair):
    """Every method is timed in min_runs runs of a batch at each batch size: one batch a pass
    takes min_runs passes, three batches a pass take `repeats` (1) alone; the header says so."""
    target, draft = tiny_pair("llama")
    pair = load_pair(str(target), str(draft), dtype="float32", device="cpu")
    prompts, base = [[5, 6, 7], [9, 10, 11], [12, 13]], DecodeConfig(max_new_tokens=3, eos_token_ids=pair.eos_token_ids)
    sizes = {size: bench_module.bench_size(pair, prompts, size, ["model"], [], base, (1, 3), repeats=1,
                                           with_options=False, samples=1, min_runs=3) for size in (1, 3)}
    assert {len(cell.times) for cell in sizes[1]} == {1} and {len(cell.times) for cell in sizes[3]} == {3}
    assert best_of(sizes[1] + sizes[3]) == "each batch the best of 1 runs (batch 3: 3)"
    assert best_of(sizes[1]) == "each batch the best of 1 runs"


def test_jensen_shannon_bounds():
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    q = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    torch.testing.assert_close(jensen_shannon(p, q), torch.tensor([math.log(2), 0.0]))


def test_methods_take_turns_batch_by_batch():
    """Every method decodes a batch before any decodes the next (a machine drifting over minutes
    slows all alike), and no method always runs after the same ones: each batch sees the methods
    in both orders over two passes."""
    order = list(interleaved(["ar", "spec gamma=1", "spec auto"], batches=2, repeats=2))
    forward, backward = ["ar", "spec gamma=1", "spec auto"], ["spec auto", "spec gamma=1", "ar"]
    assert order == [(m, 0) for m in forward] + [(m, 1) for m in backward] + \
        [(m, 0) for m in backward] + [(m, 1) for m in forward]
    assert [b for _, b in interleaved(["ar"], batches=3, repeats=1)] == [0, 1, 2]


def test_methods_decode_a_batch_in_lockstep(tiny_pair, monkeypatch):
    """The runs of a batch step side by side, the one that has generated the least share of its
    tokens next (of those tied, the one that stepped last), transformers' generate among them (a
    greenlet that its streamer pauses, in the caller's thread: every forward runs there); each
    run's rows, forwards and stats are what it gives decoded alone, its time its own."""
    target, draft = tiny_pair("llama")
    pair = load_pair(str(target), str(draft), dtype="float32", device="cpu")
    base = DecodeConfig(max_new_tokens=12, eos_token_ids=pair.eos_token_ids, gamma_max=3)
    cells = [c for c in bench_module.methods(pair, 3, ["model"], [3], base, (1, 3)) if c.method != AUTO]
    assert [c.method for c in cells] == [HF, AR, "spec gamma=3"]
    batches = [[[5, 6, 7, 8], [9, 10], [11, 12, 13]]] * 3
    forwards, threads = bench_module.Counter(), set()
    hook = pair.target.register_forward_pre_hook(forwards)
    thread_hook = pair.target.register_forward_pre_hook(lambda *_: threads.add(threading.get_ident()))
    runs, steps = [], []  # every run; per step: the stepping run, its progress, the live runs' least
    for kind in (bench_module.Stepping, bench_module.Generating):
        init, step = kind.__init__, kind.step
        monkeypatch.setattr(kind, "__init__", lambda self, *a, init=init: (runs.append(self), init(self, *a))[1])
        monkeypatch.setattr(kind, "step", lambda self, step=step: (
            steps.append((self, self.progress, min(r.progress for r in runs if not r.done))), step(self))[1])
    try:
        alone = [bench_module.whole(pair, cell, batch, forwards) for cell, batch in zip(cells, batches)]
        before = forwards.calls
        together = bench_module.lockstep(pair, cells, batches, forwards)
    finally:
        hook.remove()
        thread_hook.remove()
    assert threads == {threading.get_ident()}  # generate's forwards too: no worker threads of its own to wake
    assert [type(r) for r in runs] == [bench_module.Generating, bench_module.Stepping, bench_module.Stepping]
    assert all(progress == least for _, progress, least in steps)  # the furthest behind steps
    firsts = {run for (run, p, _), (other, q, _) in zip(steps, steps[1:]) if p == q and {run, other} == set(runs[:2])}
    assert firsts == set(runs[:2])  # generate and ar, tied a token a step, take turns going first
    first_done = min(max(i for i, (run, *_) in enumerate(steps) if run is r) for r in runs)
    assert {id(run) for run, *_ in steps[:first_done]} == {id(r) for r in runs}  # all stepped before one ended
    for run, solo in zip(together, alone):
        assert run.outputs == solo.outputs and run.forwards == solo.forwards > 0 and run.seconds > 0
        assert [s["gamma_histogram"] for s in run.stats] == [s["gamma_histogram"] for s in solo.stats]
    assert forwards.calls - before == sum(run.forwards for run in together)
    assert together[2].forwards < together[1].forwards  # gamma 3 took fewer target forwards than ar


def test_generates_in_lockstep_keep_their_own_grad_mode(tiny_pair):
    """Two of transformers' generates stepping in lockstep (batch 1: assisted and generate), each
    on its greenlet in one thread, where torch keeps one grad mode: every forward runs without
    grad, and the caller's mode is as before (each side keeps its own over a switch; else the one
    started first, ending first, restores the mode it began with under the other's no_grad)."""
    target, draft = tiny_pair("llama")
    pair = load_pair(str(target), str(draft), dtype="float32", device="cpu")
    base = DecodeConfig(max_new_tokens=6, eos_token_ids=pair.eos_token_ids, gamma_max=2)
    cells = {c.method: c for c in bench_module.methods(pair, 1, ["model"], [], base, (1, 3))}
    cells = [cells[ASSISTED], cells[HF], cells[AR]]  # assisted, started first, ends first
    grads = []
    hooks = [model.register_forward_pre_hook(lambda *_: grads.append(torch.is_grad_enabled()))
             for model in (pair.target, pair.draft)]
    try:
        runs = bench_module.lockstep(pair, cells, [[[5, 6, 7]]] * 3, bench_module.Counter())
    finally:
        for hook in hooks:
            hook.remove()
    assert len(grads) > 12 and not any(grads) and torch.is_grad_enabled()
    assert runs[0].outputs == runs[1].outputs == runs[2].outputs


@pytest.mark.parametrize("puts", [0, 2])
def test_an_error_in_generate_is_raised_in_the_lockstep(puts, monkeypatch):
    """transformers' generate failing on its greenlet, before its prompt is put or after steps,
    fails the lockstep where it runs, instead of leaving it waiting for a turn."""
    def failing(pair, batch, config, method, streamer):
        for _ in range(puts):
            streamer.put(torch.tensor([1]))
        raise RuntimeError("generate failed")

    monkeypatch.setattr(bench_module, "hf_generate", failing)
    cell = Cell(1, HF, DecodeConfig(max_new_tokens=4))
    with pytest.raises(RuntimeError, match="generate failed"):
        bench_module.lockstep(None, [cell], [[[5, 6]]], bench_module.Counter())


def test_each_batchs_fastest_run_counts():
    """A cell's time sums each batch's fastest run (from whichever pass), with its rows and stats;
    a pass's time (times, for the spread) sums its batches' runs."""
    cell = Cell(2, AUTO, DecodeConfig(max_new_tokens=4))
    runs = [[Run([[1]], [{"s": "a0"}], seconds=3.0, forwards=5), Run([[1]], [{"s": "a1"}], seconds=2.0, forwards=4)],
            [Run([[2, 3]], [{"s": "b0"}], seconds=1.0, forwards=2),
             Run([[2, 3]], [{"s": "b1"}], seconds=4.0, forwards=3)]]
    settle(cell, runs)
    assert cell.times == [4.0, 6.0] and cell.seconds == 3.0 and cell.rate == 1.0
    assert cell.outputs == [[1], [2, 3]] and cell.stats == [{"s": "a1"}, {"s": "b0"}]
    assert cell.forwards == 6


def test_speeds_are_compared_pass_by_pass():
    """x ar and the verdicts take the median over passes of the two methods' times' ratio in the
    same pass: a pass that ran slow for both (a slow phase of the machine) weighs on neither, where
    the fastest runs' ratio (tok/s) would compare ar's run in the fast pass with auto's in another."""
    config = DecodeConfig(max_new_tokens=4)
    ar = Cell(8, AR, config, times=[2.0, 4.0, 3.0])
    auto = Cell(8, AUTO, config, times=[2.5, 3.2, 2.4])  # ratios to ar 0.8, 1.25, 1.25
    fixed = Cell(8, "spec gamma=1", config, times=[2.0, 3.6, 2.5])  # 1.0, 1.11, 1.2
    assert faster(auto, ar) == pytest.approx(1.25) and faster(ar, auto) == pytest.approx(0.8)
    assert min(ar.times) / min(auto.times) < 1  # the fastest runs' ratio reads auto slower
    assert verdicts([ar, auto, fixed]) == ("batch 8: fastest spec auto (1.25x ar); spec auto 1.25x ar, "
                                           "1.04x the best fixed (spec gamma=1)")


def test_peak_memory_sees_an_allocation_freed_before_the_block_ends():
    """The high-water mark, reset as the block begins: a peak held for microseconds counts, and
    one from before the block does not."""
    torch.ones(128 * 2**20 // 4).add_(1)  # 128 MiB, freed before the block
    with PeakMemory(torch.device("cpu")) as memory:
        torch.ones(64 * 2**20 // 4).add_(1)  # 64 MiB, freed at once
    assert memory.mib is not None and 48 < memory.mib < 112


def test_compile_adds_generate_on_a_static_cache_and_compiled_steps(tiny_pair):
    """--compile: transformers' generate on a static cache with its compiled forward (the same
    tokens as generate), and ar and spec auto with compiled step forwards, compiling as a run
    would (--compile-after), which --write-config turns into `compile = true`."""
    target, draft = tiny_pair("llama")
    pair = load_pair(str(target), str(draft), dtype="float32", device="cpu")
    base = DecodeConfig(max_new_tokens=6, gamma_max=3)
    cells = bench_module.methods(pair, 1, ["model"], [], base, (1, 3), compile=12.0)
    compiled = [c for c in cells if c.method.endswith(bench_module.COMPILED)]
    assert [c.method for c in compiled] == ["hf generate compiled", "ar compiled", "spec auto compiled"]
    assert compiled[0].config.compiled is None and [c.config.compiled.after for c in compiled[1:]] == [12.0, 12.0]
    assert bench_module.run_options(compiled[1]) == {"mode": "ar", "compile": True}
    assert bench_module.run_options(compiled[2]) == {"mode": "spec", "gamma": "auto", "compile": True}
    prompts = [[5, 9, 11, 4], [7, 3]]
    with torch.inference_mode():
        assert bench_module.hf_generate(pair, prompts, base, compiled[0].method) == bench_module.hf_generate(
            pair, prompts, base, HF)
