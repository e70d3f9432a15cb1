"""Token trees (--tree-width, several --draft): the acceptance walk on a hand-made tree, the
merge of several drafts' chains, batches a tree cannot serve (sampled, with a grammar) drafting
the chain with the same output, and the job's options, records and refusals. Greedy
equivalence of trees runs with the chains' tests (test_greedy, test_families, test_rollback,
test_options, test_seq2seq)."""

import orjson
import pytest
import torch

from batchspec.decoding import DecodeConfig, RowOptions, SamplingParams, decode_batch
from batchspec.decoding.drafters.several import merged_parents
from batchspec.decoding.grammar import Grammar
from batchspec.decoding.tree import accept_tree_greedy, tree_ancestors
from batchspec.models import load_pair, load_tokenizer
from batchspec.tiny import perturbed

from test_greedy import random_prompts
from test_job import run_here, tiny_run_options

# [root, d1..d6]: depth 1 = d1 d2, depth 2 = d3 (below d1) d4 (below d2), depth 3 = d5 (below d4) d6 (below d3)
PARENTS = [0, 0, 1, 2, 4, 3]
TOKENS = [5, 6, 7, 8, 9, 7]


def logits_choosing(choices: list[int], vocab: int = 12) -> torch.Tensor:
    """[1, S, V]: the target's argmax after slot s is choices[s]."""
    logits = torch.zeros(1, len(choices), vocab)
    logits[0, torch.arange(len(choices)), torch.tensor(choices)] = 1.0
    return logits


def test_ancestors_of_a_hand_made_tree():
    parents = torch.tensor([[-1, *PARENTS]])
    ancestors = tree_ancestors(parents, depth=3)[0]
    assert ancestors[5].nonzero().flatten().tolist() == [0, 2, 4, 5]  # d5: root, d2, d4, itself
    assert ancestors[6].nonzero().flatten().tolist() == [0, 1, 3, 6]
    assert ancestors.sum(-1).tolist() == [1, 2, 2, 3, 3, 4, 4]


@pytest.mark.parametrize("choices,n,next_token,path", [
    ([6, 0, 8, 0, 9, 1, 0], 3, 1, [0, 2, 4, 5]),  # the second branch, all the way down
    ([5, 7, 0, 7, 0, 0, 0], 3, 0, [0, 1, 3, 6]),  # the first branch, all the way down
    ([5, 4, 0, 0, 0, 0, 0], 1, 4, [0, 1, 0, 0]),  # d1, then the target wants what no child has
    ([6, 0, 3, 0, 0, 0, 0], 1, 3, [0, 2, 0, 0]),  # d2 only: d4 (8) is not the target's 3
    ([2, 7, 8, 7, 9, 9, 9], 0, 2, [0, 0, 0, 0]),  # no depth-1 node agrees: the correction only
])
def test_the_deepest_agreeing_path_is_kept(choices, n, next_token, path):
    """A node counts only when every node above it agreed too (last case: d4 and d5 agree with
    the target after their parents, but d2 does not); levels past n read slot 0."""
    parents, tokens = torch.tensor([PARENTS]), torch.tensor([TOKENS])
    ancestors = tree_ancestors(torch.cat([torch.tensor([[-1]]), parents], dim=1), 3)
    got = accept_tree_greedy(logits_choosing(choices), tokens, parents, ancestors, 3)
    assert [got[0].item(), got[1].item(), got[2][0].tolist()] == [n, next_token, path]


def test_chains_of_several_drafts_merge_where_they_agree():
    """Three drafts' chains [depth, draft]: where a chain agrees with an earlier one up to a
    node, its next node hangs below the earlier chain's (slots: root 0, then depth by depth)."""
    chains = torch.tensor([[[5, 5, 6], [7, 8, 7], [9, 9, 9]]])  # depth 1: 5 5 6; depth 2: 7 8 7; depth 3: 9 9 9
    assert merged_parents(chains)[0].tolist() == [
        0, 0, 0,  # depth 1: below the root
        1, 1, 3,  # depth 2: drafts 0 and 1 agree on 5 (slot 1); draft 2's 6 is slot 3
        4, 5, 6,  # depth 3: each below its own depth-2 node (7, 8 and 7 under different parents)
    ]


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return load_pair(*map(str, tiny_pair("llama")), dtype="float32", device="cpu")


