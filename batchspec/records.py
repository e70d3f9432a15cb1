"""Output records: batchspec's own schema, or OpenAI-batch output lines (like `vllm run-batch`)."""

import hashlib

from batchspec.errors import UsageError

OUR_FIELDS = ("id", "prompt", "messages", "completion", "finish_reason", "stats", "token_ids")
OPENAI_FIELDS = ("id", "custom_id", "response", "error")
CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"


class RecordMaker:
    """Builds one output record per decoded row.

    output_format: "batchspec" or "openai"; keep: input fields copied to the top level of each
    record (None when absent from a row); keep_all: copy every input field not already there.
    """

    def __init__(self, tokenizer, *, output_format: str, model: str, created: int, token_ids: bool,
                 keep: tuple[str, ...] = (), keep_all: bool = False):
        reserved = OPENAI_FIELDS if output_format == "openai" else OUR_FIELDS
        clash = [name for name in keep if name in reserved]
        if clash:
            raise UsageError(f"--keep-fields {', '.join(clash)}: already an output field of the {output_format} format")
        self.tokenizer, self.format, self.model, self.created = tokenizer, output_format, model, created
        self.token_ids, self.keep, self.keep_all, self.reserved = token_ids, keep, keep_all, reserved

    @property
    def id_key(self) -> str:
        """The record field holding the input row's id (what resume looks for)."""
        return "custom_id" if self.format == "openai" else "id"

    def __call__(self, row, output) -> dict:
        text = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
        record = self.openai(row, output, text) if self.format == "openai" else self.ours(row, output, text)
        for name in self.keep:
            record[name] = row.fields.get(name)
        if self.keep_all:
            record |= {k: v for k, v in row.fields.items() if k not in record and k not in self.reserved}
        return record

    def ours(self, row, output, text: str) -> dict:
        record = {
            "id": row.id,
            **({"prompt": row.prompt} if row.messages is None else {"messages": row.messages}),
            "completion": text,
            "finish_reason": output.finish_reason,
            "stats": output.stats,
        }
        if self.token_ids:
            record["token_ids"] = output.token_ids
        return record

    def openai(self, row, output, text: str) -> dict:
        """A successful OpenAI-batch output line; our statistics ride in body["batchspec"]."""
        chat = (row.endpoint or (CHAT_URL if row.messages is not None else COMPLETIONS_URL)) == CHAT_URL
        digest = hashlib.blake2b(row.id.encode(), digest_size=12).hexdigest()
        choice = {"index": 0, "logprobs": None, "finish_reason": output.finish_reason}
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        prompt_tokens, completion_tokens = output.stats["prompt_tokens"], output.stats["completion_tokens"]
        extra = {"token_ids": output.token_ids} if self.token_ids else {}
        body = {
            "id": ("chatcmpl-" if chat else "cmpl-") + digest,
            "object": "chat.completion" if chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "batchspec": {**output.stats, **extra},
        }
        request_id = f"batch_req_{digest}"
        return {"id": request_id, "custom_id": row.id,
                "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}
