"""Ids every layer agrees on: the special tokens of tinylm's tokenizers and the ignored target.

The data layer writes them into token caches, the models and the loss read them, tokenizers
reserve them; keeping them here lets each layer import them without importing the others.
"""

SPECIAL_TOKENS = ("<pad>", "<unk>", "<sos>", "<eos>")  # ids 0, 1, 2, 3 in every tinylm tokenizer
PAD_ID, UNK_ID, SOS_ID, EOS_ID = range(4)

# Target positions holding this id add nothing to the loss (padding, already-scored tokens).
IGNORE_INDEX = -100
