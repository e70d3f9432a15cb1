"""How close a pair's outputs and distributions are: where a method's greedy rows first differ
from the target alone's (with the target's logit margin there: a near tie in low precision,
or a bug), and the Jensen-Shannon divergence between the target's and the draft's next-token
distributions."""

import torch

from batchspec.decoding.drafters.model import fit_width
from batchspec.decoding.seq2seq import continuation_logits


@torch.inference_mode()
def margin_at(target, prompt: list[int], prefix: list[int]) -> float:
    """The target's best minus second-best logit for the token after prompt + prefix."""
    top = continuation_logits(target, prompt, prefix)[-1].float().topk(2).values  # [2]
    return (top[0] - top[1]).item()


def mismatches(target, prompts: list[list[int]], outputs: list[list[int]], expected: list[list[int]]) -> list[dict]:
    """Each row whose output differs from the expected one: its index, the first position where
    they differ and the target's margin there."""
    found = []
    for row, (ours, theirs) in enumerate(zip(outputs, expected)):
        if ours != theirs:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            found.append({"row": row, "position": at, "margin": margin_at(target, prompts[row], theirs[:at])})
    return found


def jensen_shannon(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p, q [..., V] distributions -> [...] their JS divergence in nats (0 <= JSD <= ln 2)."""
    m = (p + q) / 2

    def kl_to_m(a: torch.Tensor) -> torch.Tensor:  # KL(a || m); 0 log 0 = 0
        return (torch.special.xlogy(a, a) - torch.special.xlogy(a, m)).sum(-1)

    return (kl_to_m(p) + kl_to_m(q)) / 2


@torch.inference_mode()
def mean_jsd(target, draft, prompts: list[list[int]], completions: list[list[int]]) -> float | None:
    """The mean JSD between the target's and the draft's next-token distributions at every
    position of each prompt's completion (the target's own, so both see what the target wrote)."""
    total, positions = 0.0, 0
    for prompt, completion in zip(prompts, completions):
        if not completion:
            continue
        p_logits = continuation_logits(target, prompt, completion[:-1]).float()  # [C, V]
        q_logits = fit_width(continuation_logits(draft, prompt, completion[:-1]).float().to(p_logits.device),
                             p_logits.shape[-1])  # ids past a draft's embeddings go in as BatchKV feeds them
        total += jensen_shannon(p_logits.softmax(-1), q_logits.softmax(-1)).sum().item()
        positions += len(completion)
    return total / positions if positions else None
