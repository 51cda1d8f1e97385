"""Models from elsewhere: Hugging Face GPT-2 / Llama directories and llama2.c checkpoints."""

from tinylm.interop.loading import HFTokenizerAdapter, export_hf, load_any_checkpoint, load_hf_dir

__all__ = ["HFTokenizerAdapter", "export_hf", "load_any_checkpoint", "load_hf_dir"]
