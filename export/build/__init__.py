"""Build time (torch): the ONNX graphs, the exporter and manifest writer, precision variants,
verification against PyTorch, and the CTranslate2 converter."""
