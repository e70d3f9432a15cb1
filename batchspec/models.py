"""Load the target, the draft and their tokenizer; check that the pair can work together.

A model is named by a Hub id, a local folder (save_pretrained layout) or a `.gguf` file.
"""

import hashlib
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
)
from transformers.utils import logging as hf_logging

from batchspec.decoding.seq2seq import SEQ2SEQ_FAMILIES, decoder_prefix
from batchspec.errors import UsageError, first_line

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the classes AutoModelForCausalLM and AutoModelForSeq2SeqLM build
LANGUAGE_MODELS = frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) | frozenset(
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.values())


class ModelError(UsageError):
    """A model that cannot be loaded or a pair that cannot be used."""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} asked for, but torch sees no CUDA GPU")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ModelError(f"unknown device {device!r}; choose auto, cpu, cuda or cuda:N") from None


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on a GPU that supports it, else float32 (exact, the CPU default)."""
    if dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def cache_dir() -> Path:
    return Path(os.environ.get("BATCHSPEC_CACHE", "~/.cache/batchspec")).expanduser()


def gguf_folder(path: str) -> Path:
    """Where the safetensors copy of a .gguf file lives: keyed by its path, size and mtime."""
    st = os.stat(path)
    key = hashlib.blake2b(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode(), digest_size=8)
    return cache_dir() / "gguf" / f"{Path(path).stem}-{key.hexdigest()}"


def convert_gguf(path: str) -> Path:
    """Dequantize a .gguf file once (slow: tens of seconds) into a safetensors folder with its
    tokenizer; later loads read that folder (fast). Concurrent converters (array jobs on a
    shared cache) each write a temporary folder and the first rename wins."""
    folder = gguf_folder(path)
    if (folder / "config.json").exists():
        return folder
    print(f"batchspec: converting {path} to safetensors in {folder} (once)", file=sys.stderr, flush=True)
    directory, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32,
                                                 trust_remote_code=False)
    model.hf_quantizer = None  # the weights are plain float tensors now
    del model.config.quantization_config
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, folder)
    except OSError:  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def source(spec: str) -> str:
    """A model spec -> what from_pretrained loads: a Hub id or folder as is, a .gguf via its cache."""
    if spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise ModelError(f"GGUF file not found: {spec}")
        try:
            return str(convert_gguf(spec))
        except (OSError, ValueError) as e:
            raise ModelError(f"cannot convert GGUF file {spec!r}: {first_line(e)}") from e
    return spec


def pretrained(auto, spec: str, what: str, **kwargs):
    """auto.from_pretrained(spec) without ever running code the model's folder ships
    (trust_remote_code=False: transformers neither asks on stdin nor imports it); any failure is
    a ModelError naming `what` could not be loaded."""
    try:
        return auto.from_pretrained(source(spec), trust_remote_code=False, **kwargs)
    except (OSError, ValueError) as e:
        if "custom code" in str(e):
            raise ModelError(f"{spec!r} needs the Python code its folder ships (auto_map) to load its {what}; "
                             "batchspec never runs a model's own code: use a model that transformers supports "
                             "natively") from None
        raise ModelError(f"cannot load the {what} of {spec!r}: {first_line(e)}") from e


def load_tokenizer(spec: str):
    return pretrained(AutoTokenizer, spec, "tokenizer")


def load_model(spec: str, dtype: torch.dtype, device: torch.device):
    config = load_config(spec)  # refuses what batchspec cannot decode before any weight is read
    hf_logging.disable_progress_bar()  # the job shows its own progress
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    # attn_implementation None: SDPA, or eager attention for the few architectures without an SDPA version
    model = pretrained(auto, spec, "weights", config=config, dtype=dtype, attn_implementation=None)
    check_layers(model, spec)
    return model.to(device).eval()


def check_kind(config, spec: str) -> None:
    """Refuse a checkpoint batchspec cannot decode exactly: an encoder–decoder family whose
    decoder positions it does not set per row, or weights without a language-model head (a
    classifier, a masked LM), which AutoModelForCausalLM would give a fresh random one."""
    if config.is_encoder_decoder and config.model_type not in SEQ2SEQ_FAMILIES:
        raise ModelError(
            f"{spec!r} is an encoder-decoder model ({config.model_type}); batchspec decodes causal language models "
            f"and the encoder-decoder families {', '.join(SEQ2SEQ_FAMILIES)}"
        )
    listed = getattr(config, "architectures", None) or []
    if listed and not LANGUAGE_MODELS & set(listed):
        raise ModelError(
            f"{spec!r} is a {listed[0]}, not a language model (a ...ForCausalLM or ...ForConditionalGeneration); "
            "its weights hold no next-token head for batchspec to decode with"
        )


# layer_types that carry a recurrent state
RECURRENT_LAYERS = {"linear_attention", "mamba", "conv", "recurrent", "hybrid", "rwkv"}


def check_layers(model, spec: str) -> None:
    """Refuse a model with layers whose state batchspec cannot mask by position and cut back:
    a recurrent state (older transformers releases mark such models _is_stateful; 5.25 does not,
    and names their layers: Mamba's "linear_attention", LFM2's "conv", ...), or another kind of
    attention."""
    layer_types = set(getattr(model.config.get_text_config(decoder=True), "layer_types", None) or ())
    if getattr(model, "_is_stateful", False) or layer_types & RECURRENT_LAYERS:
        raise ModelError(
            f"{spec!r} is a {type(model).__name__}, whose recurrent state cannot be rolled back to the "
            "accepted tokens; batchspec needs attention-only models (a KV cache)"
        )
    other = layer_types - {"full_attention", "sliding_attention"}
    if other:
        raise ModelError(
            f"{spec!r} has {', '.join(sorted(other))} layers; batchspec supports full and "
            "sliding-window attention layers only"
        )


UNAPPLIED = {  # generation config settings batchspec does not apply, and their neutral values
    "num_beams": 1, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "min_length": 0,
    "min_new_tokens": 0, "bad_words_ids": None, "sequence_bias": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "exponential_decay_length_penalty": None, "encoder_repetition_penalty": 1.0,
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None, "guidance_scale": 1.0,
    "watermarking_config": None, "stop_strings": None,
}


def unapplied_settings(model) -> list[str]:
    """The settings of the model's generation config that generate() would apply and batchspec
    does not (it decodes greedily or samples, one sequence per sample), as name=value."""
    config = model.generation_config
    return [f"{name}={getattr(config, name)}" for name, neutral in UNAPPLIED.items()
            if getattr(config, name, neutral) not in (neutral, None)]


def check_same_tokenizer(target_tokenizer, draft_tokenizer) -> None:
    """Refuse a pair whose tokenizers map any id differently, naming the first such id."""
    target_tokens = {i: t for t, i in target_tokenizer.get_vocab().items()}
    draft_tokens = {i: t for t, i in draft_tokenizer.get_vocab().items()}
    for i in range(max(len(target_tokens), len(draft_tokens), max(target_tokens) + 1, max(draft_tokens) + 1)):
        a, b = target_tokens.get(i), draft_tokens.get(i)
        if a != b:
            raise ModelError(
                f"the draft's tokenizer differs from the target's: id {i} is {a!r} for the target "
                f"and {b!r} for the draft; use a draft from the target's family"
            )


def eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    """Every id that ends a completion: the generation config's (int or list), else the tokenizer's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def rope_window(config) -> int | None:
    """The positions a rope that rescales by each forward's longest position (dynamic NTK,
    LongRoPE) leaves unscaled (None: no such rope). Past them transformers rescales every row of
    a forward by its longest one, and generate() re-encodes a row that crosses them (Phi-3): a
    row there would depend on its batch mates and on how far its proposals reach."""
    text = config.get_text_config(decoder=True)
    params = getattr(text, "rope_parameters", None) or {}
    per_layer = params and all(isinstance(p, dict) for p in params.values())  # {layer type: its rope}
    windows = []
    for rope in params.values() if per_layer else [params]:
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if "dynamic" in kind:
            windows.append(text.max_position_embeddings)
        elif kind == "longrope":
            windows.append(rope.get("original_max_position_embeddings") or text.original_max_position_embeddings)
    return min(windows, default=None)


