"""Pure tensor code: one static batch of token ids in, per-row token ids and statistics out."""

from batchspec.decoding.engine import BatchOutput, DecodeConfig, RowOutput, decode_batch
from batchspec.decoding.options import RowOptions
from batchspec.decoding.sampling import SamplingParams, resolve_sampling

__all__ = ["BatchOutput", "DecodeConfig", "RowOptions", "RowOutput", "SamplingParams", "decode_batch",
           "resolve_sampling"]
