"""Encoder–decoder models (T5, BART, Marian, Pegasus, mBART): the encoder reads each row's prompt
once, and the decoder runs the same propose/verify/rollback loop as a causal LM over its
self-attention cache (the cross-attention cache, filled by the first decoder forward, never
needs a rollback).

These decoders place tokens by cache slot, not by a per-row position: T5 computes its relative
bias from slot distances, the BART family embeds slot indices. Pads and the holes rollbacks
leave would shift them. So each model gets one patch (`row_positions`): T5's decoder bias, or
the BART family's decoder position embeddings, are computed from per-row positions
(cumsum(mask) - 1 over the decoder's slots), which the cache sets around each of its forwards;
outside them the model computes its own. The encoder reads right-padded prompts: every family
then sees each row's tokens at their own positions.
"""

import torch
import torch.nn.functional as F
from transformers import DynamicCache, EncoderDecoderCache

from batchspec.decoding.attention import attention
from batchspec.decoding.kv_cache import OFFSET_LAYERS, BatchKV, Static, StaticKV, uses_alibi

T5_FAMILY = ("t5", "mt5", "umt5")  # a relative position bias (UMT5: in every layer)
BART_FAMILY = ("bart", "mbart", "marian", "pegasus")  # learned (offset 2) or sinusoidal position embeddings
SEQ2SEQ_FAMILIES = T5_FAMILY + BART_FAMILY


class RowPositions:
    """The decoder's per-row positions [B, L] during one of the cache's forwards, else None."""

    def __init__(self):
        self.positions: torch.Tensor | None = None


def row_positions(model) -> RowPositions:
    """Patch `model` (once) to read its decoder positions from the returned RowPositions."""
    if not hasattr(model, "batchspec_positions"):
        state = RowPositions()
        if model.config.model_type in T5_FAMILY:
            for attention in model.get_decoder().modules():
                if getattr(attention, "has_relative_attention_bias", False):
                    attention.compute_bias = row_bias(attention, state)
        else:
            model.get_decoder().embed_positions.register_forward_hook(row_embeddings(state))
        model.batchspec_positions = state
    return model.batchspec_positions


def row_bias(attention, state: RowPositions):
    """A T5 self-attention's compute_bias giving [B, H, q, k] from the rows' own positions."""
    original = attention.compute_bias

    def compute_bias(query_length, key_length, device=None, past_seen_tokens=0):
        positions = state.positions  # [B, k]
        if positions is None:
            return original(query_length, key_length, device=device, past_seen_tokens=past_seen_tokens)
        relative = positions[:, None, :] - positions[:, -query_length:, None]  # [B, q, k]: key - query
        if attention.config.model_type == "umt5":  # its bucket function reads its settings itself
            bucket = attention._relative_position_bucket(relative)
        else:
            bucket = attention._relative_position_bucket(
                relative, bidirectional=False, num_buckets=attention.relative_attention_num_buckets,
                max_distance=attention.relative_attention_max_distance)
        return attention.relative_attention_bias(bucket).permute(0, 3, 1, 2)  # [B, H, q, k]

    return compute_bias


def row_embeddings(state: RowPositions):
    """A forward hook on a BART-family decoder's embed_positions: the embeddings of the rows' own
    positions [B, S, D] in place of the slots' ([S, D] or [1, S, D]); they add to the tokens'."""

    def hook(module, args, output):
        if state.positions is None:
            return output
        positions = state.positions[:, -output.shape[-2] :] + getattr(module, "offset", 0)  # [B, S]
        return F.embedding(positions, module.weight).to(output.dtype)

    return hook


def decoder_prefix(model) -> list[int]:
    """What the decoder starts from, as generate() does: the decoder start token, else BOS (a
    forced BOS, mBART's language id, is the first generated token: DecodeConfig's)."""
    config = model.generation_config
    return [config.decoder_start_token_id if config.decoder_start_token_id is not None else config.bos_token_id]


