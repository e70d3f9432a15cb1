"""Greedy, float32: every row equals target.generate(do_sample=False) on that row alone, unpadded."""

import copy
import itertools
import random
import shutil
from collections import Counter

import orjson
import pytest
import torch
from transformers import GenerationConfig

from batchspec.decoding import DecodeConfig, RowOptions, decode_batch
from batchspec.decoding.step_report import checked
from batchspec.decoding.suffix_index import SuffixIndex
from batchspec.models import load_pair
from batchspec.tiny import perturbed, shallow

from policies import Scripted
from test_job import run_here

FAMILIES = ["llama", "qwen2", "gpt2"]
MAX_NEW = 40
LENGTHS = [1, 120, 2, 64, 3, 97, 5, 33, 8, 111, 13, 1, 21, 80, 45, 17]  # 16 rows, 1..120 tokens


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def reference(model, prompt: list[int], eos_ids, max_new: int = MAX_NEW, **kwargs) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
        eos_token_id=list(eos_ids), pad_token_id=0, **kwargs,
    )
    return out[0, len(prompt) :].tolist()


def choose_eos(outputs: list[list[int]]) -> tuple[int, int]:
    """Two token ids that, as EOS, end some rows on the first id, some on the second, and leave
    at least two rows running to max_new_tokens."""
    rows_with = Counter(t for row in outputs for t in set(row[1:]))
    candidates = [t for t, _ in rows_with.most_common(40)]
    for a, b in itertools.combinations(candidates, 2):
        firsts = [next((t for t in row if t in (a, b)), None) for row in outputs]
        if a in firsts and b in firsts and firsts.count(None) >= 2:
            return a, b
    raise AssertionError("no pair of eos ids splits these outputs; change the prompts' seed")


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tiny_pair, tmp_path_factory):
    """A loaded pair whose generation_config lists two EOS ids that end some rows mid-completion."""
    family = request.param
    shared_target, draft_path = tiny_pair(family)
    target_path = tmp_path_factory.mktemp("eos") / "target"  # a copy: its generation_config changes below
    shutil.copytree(shared_target, target_path)
    pair = load_pair(str(target_path), str(draft_path), dtype="float32", device="cpu")
    prompts = random_prompts(len(pair.tokenizer), LENGTHS)
    unstopped = [reference(pair.target, p, [], min_new_tokens=MAX_NEW) for p in prompts]
    eos = choose_eos(unstopped)
    GenerationConfig(eos_token_id=list(eos), pad_token_id=0).save_pretrained(target_path)
    pair = load_pair(str(target_path), str(draft_path), dtype="float32", device="cpu")
    assert pair.eos_token_ids == eos  # a list of EOS ids in the generation config is honoured
    expected = [reference(pair.target, p, eos) for p in prompts]
    return family, pair, prompts, expected


SWITCHING = [0, 2, 0, 0, 5, 1, 3, 0, 8]  # plain and speculative steps mixed inside every row


def decode(pair, draft, prompts, gamma=3, policy=None, **kwargs):
    """gamma: a fixed gamma, "auto", or "switching" (the SWITCHING script, cycled); policy: a
    test policy instead."""
    if gamma == "switching":
        policy = Scripted(SWITCHING, gamma_max=8, trees=kwargs.get("tree_width", 1) > 1)
    fixed = gamma if isinstance(gamma, int) else None
    config = DecodeConfig(max_new_tokens=MAX_NEW, eos_token_ids=pair.eos_token_ids, gamma=fixed, **kwargs)
    return decode_batch(pair.target, draft, prompts, list(range(len(prompts))), config, policy=policy)


