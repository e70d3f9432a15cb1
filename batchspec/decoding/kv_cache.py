"""One model's KV cache for a static batch: prefill, extend, rollback, evict, compact.

The cache has one slot per column of `mask` ([B, L]); a 0 marks a left pad or a hole left by a
rollback. Positions are always `cumsum(mask) - 1`, so pads and holes are skipped and each row
sees exactly its own tokens at their true positions, whatever its batch mates did.

Every model gets its 4D attention masks built here, in true positions: sliding-window attention
(Mistral, Gemma 2/3, gpt-oss, ...) counts its window in them, where the library's own masks
would count slots (pads and holes included), and a 4D mask is taken as given, where building one
from a 2D mask reads the mask back to the host (a sync per forward). ALiBi models (BLOOM, MPT,
Falcon with alibi) get the 2D mask instead: their position biases are computed from it. Every
layer keeps its whole past so that rollback and compaction stay possible.

A token tree (decoding/tree.py) is appended with forward_tree: its slots see the past and their
own ancestors only, at position past + depth; take_tree then keeps one path of it, in order.
"""

import inspect

import torch
from transformers import DynamicCache

from batchspec.decoding.attention import attention
from batchspec.decoding.tree import tree_ancestors

ALIBI_MODELS = {"bloom", "mpt"}  # model types whose forward reads the 2D mask (as do configs with alibi=True)
SLOT_ALIBI = {"mpt"}  # ALiBi over cache slots, not positions: rollback holes change the output (ar only)


def uses_alibi(config) -> bool:
    """Whether a model's forward reads the 2D mask for its ALiBi biases (so takes no tree mask)."""
    return config.model_type in ALIBI_MODELS or getattr(config, "alibi", False) is True


def cache_keyword(model) -> str:
    """The name a model's forward takes its cache by: `cache` from transformers 5.24 on (where the
    old `past_key_values` warns at every call, and goes in 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def padded(prompts: list[list[int]], device, left: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """prompts -> ids, mask: [B, P], padded on the left (else the right) with id 0, never looked
    at: the mask rules."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, prompt in enumerate(prompts):
        at = slice(width - len(prompt), width) if left else slice(0, len(prompt))
        ids[b, at] = torch.tensor(prompt, dtype=torch.long)
        mask[b, at] = 1
    return ids.to(device), mask.to(device)