def continuation_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens) + 1, V]: the model's logits for each of `tokens` after the prompt and for the
    token after them, in one uncached forward (an encoder–decoder reads the prompt in its
    encoder and the tokens after its decoder prefix). Ids past its embeddings go in as its last."""
    last = model.get_input_embeddings().num_embeddings - 1
    if model.config.is_encoder_decoder:
        prefix = decoder_prefix(model)
        source = torch.tensor([prompt], device=model.device).clamp(max=last)
        decoder_ids = torch.tensor([prefix + tokens], device=model.device).clamp(max=last)
        return model(input_ids=source, decoder_input_ids=decoder_ids).logits[0, len(prefix) - 1 :]
    ids = torch.tensor([prompt + tokens], device=model.device).clamp(max=last)
    return model(ids).logits[0, len(prompt) - 1 :]


class Seq2SeqKV(BatchKV):
    """An encoder–decoder model's state for a static batch: the encoder's output for each row's
    prompt, and the decoder's cache, masked, rolled back, evicted and compacted as BatchKV's."""

    maskless = False  # a decoder given no mask makes one of ones and reads it back (a sync)

    def __init__(self, model, source: tuple[torch.Tensor, torch.Tensor]):
        """source: the prompts, right-padded: ids, mask [B, P]."""
        ids, mask = source
        super().__init__(model, ids.shape[0], ids.device)
        self.positions = row_positions(model)
        with attention():
            self.encoded = model.get_encoder()(input_ids=ids, attention_mask=mask)  # last_hidden_state [B, P, H]
        self.source_mask = mask  # [B, P]

    def new_cache(self):
        decoder = self.model.get_decoder().config  # T5's own num_layers is the encoder's depth
        return EncoderDecoderCache(DynamicCache(config=decoder), DynamicCache(config=decoder))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, seen: torch.Tensor,
            logits_to_keep: int) -> torch.Tensor:
        self.positions.positions = positions  # [B, L]: what the model's patch reads
        try:
            with attention():
                out = self.model(
                    encoder_outputs=self.encoded,
                    attention_mask=self.additive(self.source_mask.bool()[:, None, None, :]),  # [B, 1, 1, P]: no sync
                    decoder_input_ids=input_ids,
                    decoder_attention_mask=self.attention_masks(seen, positions),
                    use_cache=True,
                    **{self.cache_keyword: self.cache},
                )
        finally:
            self.positions.positions = None
        return out.logits[:, -logits_to_keep:] if logits_to_keep else out.logits  # the model ignores logits_to_keep

    @property
    def layers(self):
        return self.cache.self_attention_cache.layers  # the cross-attention cache is never cut

    def select(self, rows: torch.Tensor) -> None:
        super().select(rows)
        self.encoded.last_hidden_state = self.encoded.last_hidden_state[rows]
        self.source_mask = self.source_mask[rows]


def model_cache(model, batch_size: int, device, source: tuple[torch.Tensor, torch.Tensor] | None,
                static: Static | None = None) -> BatchKV:
    """A model's cache for a batch: Seq2SeqKV over the source prompts for an encoder–decoder model;
    with `static`, StaticKV where the model can take one (static_problem)."""
    if model.config.is_encoder_decoder:
        return Seq2SeqKV(model, source)
    if static is None or static_problem(model):
        return BatchKV(model, batch_size, device)
    return StaticKV(model, batch_size, device, static.capacity, static.compiled)


def static_problem(model) -> str | None:
    """Why a model decodes on today's dynamic cache when a static one is asked (None: it need not)."""
    if model.config.is_encoder_decoder:
        return "encoder–decoder models keep a dynamic cache"
    if uses_alibi(model.config):
        return f"{model.config.model_type} reads its ALiBi biases from the 2D mask: dynamic cache"
    if not OFFSET_LAYERS:
        return "this transformers version's static cache layers keep no write offset: dynamic cache"
    return None
