"""Checkpoint → ONNX bundle. `runtime` reads bundles and decodes with ONNX Runtime (torch-free, what the
server uses); `build` writes them from a PyTorch checkpoint (graphs, variants, verification, converters)."""