@pytest.mark.parametrize("gamma", [1, 3, 5, 8, "auto", "switching"])
def test_spec_greedy_equals_target_alone(case, gamma):
    family, pair, prompts, expected = case
    out = decode(pair, pair.draft, prompts, gamma)
    assert [r.token_ids for r in out.rows] == expected
    reasons = Counter(r.finish_reason for r in out.rows)
    assert reasons["stop"] >= 2 and reasons["length"] >= 2  # both stopping rules in one batch
    last_tokens = {r.token_ids[-1] for r in out.rows if r.finish_reason == "stop"}
    assert last_tokens == set(pair.eos_token_ids)  # rows ended on each of the two EOS ids
    if gamma != "auto":  # auto may find plain steps cheapest for these tiny models
        rates = [r.stats["acceptance_rate"] for r in out.rows if r.stats["draft_tokens"]]
        assert 0 < sum(rates) / len(rates) < 1  # the noisy draft agrees often, not always


@pytest.mark.parametrize("width,gamma", [(2, 1), (2, 3), (4, 4), (3, "switching")])
def test_tree_greedy_equals_target_alone(case, width, gamma):
    """The draft's trees (its `width` likeliest paths at every depth) verified in one tree-masked
    forward: every row equals the target alone, and paths other than the draft's likeliest win."""
    family, pair, prompts, expected = case
    out = decode(pair, pair.draft, prompts, gamma, tree_width=width)
    assert [r.token_ids for r in out.rows] == expected
    stats = [r.stats for r in out.rows]
    depths = sum(d * steps for s in stats for d, steps in enumerate(s["gamma_histogram"]))
    assert sum(s["tree_nodes"] for s in stats) == width * depths  # every speculative step a full tree
    assert sum(s["tree_steps"] for s in stats) == sum(s["model_steps"] for s in stats) > 0
    branches = [sum(column) for column in zip(*(s["tree_branch_histogram"] for s in stats))]
    assert branches[0] and sum(branches[1:])  # the draft's likeliest path won, and others did
    assert 0 < sum(s["accepted_tokens"] for s in stats) < sum(s["draft_tokens"] for s in stats)


@pytest.mark.parametrize("gamma", [3, "auto", "switching"])
def test_several_drafts_equal_target_alone(case, gamma):
    """Two drafts (the pair's and another as noisy), each proposing its chain, checked as one tree."""
    family, pair, prompts, expected = case
    other = perturbed(pair.target, 0.03, seed=9)
    policy = Scripted(SWITCHING, gamma_max=8, trees=True) if gamma == "switching" else None
    config = DecodeConfig(max_new_tokens=MAX_NEW, eos_token_ids=pair.eos_token_ids,
                          gamma=gamma if isinstance(gamma, int) else None)
    out = decode_batch(pair.target, [pair.draft, other], prompts, list(range(len(prompts))), config, policy=policy)
    assert [r.token_ids for r in out.rows] == expected
    stats = [r.stats for r in out.rows]
    assert all(len(s["tree_branch_histogram"]) == 2 for s in stats)  # per draft: whose chain the path ended on
    if gamma != "auto":  # auto may find plain steps cheapest for these tiny models
        assert all(s["tree_steps"] == s["model_steps"] for s in stats) and sum(s["tree_steps"] for s in stats)
        depths = sum(d * steps for s in stats for d, steps in enumerate(s["gamma_histogram"]))
        assert sum(s["tree_nodes"] for s in stats) == 2 * depths  # a chain of the step's gamma from each


LOOKUP = (1, 3)  # n-gram sizes for the lookup tests: short matches, so many proposals are wrong


def earlier_completions(expected: list[list[int]]) -> SuffixIndex:
    """A suffix index holding the completions of every other row (as a run's earlier batches
    would, had they decoded them): rows copy these from the index where they match, and what
    follows a shared start in another row's completion is often wrong."""
    index = SuffixIndex()
    for row in expected[::2]:
        index.add(row)
    return index


