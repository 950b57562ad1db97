"""checkpoint → ONNX bundle (encoder, decoder step, tokenizer, manifest). Arrives with the export issue."""
