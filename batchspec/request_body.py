"""OpenAI request bodies: which keys batchspec honors, which it accepts because they cannot change
the output, and which it refuses by name (nothing is ignored silently)."""

from collections.abc import Callable
from dataclasses import dataclass


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Check:
    """A test of a request value, and its valid values in words."""

    test: Callable[[object], bool]
    must_be: str


def integers(low: int, high: int | None = None) -> Check:
    return Check(lambda v: is_int(v) and low <= v and (high is None or v <= high),
                 f"an integer >= {low}" if high is None else f"an integer in {low}..{high}")


def numbers(low: float, high: float) -> Check:
    return Check(lambda v: is_number(v) and low <= v <= high, f"a number in [{low}, {high}]")


BOOLEAN = Check(lambda v: isinstance(v, bool), "a boolean")
STRING = Check(lambda v: isinstance(v, str), "a string")
OBJECT = Check(lambda v: isinstance(v, dict), "an object")
LIST = Check(lambda v: isinstance(v, list), "a list")
STRINGS = Check(lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v), "a list of strings")
TOKEN_IDS = Check(lambda v: isinstance(v, list) and all(is_int(t) and t >= 0 for t in v), "a list of token ids")
STOP = Check(lambda v: isinstance(v, str) or (STRINGS.test(v) and len(v) <= 4),
             "a string or a list of at most 4 strings")
LOGPROBS_COUNT = integers(0, 20)
LOGPROBS = Check(lambda v: isinstance(v, bool) or LOGPROBS_COUNT.test(v),
                 "a boolean (chat) or an integer in 0..20 (completions)")
BIAS = numbers(-100, 100)
LOGIT_BIAS = Check(lambda v: isinstance(v, dict) and all(k.isascii() and k.isdigit() and BIAS.test(b)
                                                         for k, b in v.items()),
                   "an object of token id strings to numbers in [-100, 100]")
RESPONSE_FORMAT = Check(lambda v: isinstance(v, dict) and v.get("type") in ("text", "json_object", "json_schema"),
                        "an object whose 'type' is text, json_object or json_schema")
TOOL_CHOICE = Check(lambda v: isinstance(v, (str, dict)), "a string or an object")
POSITIVE = Check(lambda v: is_number(v) and v > 0, "a number > 0")


GENERATION, STRUCTURED, CHAT = "generation options", "structured outputs", "chat requests"


@dataclass(frozen=True)
class Unhonored:
    """A body key batchspec does not honor yet: its valid values, those that leave the output as it is
    (null always does), and the feature that will honor the others."""

    check: Check
    off: tuple = ()
    feature: str = GENERATION

    def is_off(self, value) -> bool:
        # 0 == False in Python, but logprobs 0 (completions) asks for the sampled tokens' logprobs
        return any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in self.off)


HONORED_KEYS = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
                "stop_token_ids", "ignore_eos"}  # request_options