@pytest.mark.parametrize("gamma", [3, "auto", "switching"])
@pytest.mark.parametrize("drafter", ["ngram", "hybrid", "suffix", "suffix hybrid"])
def test_lookup_greedy_equals_target_alone(case, drafter, gamma):
    """N-gram lookup, or the suffix index of earlier completions (with the row's own text), alone
    and with the draft model (hybrid): rows with and without a match in one batch, the draft
    cache kept in step across both sources."""
    family, pair, prompts, expected = case
    suffix = earlier_completions(expected) if drafter.startswith("suffix") else None
    out = decode(pair, pair.draft if "hybrid" in drafter else None, prompts, gamma, ngram=LOOKUP, suffix=suffix)
    assert [r.token_ids for r in out.rows] == expected
    stats = [r.stats for r in out.rows]
    source = "suffix_steps" if suffix else "ngram_steps"
    if "hybrid" not in drafter:
        assert all(s["model_steps"] == s["draft_forwards"] == 0 for s in stats)
    if gamma == 3:  # auto may find plain steps cheapest for these tiny models
        assert 0 < sum(s["accepted_tokens"] for s in stats) < sum(s["draft_tokens"] for s in stats)
        assert sum(s[source] for s in stats) > 0
        if "hybrid" not in drafter:  # a row without a match steps beside rows with one
            assert any(s["gamma_histogram"][0] for s in stats)
        else:  # the model proposes where the lookup finds nothing
            assert sum(s["model_steps"] for s in stats) > 0


def test_a_row_without_a_match_counts_as_a_rejected_proposal(case):
    """A lookup row that proposes nothing beside rows that do yields one token from a step of
    their width, as a row whose first proposal was rejected: the alpha that prices auto's steps
    counts it so (else a batch whose rows mostly find no match would be priced at its matched
    rows' acceptance)."""
    family, pair, prompts, expected = case
    config = DecodeConfig(max_new_tokens=MAX_NEW, eos_token_ids=pair.eos_token_ids, ngram=LOOKUP)
    told = []

    class Recording(Scripted):
        def record(self, report):
            told.append((report.gamma, report.proposed, report.accepted, checked(report.accepted, report.offered)))
            super().record(report)

    out = decode_batch(pair.target, None, prompts, list(range(len(prompts))), config, policy=Recording([3], 8))
    misses = [(n, k) for gamma, proposed, accepted, counted in told if gamma  # proposals verified
              for p, n, k in zip(proposed, accepted, counted) if p == 0]
    assert misses and all(miss == (0, 1) for miss in misses)
    assert [r.token_ids for r in out.rows] == expected


@pytest.mark.parametrize("draft", ["model", "ar", "ngram", "hybrid"])
def test_per_row_stop_token_ids_end_rows_like_eos(case, draft):
    """Each row's own stop ids end it as EOS does (the id kept), beside rows with other ids, rows
    with none and rows that ignore EOS: generate with the row's ids as its EOS ids, row by row."""
    family, pair, prompts, expected = case
    at = itertools.cycle([3, 9, 20, MAX_NEW])  # the id at that position, mid-row (or none: MAX_NEW)
    stop_ids = [[row[k]] if k < len(row) - 1 else [] for row, k in zip(expected, at)]
    longest = max(range(len(expected)), key=lambda b: len(expected[b]))
    stop_ids[longest] = [expected[longest][5], expected[longest][2]]  # two ids: the first met ends the row
    stop_ids = [[*pair.eos_token_ids, *ids] for ids in stop_ids]
    stop_ids[-1] = stop_ids[-2] = []  # rows that ignore EOS (and have no stop ids)
    config = DecodeConfig(max_new_tokens=MAX_NEW, eos_token_ids=pair.eos_token_ids, gamma=3,
                          ngram=LOOKUP if draft in ("ngram", "hybrid") else None)
    out = decode_batch(pair.target, pair.draft if draft in ("model", "hybrid") else None, prompts,
                       list(range(len(prompts))), config,
                       [RowOptions(ignore_eos=True, stop_token_ids=tuple(ids)) for ids in stop_ids])
    wanted = [reference(pair.target, p, ids) for p, ids in zip(prompts, stop_ids)]
    assert [r.token_ids for r in out.rows] == wanted
    assert sum(len(w) < len(e) for w, e in zip(wanted, expected)) >= 3  # the stop ids cut rows short
    assert any(len(w) > len(e) for w, e in zip(wanted[-2:], expected[-2:]))  # a row ran past its EOS
    assert all(r.finish_reason == "stop" for r, ids in zip(out.rows, stop_ids) if r.token_ids[-1] in ids)


