"""duoserve: an LLM serving engine built around prefill/decode disaggregation."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from duoserve.entrypoints.llm import LLM
    from duoserve.sampling_params import LoRARequest, SamplingParams


def __getattr__(name: str):
    # Lazy: `import duoserve` must stay cheap for engine processes and the CLI.
    if name == "LLM":
        from duoserve.entrypoints.llm import LLM

        return LLM
    if name in ("SamplingParams", "LoRARequest"):
        from duoserve import sampling_params

        return getattr(sampling_params, name)
    raise AttributeError(f"module 'duoserve' has no attribute {name!r}")
