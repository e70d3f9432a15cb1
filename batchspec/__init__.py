"""batchspec: offline batched speculative decoding, exactly the target's output, only sooner."""

__version__ = "0.1.0"
