"""vlmspec: lossless speculative decoding for Hugging Face vision-language models.

    from vlmspec import LLM          # the Python API in one class (vlmspec/llm.py)

`LLM` is imported on first use, so `import vlmspec.anything` stays as light as that module.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "Output", "Request"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from vlmspec import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'vlmspec' has no attribute {name!r}")