def test_ar_greedy_equals_target_alone(case):
    family, pair, prompts, expected = case
    out = decode(pair, None, prompts)
    assert [r.token_ids for r in out.rows] == expected
    assert all(r.stats["draft_forwards"] == 0 and r.stats["acceptance_rate"] is None for r in out.rows)


@pytest.mark.parametrize("batch_size", [1, 2, 5, 9, 16])
def test_any_batch_size(case, batch_size):
    family, pair, prompts, expected = case
    out = decode(pair, pair.draft, prompts[-batch_size:], gamma=4)
    assert [r.token_ids for r in out.rows] == expected[-batch_size:]


def test_compaction_keeps_output(case):
    """Compacting the caches at every chance (compact_at=0) changes no token."""
    family, pair, prompts, expected = case
    out = decode(pair, pair.draft, prompts, gamma=5, compact_at=0.0)
    assert out.stats["compactions"] > 0
    assert [r.token_ids for r in out.rows] == expected


def test_draft_equal_to_target_accepts_everything(case):
    family, pair, prompts, expected = case
    out = decode(pair, pair.target, prompts, gamma=4)
    assert [r.token_ids for r in out.rows] == expected
    proposed = sum(r.stats["draft_tokens"] for r in out.rows)
    accepted = sum(r.stats["accepted_tokens"] for r in out.rows)
    cut = 4 * len(prompts)  # a row's last block, cut at its EOS or limit, keeps (and counts) fewer
    assert proposed - cut <= accepted / 0.99  # float32 near-ties between 1- and 5-token forwards aside
    assert all(r.stats["accepted_tokens"] <= r.stats["completion_tokens"] for r in out.rows)


def test_unrelated_draft_still_exact(case, tiny_pair):
    family, pair, prompts, expected = case
    other_target, _ = tiny_pair(family, seed=7)
    unrelated = load_pair(str(other_target), dtype="float32", device="cpu").target
    out = decode(pair, unrelated, prompts, gamma=5)
    assert [r.token_ids for r in out.rows] == expected
    rates = [r.stats["acceptance_rate"] for r in out.rows if r.stats["draft_tokens"]]
    assert sum(rates) / len(rates) < 0.3


