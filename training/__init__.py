"""Training (torch): built-in corpus, data reading, the Transformer, the training loop, evaluation and PyTorch reference decoding."""
