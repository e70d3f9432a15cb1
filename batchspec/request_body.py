"""OpenAI request bodies: which keys batchspec honors, which it accepts because they cannot change
the output, and which it refuses by name (nothing is ignored silently)."""

from collections.abc import Callable
from dataclasses import dataclass

from batchspec.chat import CHAT_KEYS, renders
from batchspec.decoding.grammar import Grammar


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
STOP = Check(lambda v: isinstance(v, str) and v != "" or STRINGS.test(v) and all(v),
             "a non-empty string or a list of them")
LOGPROBS_COUNT = integers(0, 20)
BIAS = numbers(-100, 100)
LOGIT_BIAS = Check(lambda v: isinstance(v, dict) and all(k.isascii() and k.isdigit() and BIAS.test(b)
                                                         for k, b in v.items()),
                   "an object of token id strings to numbers in [-100, 100]")
TOOL_CHOICE = Check(lambda v: isinstance(v, (str, dict)), "a string or an object")
POSITIVE = Check(lambda v: is_number(v) and v > 0, "a number > 0")


GENERATION = "generation options"
LEGACY = "the legacy function calling: give tools and tool_choice"


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


HONORED_KEYS = {"n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                "stop_token_ids", "ignore_eos", "stop", "include_stop_str_in_output", "min_tokens", "logprobs",
                "top_logprobs", "frequency_penalty", "presence_penalty", "repetition_penalty",
                "logit_bias", "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs"}  # request_options
