"""nmtserve: train, export and serve an encoder-decoder Transformer for translation."""

__version__ = "0.1.0"
