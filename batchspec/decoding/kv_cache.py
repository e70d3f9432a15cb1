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

StaticKV keeps the same slots in buffers allocated once per batch (decoding/compiled.py): a
forward writes at the write offset, rollback moves the offset back and holes stay in the mask,
and every forward attends over the whole buffer, the unwritten slots masked: shapes a compiled
forward can replay.
"""

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, StaticLayer

from batchspec.decoding.attention import attention
from batchspec.decoding.compiled import Compiled
from batchspec.decoding.tree import tree_ancestors

OFFSET_LAYERS = hasattr(StaticLayer(1), "cumulative_length")  # transformers' static layers keep a write offset
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
            out = self.forward_of(input_ids.shape[1])(
                input_ids=input_ids,
                attention_mask=self.mask if self.alibi else self.attention_masks(seen, positions),
                position_ids=positions[:, -input_ids.shape[1] :],
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **{self.cache_keyword: self.cache},
            )
        return out.logits

    def forward_of(self, S: int):
        """The forward that appends S slots: the model's own (StaticKV: maybe a compiled one)."""
        return self.model

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
        masks = {k: self.additive(self.widened(m)[:, None]) for k, m in masks.items()}
        return masks if len(masks) > 1 else next(iter(masks.values()))

    def widened(self, seen: torch.Tensor) -> torch.Tensor:
        """seen [B, S, L] as wide as the keys the layers attend over (here: the cache's L)."""
        return seen

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
        self.keep_slots(order)

    def keep_slots(self, order: torch.Tensor) -> None:
        """Each row's cache slots order [B, L'] (indices into its L), in that order."""
        for layer in self.layers:
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, index)
            layer.values = layer.values.gather(2, index)


@dataclass(frozen=True)
class Static:
    """A batch's static caches: `capacity` slots each to start with, and the run's compiled
    forwards (decoding/compiled.py; None: eager)."""

    capacity: int
    compiled: Compiled | None = None


def power_of_two(n: int) -> int:
    """The least power of two >= n: buffer rows for n live rows, and (from 64) buffer slots, so
    that a batch meets few shapes to compile."""
    return 1 << (n - 1).bit_length()


def bucket(slots: int) -> int:
    """A static buffer's length for `slots`."""
    return max(64, power_of_two(slots))


def fixed_addresses(layer: StaticLayer) -> None:
    """Tell torch.compile a layer's new buffers stay where they are (replayed CUDA graphs write to them)."""
    torch._dynamo.mark_static_address(layer.keys)
    torch._dynamo.mark_static_address(layer.values)


class StaticKV(BatchKV):
    """BatchKV over buffers [R, H, C, D] per layer: C = `capacity` slots, R rows, none moved as
    the cache grows. The mask stays [B, L] over the live rows' written slots; each forward's
    attention mask is widened to C with the unwritten slots unseen. Rollback moves the write
    offset (the layers' cumulative_length) back; compaction rewrites the buffers' front in place;
    a forward that would overrun C first moves the cache to buffers of the next bucket.

    Rows that leave stay in the buffers, inert (their forwards run on, their outputs unread),
    until the live rows fit a power of two rows fewer: then the buffers shrink to that. So a
    batch meets few shapes (R, S, C), and decode-sized forwards (S <= `compiled.slots`) may run
    compiled (compiled.forward)."""

    maskless = False  # the model's own causal mask would span unwritten slots

    def __init__(self, model, batch_size: int, device: torch.device, capacity: int, compiled: Compiled | None = None):
        self.capacity = bucket(capacity)
        self.compiled = compiled
        self.buffer_rows = batch_size  # R
        self.rows: torch.Tensor | None = None  # [B]: each live row's buffer row (None: row b is buffer row b)
        super().__init__(model, batch_size, device)

    def new_cache(self):
        layers = self.model.config.get_text_config(decoder=True).num_hidden_layers
        return Cache(layers=[StaticLayer(self.capacity) for _ in range(layers)])

    def forward_of(self, S: int):
        compiled = self.compiled and self.compiled.forward(self.model, (self.buffer_rows, S, self.capacity))
        return compiled or self.model

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, seen: torch.Tensor,
            logits_to_keep: int) -> torch.Tensor:
        if self.length > self.capacity:  # the mask already holds this forward's slots
            self.grow(bucket(self.length))
        if self.rows is None:
            return super().run(input_ids, positions, seen, logits_to_keep)
        S, L = seen.shape[1:]
        own = torch.arange(L, device=seen.device)[None, :] == torch.arange(L - S, L, device=seen.device)[:, None]
        logits = super().run(self.buffered(input_ids, 0), self.buffered(positions, 0),
                             self.buffered(seen, own), logits_to_keep)  # [R, S, V]
        return logits[self.rows]  # [B, S, V]

    def buffered(self, live: torch.Tensor, inert) -> torch.Tensor:
        """live [B, ...] -> [R, ...]: each live row at its buffer row, `inert` in the others."""
        rows = torch.as_tensor(inert, dtype=live.dtype, device=live.device).expand(self.buffer_rows, *live.shape[1:])
        return rows.clone().index_copy_(0, self.rows, live)

    def widened(self, seen: torch.Tensor) -> torch.Tensor:
        """[R, S, C]: the buffers' unwritten slots unseen."""
        return torch.nn.functional.pad(seen, (0, self.capacity - seen.shape[-1]))

    def grow(self, capacity: int) -> None:
        """Move the written slots to buffers of `capacity` slots (the write offset unchanged)."""
        for layer in self.layers:
            if layer.is_initialized:
                keys, values = layer.keys, layer.values
                layer.keys = keys.new_zeros(*keys.shape[:2], capacity, keys.shape[-1])
                layer.values = values.new_zeros(*values.shape[:2], capacity, values.shape[-1])
                layer.keys[:, :, : keys.shape[2]] = keys
                layer.values[:, :, : values.shape[2]] = values
                fixed_addresses(layer)
            layer.max_cache_len = capacity
        self.capacity = capacity

    def select(self, rows: torch.Tensor) -> None:
        """Keep the live rows `rows` ([B'] indices of the live rows; the prefill's may repeat one):
        the others turn inert, or the buffers are rebuilt with R = B' (more rows than the buffers
        hold: a shared prefill's copies) or R = B' rounded up to a power of two (fewer)."""
        self.mask = self.mask[rows]
        rows = rows if self.rows is None else self.rows[rows]  # [B']: their buffer rows
        B = len(rows)
        R = B if B > self.buffer_rows else power_of_two(B)
        if R == self.buffer_rows:
            self.rows = rows
            return
        kept = torch.cat([rows, rows[:1].expand(R - B)])  # [R]: the live rows, then copies of one, inert
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys, layer.values = layer.keys[kept], layer.values[kept]
                fixed_addresses(layer)
        self.buffer_rows = R
        self.rows = None if R == B else torch.arange(B, device=rows.device)

    def take_tree(self, path: torch.Tensor) -> None:
        if self.rows is not None and self.tree is not None:
            path = self.buffered(path, torch.arange(path.shape[1], device=path.device))  # [R, K]
        super().take_tree(path)

    def keep_slots(self, order: torch.Tensor) -> None:
        """In place, at the buffers' front; the write offset moves to its end."""
        if self.rows is not None:
            order = self.buffered(order, torch.arange(order.shape[1], device=order.device))  # [R, L']
        for layer in self.layers:
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys[:, :, : order.shape[1]] = layer.keys.gather(2, index)
            layer.values[:, :, : order.shape[1]] = layer.values.gather(2, index)
            layer.cumulative_length.fill_(order.shape[1])
