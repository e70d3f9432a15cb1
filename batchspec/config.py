"""One object holding every run option; the CLI fills it, the job reads it."""

import hashlib
import os
from dataclasses import asdict, dataclass

FINGERPRINT_FIELDS = (
    "target", "draft", "mode", "gamma", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "dtype",
    "prompt_field", "id_field", "messages_field", "chat", "system", "truncate", "token_ids",
)  # what changes the records; batch size, window and device only change the speed


@dataclass(frozen=True)
class RunConfig:
    input: str
    out: str
    target: str | None = None  # None: the embedded default pair
    draft: str | None = None
    mode: str = "spec"  # "spec" or "ar"
    gamma: int = 5
    max_new_tokens: int = 256
    temperature: float | None = None  # None: from the target's generation_config
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    batch_size: int = 8
    max_batch_tokens: int | None = None
    window: int = 1024
    dtype: str = "auto"
    device: str = "auto"
    prompt_field: str = "prompt"
    id_field: str = "id"
    messages_field: str = "messages"
    chat: bool = False  # wrap plain prompts as one user message
    system: str | None = None  # system message for chats that have none
    truncate: str | None = None  # None, "left" or "right"
    token_ids: bool = False
    overwrite: bool = False
    dry_run: bool = False
    progress: bool = True

    def options(self) -> dict:
        return asdict(self)

    def fingerprint(self) -> dict:
        """What a resumed run must share with the run that started OUT."""
        options = self.options()
        return {"options": {k: options[k] for k in FINGERPRINT_FIELDS}, "input": input_identity(self.input)}


def input_identity(path: str, sample: int = 1 << 16) -> dict:
    """Size and a hash of the first and last 64 KiB: cheap, changes when the data does, and
    survives moving the file."""
    size = os.path.getsize(path)
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        digest.update(f.read(sample))
        if size > sample:
            f.seek(max(sample, size - sample))
            digest.update(f.read(sample))
    return {"size": size, "blake2b_head_tail": digest.hexdigest()}
