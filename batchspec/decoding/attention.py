"""The attention our forwards run: SDPA with kernels that take any shape, and grouped-query
layers that verify several positions without copying their cache.

transformers' SDPA attention repeats a grouped-query layer's keys and values for every query
head (repeat_kv) whenever a mask is given and more than one position is queried: a copy of the
layer's whole cache at every verify forward (a plain step's one query is packed per key-value
head instead). Profiled (torch.profiler) on a 12-layer Llama pair, 4 query heads over 2
key-value heads of 192, at 16 rows in bfloat16 on a 2-core CPU: the copies took 3 ms of an
80 ms gamma = 3 step over caches of about 90 slots and 10 ms of 101 ms over 240, and the
verify step's attention 9 and 21 ms, where a plain step's took 3 and 7: a verify step grew 7
times faster with its cache than a plain step. Here the S queries of each key-value head's
group attend together ([B, KV, groups * S, D] against the cache's [B, KV, L, D], the mask
repeated per group): the same scores from the same kernels, without the copies (that step:
72 and 86 ms).
"""

from contextlib import contextmanager

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# Attention kernels that take any shape as it comes. Not cuDNN's, which PyTorch tries first on Hopper
# and newer GPUs: it builds an execution plan for every new shape (batch, query and key lengths), a
# host stall of milliseconds, and a decode step's key length is new at every step.
ANY_SHAPE_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def grouped_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention (query [B, H, S, D], key and value [B, KV, L, D], the mask
    [B, 1, S or 1, L]; returns [B, S, H, D]), the S > 1 queries of a grouped-query layer packed
    per key-value head where the mask repeated per group is smaller than the keys and values
    repeated per head (a verify's few positions; not a long prompt's prefill). Anything else
    (one query, no mask, a mask per head, position biases) goes to transformers' own."""
    batch, heads, length, dim = query.shape
    groups, mask = heads // key.shape[1], attention_mask
    if (groups == 1 or length == 1 or heads != groups * key.shape[1] or mask is None or mask.ndim != 4
            or mask.shape[1] != 1 or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or mask.shape[2] > 1 and length * mask.element_size() >= 2 * key.shape[1] * dim * key.element_size()):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    packed = query.reshape(batch, key.shape[1], groups * length, dim)  # head kv * groups + g's query s at g * S + s
    mask = mask if mask.shape[2] == 1 else mask.repeat(1, 1, groups, 1)  # [B, 1, groups * S, L]
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)  # [B, KV, groups * S, Dv]
    return out.reshape(batch, heads, length, value.shape[-1]).transpose(1, 2).contiguous(), None


@contextmanager
def attention():
    """Our forwards' attention: kernels that take any shape, and SDPA as grouped_sdpa (only
    inside, so that a model run elsewhere in the process keeps transformers' own)."""
    before = ALL_ATTENTION_FUNCTIONS._local_mapping.get("sdpa")
    ALL_ATTENTION_FUNCTIONS["sdpa"] = grouped_sdpa
    try:
        with sdpa_kernel(ANY_SHAPE_ATTENTION):
            yield
    finally:
        if before is None:
            del ALL_ATTENTION_FUNCTIONS["sdpa"]
        else:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = before