@pytest.mark.parametrize("batch", ["sampled", "grammar"])
def test_batches_a_tree_cannot_serve_draft_the_chain(pair, batch):
    """Sampling (no lossless multi-draft sampler) and grammars (matchers read a chain): the
    draft proposes its chain, so the rows are the chain's, token for token."""
    prompts = random_prompts(len(pair.tokenizer), [3, 17, 8, 30], seed=4)
    sampled = batch == "sampled"
    options = None if sampled else [RowOptions(grammar=Grammar("regex", "[a-z ]{3,40}"))] * len(prompts)
    params = SamplingParams(temperature=0.8) if sampled else SamplingParams()
    outputs = []
    for width in (1, 3):
        config = DecodeConfig(max_new_tokens=20, eos_token_ids=pair.eos_token_ids, sampling=params, gamma=3,
                              tree_width=width)
        outputs.append(decode_batch(pair.target, pair.draft, prompts, list(range(len(prompts))), config, options,
                                    tokenizer=pair.tokenizer).rows)
    chain, tree = outputs
    assert [r.token_ids for r in tree] == [r.token_ids for r in chain]
    assert all(r.stats["tree_steps"] == 0 and r.stats["model_steps"] > 0 for r in tree)


def test_trees_through_the_job(tiny_pair, tmp_path):
    """--tree-width 3 --tree-depth 4: the same completions as the chain, each record's tree
    statistics and the summary's; a sampled request in the same file decodes as a chain (its own
    batch); options a tree cannot take are refused before any weight is read."""
    rows = [{"id": f"r{i}", "prompt": text} for i, text in enumerate(["the cat", "a dog and", "one two three"])]
    rows.append({"custom_id": "sampled", "method": "POST", "url": "/v1/completions",
                 "body": {"prompt": "the dog", "temperature": 0.7, "seed": 3}})
    data = tmp_path / "in.jsonl"
    data.write_bytes(b"\n".join(orjson.dumps(row) for row in rows) + b"\n")
    models = [o for o in tiny_run_options(tiny_pair) if o not in ("--gamma", "3")]
    records = {}
    for name, extra in [("chain", ["--gamma", "4"]), ("tree", ["--tree-width", "3", "--tree-depth", "4"])]:
        out = tmp_path / f"{name}.jsonl"
        result = run_here(str(data), "--out", str(out), *models, *extra)
        assert result.exit_code == 0, result.output
        records[name] = {r["id"]: r for r in map(orjson.loads, out.read_bytes().splitlines())}
    assert {k: r["token_ids"] for k, r in records["tree"].items()} == \
        {k: r["token_ids"] for k, r in records["chain"].items()}
    stats = {k: r["stats"] for k, r in records["tree"].items()}
    for key in ("r0", "r1", "r2"):
        assert stats[key]["tree_steps"] > 0 and stats[key]["tree_nodes"] == 12 * stats[key]["tree_steps"]
        assert len(stats[key]["tree_branch_histogram"]) == 3
    assert stats["sampled"]["tree_steps"] == 0
    summary = orjson.loads((tmp_path / "tree.summary.json").read_bytes())
    assert summary["tree_steps"] == sum(s["tree_steps"] for s in stats.values())
    other = tmp_path / "other-draft"  # a second draft, as noisy as the pair's
    perturbed(load_pair(*map(str, tiny_pair("llama")), dtype="float32", device="cpu").target, 0.03, 9).save_pretrained(
        other)
    load_tokenizer(str(tiny_pair("llama")[0])).save_pretrained(other)
    out = tmp_path / "several.jsonl"
    result = run_here(str(data), "--out", str(out), *models, "--draft", str(other), "--gamma", "4")
    assert result.exit_code == 0, result.output
    several = {r["id"]: r for r in map(orjson.loads, out.read_bytes().splitlines())}
    assert {k: r["token_ids"] for k, r in several.items()} == {k: r["token_ids"] for k, r in records["chain"].items()}
    assert all(len(several[key]["stats"]["tree_branch_histogram"]) == 2 for key in ("r0", "r1", "r2"))
    assert orjson.loads((tmp_path / "several.summary.json").read_bytes())["models"]["more_drafts"] == [str(other)]
    printed = run_here(str(data), "--out", str(out), *models, "--draft", str(other), "--print-config").output
    assert f'draft = ["{models[models.index("--draft") + 1]}", "{other}"]' in printed  # --config reads it back
    (tmp_path / "job.toml").write_text(printed)
    assert run_here(str(data), "--config", str(tmp_path / "job.toml"), "--print-config").output == printed
    refusals = {
        ("--draft", str(other), "--tree-width", "2"): "one chain",
        ("--tree-width", "2", "--temperature", "0.5"): "greedily only",
        ("--tree-width", "2", "--draft", "ngram"): "draft model",
        ("--tree-depth", "3"): "--tree-width 2 or more",
        ("--tree-width", "2", "--gamma", "2", "--tree-depth", "3"): "not both",
        ("--tree-width", "2", "--mode", "ar"): "--mode spec",
    }
    for extra, message in refusals.items():
        result = run_here(str(data), "--out", str(tmp_path / "refused.jsonl"), *models, *extra)
        assert result.exit_code == 2 and message in result.output, (extra, result.output)
