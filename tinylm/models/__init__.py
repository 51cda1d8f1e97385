"""Models: the GPT (gpt.py), the classical baselines beside it, embeddings and checkpoint files."""

from tinylm.models.checkpoint import load_checkpoint, save_checkpoint
from tinylm.models.gpt import GPT, KVCache

__all__ = ["GPT", "KVCache", "load_checkpoint", "save_checkpoint"]
