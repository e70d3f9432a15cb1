"""Will a batch fit: its caches and a step's logits, estimated before it starts, against the
device's free memory. A batch that would not fit is split (Generator.fitting), not crashed
hours in: --batch-size 256 on a GPU that holds 100 such rows runs as batches of 64 and 32."""

import os

import torch

HEADROOM = 0.8  # of the free memory a batch may plan to take (activations, allocator slack)
LOGIT_COPIES = 3  # a verify's logits: raw, processed, probabilities (float32)


def cache_bytes(model, rows: int, slots: int) -> int:
    """Keys and values of `slots` positions for `rows` rows in every layer (a static cache's
    buffers; a dynamic cache at its longest). Models whose config names no key-value heads
    count one per attention head: an estimate from above."""
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * rows * kv_heads * slots * head_dim * model.dtype.itemsize


def batch_bytes(models: list, rows: int, prompt: int, max_new: int, step_slots: int, vocab: int) -> int:
    """A batch's caches in every model (prompt + max_new + one step's slots each) and one
    verify's logits."""
    slots = prompt + max_new + step_slots
    return sum(cache_bytes(m, rows, slots) for m in models) + LOGIT_COPIES * rows * step_slots * vocab * 4


def free_bytes(device: torch.device) -> int:
    """Memory a batch may still take on `device`: the GPU's free memory, or the host's available."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            available = next(line for line in meminfo if line.startswith("MemAvailable:"))
        return int(available.split()[1]) * 1024
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
