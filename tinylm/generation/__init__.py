"""Generation: sampling and the generate loop."""
from tinylm.generation.generate import generate, sample_next

__all__ = ["generate", "sample_next"]
