"""taogate: one OpenAI-compatible endpoint and one key in front of a fleet of vLLM servers."""

__version__ = "0.1.0"

__all__ = ["__version__"]
