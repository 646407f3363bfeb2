"""duoserve: an LLM serving engine built around prefill/decode disaggregation."""

__version__ = "0.1.0"
