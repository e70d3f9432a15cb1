"""What one row asks of its generation beyond the batch's shared settings (an OpenAI request's
body keys, or the run's command line for every row)."""

from dataclasses import dataclass, field

from batchspec.decoding.grammar import Grammar


@dataclass(frozen=True)
class RowOptions:
    """None and the neutral values mean: the run's setting, or no such processing."""

    max_new_tokens: int | None = None  # None: DecodeConfig.max_new_tokens
    seed: int | None = None  # None: DecodeConfig.seed
    ignore_eos: bool = False  # EOS ids do not end the row (stop ids still do)
    stop_token_ids: tuple[int, ...] = ()  # end the row like EOS, the id kept
    stop: tuple[str, ...] = ()  # end the row right before the first of these in its text
    include_stop_str: bool = False  # keep the stop string in the text (vLLM's include_stop_str_in_output)
    min_tokens: int = 0  # no EOS or stop id before this many tokens
    repetition_penalty: float = 1.0  # transformers': prompt and output tokens, > 1 discourages
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the token's count in the output
    presence_penalty: float = 0.0  # OpenAI's: minus this once the token is in the output
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # None: none; k: each token's logprob and the top k (0: the token's only)
    grammar: Grammar | None = None  # structured output: what the row's text must match

    def __post_init__(self):
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        problem = self.grammar_conflict()
        if problem:
            raise ValueError(problem)

    def grammar_conflict(self) -> str | None:
        """Why a structured output cannot be combined with these options, or None: the grammar
        decides where the output ends, with an EOS id once it is complete."""
        if self.grammar is None:
            return None
        conflicts = [name for name, on in (("ignore_eos", self.ignore_eos), ("min_tokens", self.min_tokens)) if on]
        if conflicts:
            return (f"{' and '.join(conflicts)} cannot be combined with a structured output: the grammar decides "
                    "where the output ends")
        return None

    def ending_ids(self, eos_token_ids: tuple[int, ...]) -> list[int]:
        """The ids that end this row: the EOS ids (unless ignored) and its stop ids."""
        return [*(() if self.ignore_eos else eos_token_ids), *self.stop_token_ids]
