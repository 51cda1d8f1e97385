"""Generation: decoding knobs, sampling, the cached generate loop, beam search, streaming."""
from tinylm.generation.generate import (Generated, TextStream, TokenStream, generate, generate_many,
                                        stream_text)
from tinylm.generation.processors import GenerationConfig
from tinylm.generation.sampling import sample_next, select_next

__all__ = ["Generated", "GenerationConfig", "TextStream", "TokenStream", "generate", "generate_many",
           "sample_next", "select_next", "stream_text"]
