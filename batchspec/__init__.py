"""batchspec: offline batched speculative decoding, exactly the target's output, only sooner."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`from batchspec import Generator` without loading torch for the command line's sake."""
    if name == "Generator":
        from batchspec.api import Generator

        return Generator
    raise AttributeError(f"module 'batchspec' has no attribute {name!r}")