def test_shallow_draft_still_exact(case):
    """A draft with fewer layers than the target: its first layer (tiny.shallow, the paying pairs
    of build_pair(draft_layers=)). With the target's later layer silenced it agrees everywhere."""
    family, pair, prompts, expected = case
    draft = shallow(copy.deepcopy(pair.target), 1, nudge=1.0)  # nudge 1: the copied target unchanged
    assert draft.config.num_hidden_layers == 1
    out = decode(pair, draft, prompts, gamma=3)
    assert [r.token_ids for r in out.rows] == expected
    rates = [r.stats["acceptance_rate"] for r in out.rows if r.stats["draft_tokens"]]
    assert 0 < sum(rates) / len(rates) < 1
    silenced = copy.deepcopy(pair.target)
    draft = shallow(silenced, 1, nudge=0.0)  # the target's second layer now adds nothing
    config = DecodeConfig(max_new_tokens=MAX_NEW, eos_token_ids=pair.eos_token_ids, gamma=3)
    out = decode_batch(silenced, draft, prompts, list(range(len(prompts))), config)
    stats = [r.stats for r in out.rows]
    assert sum(s["accepted_tokens"] for s in stats) >= 0.99 * sum(s["draft_tokens"] for s in stats) - 3 * len(prompts)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_shallow_draft_is_saved_and_loaded_back(tiny_pair, family):
    """build_pair(draft_layers=) writes the target's first layer as a model of its own, which loads
    back and decodes exactly (configs that list a type per layer, as Qwen 2's, keep its one entry:
    saving checks that they match)."""
    target_path, draft_path = tiny_pair(family, draft_layers=1)
    pair = load_pair(str(target_path), str(draft_path), dtype="float32", device="cpu")
    assert pair.draft.config.num_hidden_layers == 1
    prompts = random_prompts(len(pair.tokenizer), [3, 40, 9])
    out = decode(pair, pair.draft, prompts, gamma=3)
    assert [r.token_ids for r in out.rows] == [reference(pair.target, p, pair.eos_token_ids) for p in prompts]


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_window_counts_true_positions(tiny_pair, family):
    """Windows of 12 tokens, rows of up to 160: the window is counted in each row's own positions,
    past left pads and rollback holes (Mistral: every layer slides, SDPA; Gemma 2: every other
    layer, eager attention)."""
    target_path, draft_path = tiny_pair(family, window=12)
    pair = load_pair(str(target_path), str(draft_path), dtype="float32", device="cpu")
    prompts = random_prompts(len(pair.tokenizer), LENGTHS)
    expected = [reference(pair.target, p, pair.eos_token_ids) for p in prompts]
    for draft, compact_at, width in [(pair.draft, 0.3, 1), (pair.draft, 0.0, 1), (None, 0.3, 1), (pair.draft, 0.3, 3)]:
        out = decode(pair, draft, prompts, gamma=4, compact_at=compact_at, tree_width=width)
        assert [r.token_ids for r in out.rows] == expected
    out = decode(pair, pair.draft, prompts, gamma=4)
    rates = [r.stats["acceptance_rate"] for r in out.rows if r.stats["draft_tokens"]]
    assert 0 < sum(rates) / len(rates) < 1  # rejections: rollback holes inside the windows


@pytest.mark.parametrize("wider", ["draft", "target"])
def test_logit_widths_differ(case, wider):
    """A draft and target of one family with padded embeddings of different widths."""
    family, pair, prompts, expected = case
    target, draft = pair.target, pair.draft
    grown = copy.deepcopy(draft if wider == "draft" else target)
    grown.resize_token_embeddings(len(pair.tokenizer) + 13, mean_resizing=False)
    if wider == "draft":
        draft = grown
    else:
        target = grown
        expected = [reference(target, p, pair.eos_token_ids) for p in prompts]
    config = DecodeConfig(max_new_tokens=MAX_NEW, eos_token_ids=pair.eos_token_ids, gamma=3)
    out = decode_batch(target, draft, prompts, list(range(len(prompts))), config)
    assert [r.token_ids for r in out.rows] == expected