def context_length(config, lookahead: int = 0) -> int | None:
    """The longest row (prompt and completion) the model decodes as generate() does: its
    max_position_embeddings, or within a length-scaled rope's window (rope_window) less
    `lookahead`, the positions a step verifies past a row's newest token."""
    longest, window = getattr(config, "max_position_embeddings", None), rope_window(config)
    return longest if window is None else min(window - lookahead, longest or window)


def load_config(spec: str):
    """The model's config alone (no weights), refused unless it is a causal LM's."""
    config = pretrained(AutoConfig, spec, "config")
    check_kind(config, spec)
    return config


@dataclass
class ModelPair:
    target: object
    draft: object | None
    tokenizer: object
    more_drafts: list = field(default_factory=list)  # draft models beside the first

    @property
    def drafts(self) -> list:
        """Every draft model, the first first."""
        return [self.draft, *self.more_drafts] if self.draft is not None else []

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return eos_token_ids(self.target, self.tokenizer)

    @property
    def forced_tokens(self) -> dict[str, int | None]:
        """The tokens the target's generation config forces first and last (DecodeConfig's fields)."""
        config = self.target.generation_config
        return {name: getattr(config, name, None) for name in ("forced_bos_token_id", "forced_eos_token_id")}

    def context_length(self, lookahead: int = 0) -> int | None:
        """The longest sequence every model takes (a draft may have the shorter context);
        lookahead: as context_length's."""
        lengths = [context_length(m.config, lookahead) for m in (self.target, *self.drafts)]
        return min((n for n in lengths if n is not None), default=None)


def load_pair(target: str, draft: str | None = None, more_drafts: tuple[str, ...] = (), *, dtype: str = "auto",
              device: str = "auto") -> ModelPair:
    """Load the target, its tokenizer and (optionally) a draft, or several, sharing that tokenizer."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    tokenizer = load_tokenizer(target)
    specs = [draft, *more_drafts] if draft is not None else []
    for spec in specs:
        check_same_tokenizer(tokenizer, load_tokenizer(spec))
    target_model = load_model(target, torch_dtype, torch_device)
    drafts = [load_model(spec, torch_dtype, torch_device) for spec in specs]
    for draft_model in drafts or [None]:
        check_seq2seq(target_model, draft_model, target)
    return ModelPair(target_model, drafts[0] if drafts else None, tokenizer, drafts[1:])


def check_seq2seq(target, draft, spec: str) -> None:
    """An encoder–decoder target needs a decoder start token and a draft of its own kind, which
    starts its decoder alike."""
    if draft is not None and draft.config.is_encoder_decoder != target.config.is_encoder_decoder:
        kinds = ["an encoder-decoder" if m.config.is_encoder_decoder else "a decoder-only" for m in (target, draft)]
        raise ModelError(f"the target is {kinds[0]} model and the draft {kinds[1]} one; use a draft of the same kind")
    if not target.config.is_encoder_decoder:
        return
    prefix = decoder_prefix(target)
    if prefix[0] is None:
        raise ModelError(f"{spec!r} names no decoder_start_token_id (nor bos_token_id) in its generation config")
    if draft is not None and decoder_prefix(draft) != prefix:
        raise ModelError(f"the draft starts its decoder with {decoder_prefix(draft)}, the target with {prefix}")
