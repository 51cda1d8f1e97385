"""One exception type for every user mistake tinylm can name.

The CLI turns a ``TinyLMError`` into a one-line message and exit code 2; anything else is a bug
and keeps its traceback.
"""


class TinyLMError(Exception):
    """A problem with the user's input (file, config, checkpoint, prompt) that the message names."""