class BatchKV:
    maskless = True  # while dense, the model builds its own causal mask (decoder-only models read nothing back)

    def __init__(self, model, batch_size: int, device: torch.device):
        self.model = model
        self.last_id = model.get_input_embeddings().num_embeddings - 1  # wider ids go in as this one
        text_config = model.config.get_text_config(decoder=True)
        self.window = getattr(text_config, "sliding_window", None)  # how far sliding layers look back
        self.layer_types = getattr(text_config, "layer_types", None)  # None: every layer slides
        self.cache = self.new_cache()
        self.cache_keyword = cache_keyword(model)
        self.alibi = uses_alibi(model.config)
        self.mask = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # [B, L]
        self.dense = True  # host: the mask holds no 0 (no pad, no hole): slots are positions
        self.tree: tuple[int, torch.Tensor, int] | None = None  # the open tree: first slot, parents [B, T], depth

    def new_cache(self):
        return DynamicCache(config=self.model.config) if self.window is None else DynamicCache()

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def forward(self, input_ids: torch.Tensor, input_mask: torch.Tensor | None = None,
                logits_to_keep: int = 0) -> torch.Tensor:
        """Append S slots and return their logits.

        input_ids, input_mask: [B, S] (mask 0 = a slot no query will ever attend to; None: no 0)
        Returns logits [B, S, V] (or the last `logits_to_keep` positions).
        An id beyond the model's embeddings (a draft covering only part of the target's
        vocabulary) goes in as its last id: it only makes a draft's proposals worse.
        While the cache stays dense (a batch of one row, rows of one length decoded plainly),
        the model's own causal attention is ours: a maskless model gets no mask (cheaper).
        """
        self.dense = self.dense and input_mask is None
        input_mask = torch.ones_like(input_ids) if input_mask is None else input_mask
        self.mask = torch.cat([self.mask, input_mask], dim=1)  # [B, L+S]
        positions = (self.mask.cumsum(-1) - 1).clamp_(min=0)  # [B, L+S]
        seen = None if self.dense and self.maskless else self.causal(input_ids.shape[1])
        return self.run(input_ids.clamp(max=self.last_id), positions, seen, logits_to_keep)

    def causal(self, S: int) -> torch.Tensor:
        """[B, S, L]: the slots each of the last S attends to: its row's, up to itself."""
        slot = torch.arange(self.length, device=self.mask.device)  # [L]
        own = slot[None, :] == slot[-S:, None]  # [S, L]
        return self.mask.bool()[:, None, :] & (slot[None, :] <= slot[-S:, None]) | own  # [B, S, L]

    def forward_tree(self, input_ids: torch.Tensor, parents: torch.Tensor, depth: int) -> torch.Tensor:
        """Append S tree slots (ids [B, S]) and return their logits [B, S, V]. parents [B, S]: each
        slot's parent among the open tree's slots, counted from the tree's first (-1: below the
        past); depth: the deepest chain of parents in the tree so far (host). The first call opens
        the tree; take_tree closes it."""
        start, before, _ = self.tree or (self.length, parents[:, :0], 0)
        parents = torch.cat([before, parents], dim=1)  # [B, T]
        self.tree = (start, parents, depth)
        self.mask = torch.cat([self.mask, torch.ones_like(input_ids)], dim=1)  # [B, L+T]
        ancestors = tree_ancestors(parents, depth)  # [B, T, T]
        past = self.mask[:, :start]  # [B, L]
        level = ancestors.sum(-1) - 1  # [B, T]
        positions = torch.cat([(past.cumsum(-1) - 1).clamp(min=0), past.sum(-1, keepdim=True) + level], dim=1)
        S = input_ids.shape[1]
        seen = torch.cat([past.bool()[:, None, :].expand(-1, S, -1), ancestors[:, -S:]], dim=2)  # [B, S, L+T]
        return self.run(input_ids.clamp(max=self.last_id), positions, seen, 0)

    def take_tree(self, path: torch.Tensor) -> None:
        """Close the open tree, keeping the slots path [B, K] (tree slots, counted from its first)
        in that order: K slots whose keys and values are the path's. Then rollback cuts them to
        each row's own length."""
        if self.tree is None:  # no tree slot was appended
            return
        start, K = self.tree[0], path.shape[1]
        for layer in self.layers:
            index = path[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])  # [B, H, K, D]
            layer.keys[:, :, start : start + K] = layer.keys[:, :, start:].gather(2, index)
            layer.values[:, :, start : start + K] = layer.values[:, :, start:].gather(2, index)
        self.cache.crop(start + K - self.length)  # a negative count drops that many slots
        self.mask = self.mask[:, : start + K]
        self.tree = None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, seen: torch.Tensor,
            logits_to_keep: int) -> torch.Tensor:
        """The model's forward over the last S slots of the mask (ids [B, S]; positions [B, L]:
        every slot's; seen [B, S, L]: the slots each attends to, itself included; None: causal)."""
        with attention():
            out = self.model(
                input_ids=input_ids,
                attention_mask=self.mask if self.alibi else self.attention_masks(seen, positions),
                position_ids=positions[:, -input_ids.shape[1] :],
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **{self.cache_keyword: self.cache},
            )
        return out.logits

    def attention_masks(self, seen: torch.Tensor, positions: torch.Tensor):
        """Masks [B, 1, S, L] for the last S slots: "full_attention" sees every slot of `seen`
        ([B, S, L]: the row's earlier tokens, or a tree slot's ancestors), "sliding_attention"
        only those fewer than `window` positions back (positions [B, L]); one mask, or one per
        layer type when the model mixes them. A slot always sees itself, so a pad's or a hole's
        (unused) query is never left empty. Boolean (True = attend), or additive floats for
        eager attention, which adds its mask to the scores. seen None: None (the model's own)."""
        if seen is None:
            return None
        masks = {}
        if self.window is None or self.layer_types is not None:
            masks["full_attention"] = seen
        if self.window is not None:
            S = seen.shape[1]
            near = positions[:, None, :] > (positions[:, -S:] - self.window)[:, :, None]  # [B, S, L]
            masks["sliding_attention"] = seen & near
        masks = {k: self.additive(m[:, None]) for k, m in masks.items()}
        return masks if len(masks) > 1 else next(iter(masks.values()))

    def additive(self, mask: torch.Tensor) -> torch.Tensor:
        """A boolean mask (True = attend) as the model's attention takes it: as is, or as additive
        floats for eager attention, which adds its mask to the scores."""
        if self.model.config._attn_implementation != "eager":
            return mask
        return torch.zeros(mask.shape, dtype=self.model.dtype, device=mask.device).masked_fill_(
            ~mask, torch.finfo(self.model.dtype).min)

    def rollback(self, keep: torch.Tensor, appended: int, max_keep: int) -> None:
        """Of the last `appended` slots, row b keeps its first keep[b] ([B]); max_keep = keep.max().

        The cache is cut to the longest kept row; shorter rows' extra slots become holes.
        """
        self.dense = self.dense and (len(keep) == 1 or not max_keep)  # else a row may keep fewer
        self.cache.crop(max_keep - appended)  # a negative count drops that many slots
        self.mask = self.mask[:, : self.length - appended + max_keep]
        if max_keep:
            slot = torch.arange(max_keep, device=keep.device)  # [K]
            self.mask[:, -max_keep:] *= (slot[None, :] < keep[:, None]).long()

    @property
    def layers(self):
        """The cache layers whose slots the mask describes."""
        return self.cache.layers

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` ([B'] indices) in the cache and the mask: finished rows leave."""
        if self.length:  # else nothing is cached yet
            self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]

    def compact(self, new_length: int) -> None:
        """Drop pads and holes: move each row's valid slots, in order, to the right end, and keep
        the last new_length slots (host: at least the longest row's valid slots, at most the
        cache's length; the caller has it from the step's one sync).

        Keys already carry their rotary positions and positions come from the mask, so moving
        slots changes no logits; attention then runs over fewer columns.
        """
        if not self.length:  # nothing cached yet (a draft that has not run)
            return
        valid = self.mask.bool()  # [B, L]
        order = torch.sort(valid.int(), dim=-1, stable=True).indices[:, self.length - new_length :]  # [B, L']
        self.mask = self.mask.gather(1, order)
        for layer in self.layers:
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, index)
            layer.values = layer.values.gather(2, index)
