"""Generation: decoding knobs, sampling, the cached generate loop, beam search, streaming."""

from tinylm.config import GenerationConfig
from tinylm.generation.core import Generated
from tinylm.generation.generate import TextStream, TokenStream, generate, generate_many
from tinylm.generation.sampling import select_next

__all__ = ["Generated", "GenerationConfig", "TextStream", "TokenStream", "generate", "generate_many", "select_next"]