NO_EFFECT_KEYS = {"model", "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                  "stream_options", "parallel_tool_calls"}  # any value: no effect (stream and tools are refused)
UNHONORED = {
    "n": Unhonored(integers(1), (1,)),
    "best_of": Unhonored(integers(1), (1,)),
    "use_beam_search": Unhonored(BOOLEAN, (False,)),
    "stop": Unhonored(STOP, ([],)),
    "include_stop_str_in_output": Unhonored(BOOLEAN, (False,)),
    "min_tokens": Unhonored(integers(0), (0,)),
    "logprobs": Unhonored(LOGPROBS, (False,)),
    "top_logprobs": Unhonored(LOGPROBS_COUNT, (0,)),
    "frequency_penalty": Unhonored(numbers(-2, 2), (0,)),
    "presence_penalty": Unhonored(numbers(-2, 2), (0,)),
    "repetition_penalty": Unhonored(POSITIVE, (1,)),
    "logit_bias": Unhonored(LOGIT_BIAS, ({},)),
    "min_p": Unhonored(numbers(0, 1), (0,)),
    "skip_special_tokens": Unhonored(BOOLEAN, (True,)),
    "echo": Unhonored(BOOLEAN, (False,)),
    "suffix": Unhonored(STRING),
    "response_format": Unhonored(RESPONSE_FORMAT, ({"type": "text"},), STRUCTURED),
    "guided_json": Unhonored(Check(lambda v: isinstance(v, (dict, str)), "an object or a string"), (), STRUCTURED),
    "guided_regex": Unhonored(STRING, (), STRUCTURED),
    "guided_choice": Unhonored(STRINGS, (), STRUCTURED),
    "guided_grammar": Unhonored(STRING, (), STRUCTURED),
    "structured_outputs": Unhonored(OBJECT, (), STRUCTURED),
    "tools": Unhonored(LIST, ([],), CHAT),
    "tool_choice": Unhonored(TOOL_CHOICE, ("none",), CHAT),
    "functions": Unhonored(LIST, ([],), CHAT),
    "function_call": Unhonored(TOOL_CHOICE, ("none",), CHAT),
    "chat_template": Unhonored(STRING, (), CHAT),
    "chat_template_kwargs": Unhonored(OBJECT, ({},), CHAT),
    "add_generation_prompt": Unhonored(BOOLEAN, (True,), CHAT),
    "continue_final_message": Unhonored(BOOLEAN, (False,), CHAT),
    "documents": Unhonored(LIST, ([],), CHAT),
    "reasoning_effort": Unhonored(STRING, (), CHAT),
    "stream": Unhonored(BOOLEAN, (False,), "streaming"),
    "modalities": Unhonored(STRINGS, (["text"],), "audio"),
    "audio": Unhonored(OBJECT, (), "audio"),
    "prediction": Unhonored(OBJECT, (), "predicted outputs"),
    "web_search_options": Unhonored(OBJECT, (), "web search"),
}


def quoted(keys: list[str]) -> str:
    return ", ".join(map(repr, keys))


def body_problem(body: dict, input_key: str) -> str | None:
    """Why batchspec would not answer this request body as asked, or None: keys nobody knows, bad
    values, and keys it does not honor yet with a value that would change the output."""
    known = HONORED_KEYS | NO_EFFECT_KEYS | UNHONORED.keys() | {input_key}
    unknown = sorted(body.keys() - known)
    invalid, unsupported = [], []
    for key in sorted(body.keys() & UNHONORED.keys()):
        rule, value = UNHONORED[key], body[key]
        if value is not None and not rule.check.test(value):
            invalid.append(f"{key!r} must be {rule.check.must_be}")
        elif value is not None and not rule.is_off(value):
            unsupported.append(key)
    problems = [f"unrecognized request argument{'s' * (len(unknown) > 1)} {quoted(unknown)}"] if unknown else []
    problems += invalid
    if unsupported:
        features = ", ".join(dict.fromkeys(UNHONORED[key].feature for key in unsupported))
        it, verb = ("it", "is") if len(unsupported) == 1 else ("them", "are")
        problems.append(f"{quoted(unsupported)} {verb} not supported by batchspec yet ({features}); "
                        f"remove {it} or set {it} to null")
    return "; ".join(problems) or None


def request_options(body: dict) -> dict:
    """Per-row generation options of an OpenAI request body (ValueError when one is bad)."""
    options = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        if not is_int(max_tokens) or max_tokens < 1:
            raise ValueError("max_tokens must be a positive integer")
        options["max_new_tokens"] = max_tokens
    for name, low, high in (("temperature", 0.0, None), ("top_p", 0.0, 1.0)):
        value = body.get(name)
        if value is not None:
            if not is_number(value) or value < low or (high and value > high) or (name == "top_p" and value == 0):
                raise ValueError(f"{name} must be a number in {'(0, 1]' if high else '[0, inf)'}")
            options[name] = float(value)
    top_k = body.get("top_k")
    if top_k is not None:
        if not is_int(top_k) or top_k < -1:
            raise ValueError("top_k must be an integer >= -1 (-1 and 0: off)")
        options["top_k"] = max(top_k, 0)  # vLLM's -1 is our 0
    seed = body.get("seed")
    if seed is not None:
        if not is_int(seed):
            raise ValueError("seed must be an integer")
        options["seed"] = seed
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not TOKEN_IDS.test(stop_ids):
            raise ValueError(f"stop_token_ids must be {TOKEN_IDS.must_be}")
        options["stop_token_ids"] = stop_ids
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None:
        if not BOOLEAN.test(ignore_eos):
            raise ValueError(f"ignore_eos must be {BOOLEAN.must_be}")
        options["ignore_eos"] = ignore_eos
    return options