def test_draft_covering_a_prefix_of_the_vocabulary(case):
    """A draft that knows only the first half of the ids (a trimmed embedding table): prompts and
    target tokens beyond it go into the draft as its last id, it never proposes them."""
    family, pair, prompts, expected = case
    narrow = copy.deepcopy(pair.draft)
    narrow.resize_token_embeddings(len(pair.tokenizer) // 2, mean_resizing=False)
    assert max(max(p) for p in prompts) >= len(pair.tokenizer) // 2
    out = decode(pair, narrow, prompts, gamma=3)
    assert [r.token_ids for r in out.rows] == expected
    assert sum(r.stats["accepted_tokens"] for r in out.rows) > 0


@pytest.mark.parametrize("gamma,ngram", [(3, None), ("switching", None), (3, LOOKUP)], ids=["3", "switching", "hybrid"])
def test_row_statistics_add_up(case, gamma, ngram):
    family, pair, prompts, expected = case
    out = decode(pair, pair.draft, prompts, gamma, ngram=ngram)
    width = 9 if gamma == "switching" else gamma + 1  # gamma_max + 1
    for prompt, row in zip(prompts, out.rows):
        s = row.stats
        gammas = s["gamma_histogram"]  # steps taken with each gamma
        steps = sum(s["accepted_length_histogram"])  # speculative steps
        assert len(s["accepted_length_histogram"]) == len(gammas) == width
        assert steps == sum(gammas[1:])
        assert s["prompt_tokens"] == len(prompt)
        assert s["completion_tokens"] == len(row.token_ids)
        assert s["draft_tokens"] == sum(g * count for g, count in enumerate(gammas))
        assert s["accepted_tokens"] == sum(k * c for k, c in enumerate(s["accepted_length_histogram"]))
        if steps:
            assert s["acceptance_rate"] == pytest.approx(s["accepted_tokens"] / s["draft_tokens"])
            assert s["mean_accepted_length"] == pytest.approx(s["accepted_tokens"] / steps)
        else:  # a row that ended on its first, plain step
            assert s["acceptance_rate"] is None and s["mean_accepted_length"] is None
        assert s["target_forwards"] == sum(gammas)  # the first step's forward is the prefill
        assert s["model_steps"] + s["ngram_steps"] == steps  # each speculative step names its source
        if ngram is None:
            assert s["draft_forwards"] == s["draft_tokens"]  # the prompt rides in the draft's first forward
            assert s["ngram_steps"] == 0
        assert sum(gammas) <= s["completion_tokens"]  # each step yields at least one token
        if gamma == "switching" and len(row.token_ids) >= 10:
            assert gammas[0] > 0 and steps > 0
    assert 0 < out.stats["wasted_cache_fraction"] < 1
    assert 0 < out.stats["padding_fraction"] < 1


def forward_rows(model, run, widths: list | None = None) -> tuple[list[int], object]:
    """The rows of each of the model's forwards while run() runs (and into `widths` their
    positions), and what it returned."""
    rows = []

    def record(module, args, kwargs):
        rows.append(kwargs["input_ids"].shape[0])
        if widths is not None:
            widths.append(kwargs["input_ids"].shape[1])

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        return rows, run()
    finally:
        hook.remove()


def test_finished_rows_leave_the_batch(case):
    """Rows that stop early cost no more target forwards: the batch dimension shrinks (where no
    bigger batch was timed faster: Scripted's)."""
    family, pair, prompts, expected = case
    batch_sizes, out = forward_rows(pair.target, lambda: decode(pair, pair.draft, prompts, None, Scripted([3], 8)))
    assert batch_sizes == sorted(batch_sizes, reverse=True) and batch_sizes[-1] < len(prompts)
    assert sum(batch_sizes) == sum(r.stats["target_forwards"] for r in out.rows)  # the prefill: every row's first


def test_the_policy_is_told_each_rows_proposals_as_it_ends(case):
    """Each row's proposals accepted and checked over its whole completion (checked: up to the
    first rejection in each step) reach the policy once, as the row ends: they price the run's
    spread of alphas."""
    family, pair, prompts, expected = case
    policy = Scripted(SWITCHING, 8)
    out = decode(pair, pair.draft, prompts, None, policy)
    rows = [(sum(r.trace["accepted"]), sum(min(n + 1, k) for n, k in zip(r.trace["accepted"], r.trace["proposed"])))
            for r in out.rows]
    rows = [(a, c) for a, c in rows if c]  # a row that never speculated tells nothing of its alpha
    ended = (len(rows), sum(a for a, _ in rows), sum(c for _, c in rows), sum(a * a / c for a, c in rows),
             sum(c * c for _, c in rows))
    assert policy.ended == pytest.approx(ended) and ended[2] > ended[1] > 0


def test_a_step_over_a_batch_of_new_shape_is_not_timed(case):
    """The prefill's step and the first step after rows left (fresh buffers of new shapes, often
    slower) go untimed; every other step is timed by its batch's rows."""
    family, pair, prompts, expected = case
    timings = []

    class Recording(Scripted):
        def record(self, report):
            timings.append((report.rows, report.seconds))

    decode(pair, pair.draft, prompts, None, Recording([0], 8))
    rows = [r for r, _ in timings]
    untimed = [k for k, (_, seconds) in enumerate(timings) if seconds is None]
    assert untimed == [0] + [k for k in range(1, len(rows)) if rows[k] != rows[k - 1]] and len(untimed) > 2


def test_per_row_max_new_tokens(case):
    """Rows of one batch may each have their own limit (OpenAI-batch max_tokens)."""
    family, pair, prompts, expected = case
    limits = [1 + (7 * k) % MAX_NEW for k in range(len(prompts))]
    config = DecodeConfig(max_new_tokens=MAX_NEW, eos_token_ids=pair.eos_token_ids, gamma=4)
    out = decode_batch(pair.target, pair.draft, prompts, list(range(len(prompts))), config,
                       [RowOptions(max_new_tokens=k) for k in limits])
    for row, full, limit in zip(out.rows, expected, limits):
        assert row.token_ids == full[:limit]
        assert row.finish_reason == ("stop" if full[len(row.token_ids) - 1] in pair.eos_token_ids else "length")


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
            "long_factor": [4.0 + i for i in range(8)], "original_max_position_embeddings": 48}
