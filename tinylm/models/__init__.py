"""Models: the GPT (gpt.py); classical baselines live beside it."""
from tinylm.models.gpt import GPT, KVCache

__all__ = ["GPT", "KVCache"]
