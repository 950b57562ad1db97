"""Torch-free: the bundle reader, OnnxTranslator (prefill → BatchState, decode_one_token), the decoder
batch state and where its tensors live (host or device)."""
