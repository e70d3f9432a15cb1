"""Output records: batchspec's own schema, or OpenAI-batch output lines (like `vllm run-batch`)."""

import hashlib
import itertools

from batchspec.decoding.stopping import IncrementalText
from batchspec.errors import UsageError

OUR_FIELDS = ("id", "prompt", "messages", "completion", "finish_reason", "stats", "token_ids", "logprobs", "samples")
OPENAI_FIELDS = ("id", "custom_id", "response", "error")
CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"


class RecordMaker:
    """Builds one output record per decoded row.

    output_format: "batchspec" or "openai"; keep: input fields copied to the top level of each
    record (None when absent from a row); keep_all: copy every input field not already there;
    trace: each sample's stats get its steps ("trace", for `batchspec report`).
    """

    def __init__(self, tokenizer, *, output_format: str, model: str, created: int, token_ids: bool,
                 keep: tuple[str, ...] = (), keep_all: bool = False, trace: bool = False):
        reserved = OPENAI_FIELDS if output_format == "openai" else OUR_FIELDS
        clash = [name for name in keep if name in reserved]
        if clash:
            raise UsageError(f"--keep-fields {', '.join(clash)}: already an output field of the {output_format} format")
        self.tokenizer, self.format, self.model, self.created = tokenizer, output_format, model, created
        self.token_ids, self.keep, self.keep_all, self.reserved = token_ids, keep, keep_all, reserved
        self.trace = trace

    @property
    def id_key(self) -> str:
        """The record field holding the input row's id (what resume looks for)."""
        return "custom_id" if self.format == "openai" else "id"

    def __call__(self, row, outputs: list) -> dict:
        """The record of one request: outputs holds its n samples (one RowOutput each)."""
        record = self.openai(row, outputs) if self.format == "openai" else self.ours(row, outputs)
        for name in self.keep:
            record[name] = row.fields.get(name)
        if self.keep_all:
            record |= {k: v for k, v in row.fields.items() if k not in record and k not in self.reserved}
        return record

    def text(self, output) -> str:
        return self.tokenizer.decode(output.token_ids, skip_special_tokens=True)[: output.text_end]

    def stats(self, output) -> dict:
        """A sample's statistics; with trace, its steps too: per step the proposals and how many
        were accepted, each token's start in the text (text_offset) and when the row finished."""
        if not self.trace:
            return output.stats
        trace = output.trace | {"finished_at": round(output.trace["finished_at"], 3),
                                "text_offset": text_offsets(self.tokenizer, output.token_ids)}
        return output.stats | {"trace": trace}

    def ours(self, row, outputs: list) -> dict:
        """n = 1: completion, finish_reason, stats (token_ids, logprobs) at the top level; n > 1:
        a list of those in `samples`, and `stats` summing the token counts."""
        record = {"id": row.id, **({"prompt": row.prompt} if row.messages is None else {"messages": row.messages})}
        samples = [self.sample(output) for output in outputs]
        if len(samples) == 1:
            return record | samples[0]
        return record | {"samples": samples, "stats": totals(outputs)}

    def sample(self, output) -> dict:
        sample = {"completion": self.text(output), "finish_reason": output.finish_reason, "stats": self.stats(output)}
        if self.token_ids:
            sample["token_ids"] = output.token_ids
        if output.logprobs is not None:
            sample["logprobs"] = [
                {"token_id": token, "token": self.token_text(token), "logprob": logprob,
                 "top_logprobs": [{"token_id": i, "token": self.token_text(i), "logprob": lp} for i, lp in top]}
                for token, (logprob, top) in zip(output.token_ids, output.logprobs)
            ]
        return sample

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def entry(self, token: int, logprob: float) -> dict:
        """OpenAI's chat logprob entry for a token: its text, logprob and UTF-8 bytes."""
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def chat_logprobs(self, output) -> dict:
        """choices[].logprobs of a chat completion."""
        content = [self.entry(token, logprob) | {"top_logprobs": [self.entry(i, lp) for i, lp in top]}
                   for token, (logprob, top) in zip(output.token_ids, output.logprobs)]
        return {"content": content, "refusal": None}

    def choice(self, index: int, output, chat: bool) -> dict:
        logprobs = None
        if output.logprobs is not None:
            logprobs = self.chat_logprobs(output) if chat else self.completion_logprobs(output)
        choice = {"index": index, "logprobs": logprobs, "finish_reason": output.finish_reason}
        text = self.text(output)
        return choice | ({"message": {"role": "assistant", "content": text}} if chat else {"text": text})

    def completion_logprobs(self, output) -> dict:
        """choices[].logprobs of a (legacy) completion: parallel lists, text_offset into the text."""
        return {
            "tokens": [self.token_text(token) for token in output.token_ids],
            "token_logprobs": [logprob for logprob, _ in output.logprobs],
            "top_logprobs": [by_text(top, self.token_text) for _, top in output.logprobs],
            "text_offset": text_offsets(self.tokenizer, output.token_ids),
        }

    def openai(self, row, outputs: list) -> dict:
        """A successful OpenAI-batch output line: a choice per sample, usage summed; our statistics
        ride in body["batchspec"] (n > 1: the sums, and each sample's in "samples")."""
        chat = (row.endpoint or (CHAT_URL if row.messages is not None else COMPLETIONS_URL)) == CHAT_URL
        digest = hashlib.blake2b(row.id.encode(), digest_size=12).hexdigest()
        choices = [self.choice(index, output, chat) for index, output in enumerate(outputs)]
        ids = [{"token_ids": output.token_ids} if self.token_ids else {} for output in outputs]
        extras = [self.stats(output) | more for output, more in zip(outputs, ids)]
        usage = totals(outputs)
        body = {
            "id": ("chatcmpl-" if chat else "cmpl-") + digest,
            "object": "chat.completion" if chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
                      "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]},
            "batchspec": extras[0] if len(extras) == 1 else usage | {"samples": extras},
        }
        request_id = f"batch_req_{digest}"
        return {"id": request_id, "custom_id": row.id,
                "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


def by_text(top: list[tuple[int, float]], text) -> dict[str, float]:
    """{text: logprob} of the top tokens (likeliest first): tokens that read the same (byte
    pieces of one character each read U+FFFD) keep the likeliest's, as the dict holds one."""
    out = {}
    for token, logprob in top:
        out.setdefault(text(token), logprob)
    return out


def text_offsets(tokenizer, token_ids: list[int]) -> list[int]:
    """Where each token's text starts in the decoded text (a token that completes no character
    starts where the next one does)."""
    text = IncrementalText(tokenizer)
    return [0, *itertools.accumulate(len(text.add(token)) for token in token_ids)][:-1]


def totals(outputs: list) -> dict:
    """A request's token counts over its samples (the prompt counted once)."""
    summed = ("completion_tokens", "draft_tokens", "accepted_tokens")
    return {"prompt_tokens": outputs[0].stats["prompt_tokens"], **{k: sum(o.stats[k] for o in outputs) for k in summed}}