NO_EFFECT_KEYS = {"model", "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                  "stream_options", "parallel_tool_calls"}  # any value: no effect (stream and tools are refused)
UNHONORED = {
    "best_of": Unhonored(integers(1), (1,)),
    "use_beam_search": Unhonored(BOOLEAN, (False,)),
    "skip_special_tokens": Unhonored(BOOLEAN, (True,)),
    "echo": Unhonored(BOOLEAN, (False,)),
    "suffix": Unhonored(STRING),
    "functions": Unhonored(LIST, ([],), LEGACY),
    "function_call": Unhonored(TOOL_CHOICE, ("none",), LEGACY),
    "reasoning_effort": Unhonored(STRING, (), "reasoning effort: set the template's own flag in chat_template_kwargs"),
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
    values, chat keys on a completions body, and keys it does not honor yet with a value that
    would change the output."""
    known = HONORED_KEYS | NO_EFFECT_KEYS | UNHONORED.keys() | set(CHAT_KEYS) | {input_key}
    unknown = sorted(body.keys() - known)
    misplaced = sorted(k for k in CHAT_KEYS if renders(k, body.get(k))) if input_key != "messages" else []
    invalid, unsupported = [], []
    for key in sorted(body.keys() & UNHONORED.keys()):
        rule, value = UNHONORED[key], body[key]
        if value is not None and not rule.check.test(value):
            invalid.append(f"{key!r} must be {rule.check.must_be}")
        elif value is not None and not rule.is_off(value):
            unsupported.append(key)
    problems = [f"unrecognized request argument{'s' * (len(unknown) > 1)} {quoted(unknown)}"] if unknown else []
    if misplaced:
        problems.append(f"{quoted(misplaced)} {'is' if len(misplaced) == 1 else 'are'} for /v1/chat/completions")
    problems += invalid
    if unsupported:
        features = ", ".join(dict.fromkeys(UNHONORED[key].feature for key in unsupported))
        it, verb = ("it", "is") if len(unsupported) == 1 else ("them", "are")
        problems.append(f"{quoted(unsupported)} {verb} not supported by batchspec yet ({features}); "
                        f"remove {it} or set {it} to null")
    return "; ".join(problems) or None


MAX_N = 128  # OpenAI's limit on n

OPTIONS = {  # body key -> (its check, the RowOptions or SamplingParams field it sets; n: the job's)
    "n": (integers(1, MAX_N), "n"),
    "temperature": (numbers(0, float("inf")), "temperature"),
    "top_p": (Check(lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1]"), "top_p"),
    "top_k": (integers(-1), "top_k"),
    "min_p": (numbers(0, 1), "min_p"),
    "seed": (Check(is_int, "an integer"), "seed"),
    "stop_token_ids": (TOKEN_IDS, "stop_token_ids"),
    "ignore_eos": (BOOLEAN, "ignore_eos"),
    "stop": (STOP, "stop"),
    "include_stop_str_in_output": (BOOLEAN, "include_stop_str"),
    "min_tokens": (integers(0), "min_tokens"),
    "frequency_penalty": (numbers(-2, 2), "frequency_penalty"),
    "presence_penalty": (numbers(-2, 2), "presence_penalty"),
    "repetition_penalty": (POSITIVE, "repetition_penalty"),
    "logit_bias": (LOGIT_BIAS, "logit_bias"),
}


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p")  # shared by a batch's rows; the rest are per row
SAMPLES = "n"  # completions per request: the job decodes a request's prompt n times


def request_options(body: dict, chat: bool) -> dict:
    """Per-row generation options of an OpenAI request body, named as RowOptions and
    SamplingParams name them (ValueError when one is bad). chat: a chat completions body, whose
    logprobs is a boolean with top_logprobs beside it (completions: logprobs is the top k)."""
    options = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        if not is_int(max_tokens) or max_tokens < 1:
            raise ValueError("max_tokens must be a positive integer")
        options["max_new_tokens"] = max_tokens
    for key, (check, name) in OPTIONS.items():
        value = body.get(key)
        if value is not None:
            if not check.test(value):
                raise ValueError(f"{key} must be {check.must_be}")
            options[name] = value
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if name in options:
            options[name] = float(options[name])
    if "top_k" in options:
        options["top_k"] = max(options["top_k"], 0)  # vLLM's -1 is our 0
    if isinstance(options.get("stop"), str):
        options["stop"] = [options["stop"]]
    for name in ("stop", "stop_token_ids"):
        if name in options:
            options[name] = tuple(options[name])
    if "logit_bias" in options:
        options["logit_bias"] = {int(token): float(bias) for token, bias in options["logit_bias"].items()}
    logprobs = logprobs_option(body, chat)
    if logprobs is not None:
        options["logprobs"] = logprobs
    grammar = structured_output(body)
    if grammar is not None:
        options["grammar"] = grammar
    return options


JSON_OBJECT = {"type": "object"}  # OpenAI's JSON mode: any object
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}  # vLLM's


def grammar_of(key: str, kind: str, value) -> Grammar:
    """A body value as a grammar of its kind (a JSON schema: an object or its JSON text)."""
    if kind in ("regex", "grammar") and not isinstance(value, str):
        raise ValueError(f"{key} must be a string")
    try:
        if kind == "json_schema":
            return Grammar.json_schema(value)
        return Grammar.choice(value) if kind == "choice" else Grammar(kind, value)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None


def structured_output(body: dict) -> Grammar | None:
    """The grammar a body's structured output asks for (OpenAI's response_format, vLLM's
    guided_* keys or its structured_outputs object), None for free text; ValueError when it is
    malformed, cannot be enforced, or more than one is given."""
    given = []  # (key, grammar)
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError("response_format must be an object whose 'type' is text, json_object or json_schema")
        if kind == "json_object":
            given.append(("response_format", grammar_of("response_format", "json_schema", JSON_OBJECT)))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or spec.get("schema") is None:
                raise ValueError("response_format of type json_schema needs json_schema.schema, the JSON schema")
            given.append(("response_format", grammar_of("response_format.json_schema.schema", kind, spec["schema"])))
    given += [(key, grammar_of(key, kind, body[key])) for key, kind in GUIDED.items() if body.get(key) is not None]
    outputs = body.get("structured_outputs")
    if outputs is not None:
        given += structured_outputs(outputs)
    if len(given) > 1:
        raise ValueError(f"give one structured output, not {', '.join(key for key, _ in given)}")
    return given[0][1] if given else None


def structured_outputs(outputs) -> list[tuple[str, Grammar]]:
    """vLLM's structured_outputs object: json, regex, choice, grammar or json_object."""
    if not isinstance(outputs, dict):
        raise ValueError("structured_outputs must be an object")
    taken = (*STRUCTURED_OUTPUTS, "json_object")
    unsupported = sorted(k for k, v in outputs.items() if v is not None and k not in taken
                         and not (k == "disable_any_whitespace" and v is True))
    if unsupported:
        raise ValueError(f"structured_outputs.{unsupported[0]} is not supported by batchspec (it writes compact JSON "
                         "and takes json, regex, choice, grammar or json_object)")
    given = [(f"structured_outputs.{key}", grammar_of(f"structured_outputs.{key}", kind, outputs[key]))
             for key, kind in STRUCTURED_OUTPUTS.items() if outputs.get(key) is not None]
    if outputs.get("json_object"):
        given.append(("structured_outputs.json_object", grammar_of("structured_outputs", "json_schema", JSON_OBJECT)))
    return given


def logprobs_option(body: dict, chat: bool) -> int | None:
    """How many top logprobs a body asks for per token (0: the token's own only), or None."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if not chat:
        if logprobs is not None and logprobs is not False and not LOGPROBS_COUNT.test(logprobs):
            raise ValueError(f"logprobs must be {LOGPROBS_COUNT.must_be} for /v1/completions")
        if top:
            raise ValueError("top_logprobs is for /v1/chat/completions; /v1/completions takes logprobs: k")
        return None if logprobs is False else logprobs
    if logprobs is not None and not BOOLEAN.test(logprobs):
        raise ValueError(f"logprobs must be {BOOLEAN.must_be} for /v1/chat/completions (top_logprobs: k)")
    if top is not None and not LOGPROBS_COUNT.test(top):
        raise ValueError(f"top_logprobs must be {LOGPROBS_COUNT.must_be}")
    if top and not logprobs:
        raise ValueError("top_logprobs needs logprobs: true")
    return (top or 0) if logprobs else None
