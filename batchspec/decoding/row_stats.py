"""The per-row statistics schema, defined once: the engine fills a row's step by step, each output
record carries it as a dict (`record`), and a run's summary and its report add records up
(`add`). A count added is a field; a histogram a list field; a rate is derived when written."""

from dataclasses import dataclass, field, fields

HISTOGRAMS = ("accepted_length_histogram", "gamma_histogram", "tree_branch_histogram")
TREES = ("tree_steps", "tree_nodes", "tree_branch_histogram")  # written for a run that may propose trees


@dataclass
class RowStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0  # proposals verified
    accepted_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    model_steps: int = 0  # steps whose proposal came from the draft model (each drafter's source: "<source>_steps")
    ngram_steps: int = 0  # ... from n-gram lookup
    jump_steps: int = 0  # ... from a grammar's forced text (jump-forward)
    suffix_steps: int = 0  # ... from the suffix drafter (the job's earlier completions, or the row's own text)
    tree_steps: int = 0  # speculative steps whose proposal was a tree
    tree_nodes: int = 0  # their trees' nodes
    accepted_length_histogram: list[int] = field(default_factory=list)  # speculative steps per accepted length
    gamma_histogram: list[int] = field(default_factory=list)  # steps per number of proposals (0: plain steps)
    tree_branch_histogram: list[int] = field(default_factory=list)  # tree steps per rank of the accepted path's end
    source_tokens: dict[str, list[int]] = field(default_factory=dict)  # source -> [tokens proposed, accepted]

    @property
    def speculative_steps(self) -> int:
        return sum(self.accepted_length_histogram)

    def add_step(self, tokens: int, proposed: int, source: str | None, accepted: int, draft_forwards: int,
                 tree: tuple[int, int] | None = None) -> None:
        """One step of a row: it gained `tokens`, had `proposed` proposals from `source` and kept
        `accepted` of them, the draft model ran draft_forwards times; tree: (its nodes, the rank
        in its depth of the accepted path's end) when the proposal was a tree."""
        self.completion_tokens += tokens
        self.target_forwards += 1
        self.draft_forwards += draft_forwards
        bump(self.gamma_histogram, proposed)
        if tree:
            self.tree_steps += 1
            self.tree_nodes += tree[0]
            bump(self.tree_branch_histogram, tree[1], by=accepted > 0)
        if proposed:
            setattr(self, f"{source}_steps", getattr(self, f"{source}_steps") + 1)
            self.draft_tokens += proposed
            self.accepted_tokens += accepted
            self.count_source(source, [proposed, accepted])
            bump(self.accepted_length_histogram, accepted)

    def record(self, speculative: bool, trees: bool) -> dict:
        """As an output record's stats: no histograms for a row decoded without a drafter, the
        tree counts only where trees may be proposed."""
        stats = {f.name: getattr(self, f.name) for f in fields(self) if trees or f.name not in TREES}
        if not speculative:
            stats |= {"accepted_length_histogram": [], "gamma_histogram": []}
        steps = self.speculative_steps
        return stats | {"acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
                        "mean_accepted_length": self.accepted_tokens / steps if steps else None}

    def add(self, stats: dict) -> None:
        """Add a record's stats (keys it lacks add nothing)."""
        for f in fields(self):
            if f.name in HISTOGRAMS:
                setattr(self, f.name, add_up(getattr(self, f.name), stats.get(f.name, [])))
            elif f.name == "source_tokens":
                for source, counts in stats.get(f.name, {}).items():
                    self.count_source(source, counts)
            else:
                setattr(self, f.name, getattr(self, f.name) + stats.get(f.name, 0))

    def count_source(self, source: str, counts: list[int]) -> None:
        """Add [proposed, accepted] tokens to a source's."""
        self.source_tokens[source] = add_up(self.source_tokens.get(source, []), counts)

    def totals(self) -> dict:
        """The sums a run's summary shows (forwards aside), with the acceptance rate."""
        shown = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.endswith("_forwards")}
        return shown | {"acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
                        "acceptance_by_source": self.acceptance_by_source()}

    def acceptance_by_source(self) -> dict[str, float]:
        """Accepted over proposed tokens, per source that proposed."""
        return {source: accepted / proposed for source, (proposed, accepted) in self.source_tokens.items()}


def bump(histogram: list[int], at: int, by: int = 1) -> None:
    """histogram[at] += by, the list grown with zeros as needed."""
    histogram += [0] * (at + 1 - len(histogram))
    histogram[at] += by


def add_up(total: list[int], more: list[int]) -> list[int]:
    """Element-wise sum of two histograms, the shorter one padded with zeros."""
    longer, shorter = (total, more) if len(total) >= len(more) else (more, total)
    return [a + (shorter[i] if i < len(shorter) else 0) for i, a in enumerate(longer)]