ROPES = {  # config changes: a rope that rescales by each forward's longest position, unscaled within 48
    "dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
                          "max_position_embeddings": 48}),
    "longrope": ("phi3", {"rope_parameters": LONGROPE, "original_max_position_embeddings": 48,
                          "max_position_embeddings": 1024}),
}


@pytest.mark.parametrize("rope", ROPES)
def test_a_rope_scaled_by_length_is_decoded_within_its_window(tiny_pair, tmp_path, rope):
    """Dynamic NTK and LongRoPE rescale every row of a forward by its longest position (and
    generate() re-encodes a Phi-3 row that crosses the window): rows are decoded within the 48
    positions less gamma_max (8), each exactly as generate() alone, beside rows past them (one
    whose proposals alone would cross), which are too_long records; the run says why."""
    family, changes = ROPES[rope]
    models = {}
    for name, path in zip(("target", "draft"), tiny_pair(family)):
        models[name] = tmp_path / name
        shutil.copytree(path, models[name])
        config = orjson.loads((models[name] / "config.json").read_bytes())
        config.update(changes)
        (models[name] / "config.json").write_bytes(orjson.dumps(config))
    pair = load_pair(str(models["target"]), dtype="float32", device="cpu")
    rng = random.Random(0)
    vocabulary = ["the", "cat", "sat", "on", "a", "mat", "then", "ran"]
    words = [" ".join(rng.choices(vocabulary, k=k)) for k in (3, 30, 14, 26)]
    prompts = [pair.tokenizer(w)["input_ids"] for w in words]
    assert [len(p) + 8 for p in prompts] == [13, 53, 29, 43]  # within 40, past 48, within 40, within 48 only
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"id": str(i), "prompt": w}) + b"\n" for i, w in enumerate(words)))
    result = run_here(str(source), "--out", str(out), "--target", str(models["target"]), "--draft",
                      str(models["draft"]), "--gamma", "4", "--max-new-tokens", "8", "--token-ids", "--no-progress")
    assert result.exit_code == 3, result.output
    assert "rescales past 48 positions" in result.output and "decoded within 40 tokens" in result.output
    records = {r["id"]: r["token_ids"] for r in map(orjson.loads, out.read_bytes().splitlines())}
    assert records == {i: reference(pair.target, prompts[int(i)], pair.eos_token_ids, 8) for i in ("0", "2")}
    errors = [orjson.loads(line) for line in (tmp_path / "out.errors.jsonl").read_bytes().splitlines()]
    assert [(e["id"], e["error"]["type"]) for e in errors] == [("1", "too_long"), ("3", "too_long")]
