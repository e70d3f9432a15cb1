"""Tiny target/draft pairs built from configs and an in-memory tokenizer: for tests and benchmarks.

No network: the tokenizer is a byte-level BPE trained here on generated text; the models are
randomly initialised; the draft is the target plus weight noise, so it agrees often, not always,
or (draft_layers) the target's first layers, a draft as much cheaper as it is shallower.
Everything is written with save_pretrained, so it is loaded back the way users' models are.
"""

import random
import re
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    BartConfig,
    GPT2Config,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    T5Config,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have this from or "
    "had by hot word but what some we can out other were all there when up use your how said an each "
    "she which do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over know "
    "water than call first who may down side been now find any new work part take get place made live "
    "where after back little only round man year came show every good me give our under name very "
    "through just form sentence great think say help low line differ turn cause much mean before move "
    "right boy old too same tell does set three want air well also play small end put home read hand "
    "port large spell add even land here must big high such follow act why ask men change went light "
    "kind off need house picture try us again animal point mother world near build self earth father"
).split()


def sample_text(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return text.capitalize() + rng.choice([".", "?", "!", ":", ","])


def build_tokenizer(vocab_size: int = 512, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained in memory (on text drawn with `seed`), with a ChatML chat template."""
    rng = random.Random(seed)
    corpus = [sample_text(rng, rng.randint(3, 30)) + f" {rng.randint(0, 9999)}" for _ in range(3000)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


ANY_FAMILY = {  # set on other architectures' configs where they have the field (not a computed property)
    "rotary_dim": 8, "moe_intermediate_size": 64, "num_experts": 4, "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,  # tied, a random Gemma's scaled input embeddings make it repeat its input
}


def build_config(family: str, tokenizer, size: int = 64, layers: int = 2, window: int = 4096):
    """A tiny config of any architecture transformers knows (`model_type`), Llama-shaped where the
    names allow. window: the sliding window where the architecture has one (mistral: every
    layer; gemma2: every other layer, eager attention)."""
    common = {
        "vocab_size": len(tokenizer),
        "initializer_range": 0.2,
        "bos_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    decoder = {
        "hidden_size": size, "intermediate_size": 2 * size, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 1024, **common,
    }
    if family == "llama":
        return LlamaConfig(**decoder)
    if family == "qwen2":  # no sliding window: the suite's plain 2D-mask path
        return Qwen2Config(**decoder)
    if family == "gpt2":
        return GPT2Config(n_embd=size, n_layer=layers, n_head=4, n_positions=1024, **common)
    if family == "t5":  # encoder–decoder, relative positions; initializer_factor 3: varied greedy text
        return T5Config(d_model=size, d_kv=size // 4, d_ff=2 * size, num_layers=layers, num_heads=4,
                        decoder_start_token_id=tokenizer.pad_token_id, pad_token_id=tokenizer.pad_token_id,
                        initializer_factor=3.0, tie_word_embeddings=False, dropout_rate=0.0, **common)
    if family == "bart":  # encoder–decoder, learned positions; forces EOS at the limit, as BART does
        return BartConfig(d_model=size, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=2 * size, decoder_ffn_dim=2 * size,
                          max_position_embeddings=1024, init_std=0.2, dropout=0.0, attention_dropout=0.0,
                          pad_token_id=tokenizer.pad_token_id, decoder_start_token_id=tokenizer.eos_token_id,
                          forced_eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False, **common)
    config = AutoConfig.for_model(family, pad_token_id=tokenizer.pad_token_id, **decoder)
    for name, value in {**ANY_FAMILY, "head_dim": size // 4, "sliding_window": window}.items():
        if name in vars(config):
            setattr(config, name, value)
    return config


def perturbed(model, noise: float, seed: int):
    """A copy of `model` with gaussian noise of `noise` times each tensor's std added to it."""
    copy = type(model)(model.config)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        scale = noise * tensor.float().std() if tensor.numel() > 1 else 0.0
        state[name] = tensor + scale * torch.randn(tensor.shape, generator=generator)
    copy.load_state_dict(state)
    return copy


def shallow(model, layers: int, nudge: float):
    """The first `layers` layers of `model` (with its embeddings, final norm and head) as a model of
    their own; every matrix and bias of `model`'s later layers is scaled by `nudge` (in place),
    so that those layers nudge what the first ones compute rather than rewrite it: the smaller
    `nudge`, the more often the shallow copy agrees (0: always)."""
    fields = {**model.config.to_dict(), "num_hidden_layers": layers}
    if fields.get("layer_types"):  # one entry a layer (full or sliding attention)
        fields["layer_types"] = fields["layer_types"][:layers]
    config = model.config.__class__.from_dict(fields)
    copy = type(model)(config)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            index = re.search(r"\.(?:layers|h)\.(\d+)\.", name)
            if index and int(index.group(1)) >= layers and (weight.dim() == 2 or name.endswith("bias")):
                weight.mul_(nudge)
    kept = copy.state_dict().keys()
    copy.load_state_dict({name: tensor for name, tensor in model.state_dict().items() if name in kept})
    return copy.eval()  # as loaded models are: no dropout


def build_pair(
    folder: Path, family: str, *, noise: float = 0.1, seed: int = 0, eos_token_ids=None, size: int = 64, layers: int = 2,
    window: int = 4096, draft_layers: int | None = None,
) -> tuple[Path, Path]:
    """Write a tiny target and its draft (same tokenizer) under `folder`; return both paths. The
    draft is the target plus `noise` times each tensor's std, or with draft_layers (decoder-only
    families) the target's first draft_layers layers, its later layers' weights scaled by `noise`."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = build_config(family, tokenizer, size, layers, window)
    target = (AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM).from_config(config)
    draft = perturbed(target, noise, seed + 1) if draft_layers is None else shallow(target, draft_layers, noise)
    eos = tokenizer.eos_token_id if eos_token_ids is None else list(eos_token_ids)
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        path = Path(folder) / f"{family}-{name}"
        model.generation_config.eos_token_id = eos
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]
