"""Precision variants of the fp32 graphs, and the node counts that show ORT's fusions.

- fp32: CPU (the decoder step's GroupQueryAttention has fp16/bf16 CUDA kernels only).
- int8: dynamic quantisation of MatMul weights (onnxruntime.quantization), for CPU.
- fp16: for CUDA. LayerNormalization, Softmax, LogSoftmax and the logits MatMul stay in fp32
  (fp16 decoders that do not NaN or repeat tokens: onnxruntime #15752, optimum #2068); K/V
  inputs and outputs are fp16 to halve cache traffic; log_probs stays fp32.
"""

from __future__ import annotations

import collections
import logging
import tempfile
from pathlib import Path

import onnx

from nmtserve.export.build.kernel_graphs import set_nodes

VARIANTS = {
    "fp32": {"devices": ["cpu"], "kv_dtype": "float32"},
    "int8": {"devices": ["cpu"], "kv_dtype": "float32"},
    "fp16": {"devices": ["cuda"], "kv_dtype": "float16"},
}
FP16_KEEP_FP32_OPS = ["LayerNormalization", "Softmax", "LogSoftmax"]
LARGEST_PROTO = (2 << 30) - (64 << 20)  # a graph this large is written with its weights apart (protobuf's 2 GB)


def quantize_int8(src: Path, dst: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:
        unfused, model = Path(tmp) / "matmul.onnx", gemm_as_matmul(onnx.load(str(src)))
        # protobuf serialises at most 2 GB (ByteSize itself refuses past it): the weights then in a file beside
        large = sum(len(t.raw_data) for t in model.graph.initializer) > LARGEST_PROTO
        onnx.save(model, str(unfused), save_as_external_data=large, location="matmul.onnx.data")
        del model
        # MatMul only: the embedding Gather stays fp32, so int8 costs accuracy in the matmuls alone. Its advice to
        # pre-process the graph (shape inference, for static quantisation's calibration) does not apply here
        def advice(record: logging.LogRecord) -> bool:
            return "pre-processing before quantization" not in record.getMessage()
        logging.getLogger().addFilter(advice)
        try:
            quantize_dynamic(str(unfused), str(dst), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
                             use_external_data_format=large)
        finally:
            logging.getLogger().removeFilter(advice)


def gemm_as_matmul(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each Gemm over a weight initializer (a Linear on (B, D) rows, as the decoder step exports) as
    MatMul then Add: dynamic quantisation quantises MatMul, not Gemm."""
    from onnx import helper, numpy_helper

    weights = {t.name: t for t in model.graph.initializer}
    nodes = []
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type != "Gemm" or node.input[1] not in weights or attrs.get("transA", 0) \
                or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            nodes.append(node)
            continue
        weight = node.input[1]
        if attrs.get("transB", 0):  # a transposed copy: the same initializer may feed others (the tied embedding)
            transposed = numpy_helper.to_array(weights[weight]).T.copy()
            weight = weight + "_transposed"
            model.graph.initializer.append(numpy_helper.from_array(transposed, weight))
        product = node.output[0] + "_matmul" if len(node.input) > 2 else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], weight], [product], name=node.name + "_matmul"))
        if len(node.input) > 2:
            nodes.append(helper.make_node("Add", [product, node.input[2]], list(node.output), name=node.name + "_bias"))
    set_nodes(model, nodes)
    used = {name for node in nodes for name in node.input}
    kept = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return model


def _logits_nodes(model: onnx.ModelProto) -> list[str]:
    """The MatMul or Gemm that produces the logits (the input of LogSoftmax), and anything between."""
    producers = {out: node for node in model.graph.node for out in node.output}
    names = []
    for node in model.graph.node:
        if node.op_type == "LogSoftmax":
            current = producers.get(node.input[0])
            while current is not None and current.op_type not in ("MatMul", "Gemm"):
                names.append(current.name)
                current = producers.get(current.input[0])
            if current is not None:
                names.append(current.name)
    return names


def convert_fp16(src: Path, dst: Path) -> None:
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    model = onnx.load(str(src))
    float_io = [v.name for v in list(model.graph.input) + list(model.graph.output)
                if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT]
    keep_fp32_io = [name for name in float_io if name == "log_probs"]
    converted = convert_float_to_float16(model, keep_io_types=keep_fp32_io, op_block_list=DEFAULT_OP_BLOCK_LIST + FP16_KEEP_FP32_OPS,
                                         node_block_list=_logits_nodes(model))
    # the converter appends its Cast nodes at the end; onnx.checker wants topological order
    from onnxruntime.transformers.onnx_model import OnnxModel

    wrapper = OnnxModel(converted)
    wrapper.topological_sort()
    onnx.save(wrapper.model, str(dst))


def write_variant(name: str, fp32_path: Path, dst: Path) -> None:
    if name == "int8":
        quantize_int8(fp32_path, dst)
    elif name == "fp16":
        convert_fp16(fp32_path, dst)
    else:
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(collections.Counter(n.op_type for n in model.graph.node).items()))


def optimized_op_counts(path: Path, disabled_optimizers: list[str] | None = None) -> dict[str, int]:
    """Node counts after ONNX Runtime's CPU graph optimisations (what a session really runs: by default
    without the optimisations that OnnxTranslator's CPU sessions leave out)."""
    import onnxruntime as ort

    from nmtserve.export.runtime.sessions import CPU_DISABLED_OPTIMIZERS

    if disabled_optimizers is None:
        disabled_optimizers = CPU_DISABLED_OPTIMIZERS
    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        so.log_severity_level = 3
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"], disabled_optimizers=disabled_optimizers)
        return op_counts(onnx.load(so.optimized_model_filepath, load_external_data=False))


def fusion_report(path: Path) -> dict:
    """Op counts before and after ORT optimisation, with the totals."""
    before = op_counts(onnx.load(str(path)))
    after = optimized_op_counts(path)
    return {"nodes_before": sum(before.values()), "nodes_after": sum(after.values()),
            "ops_before": before, "ops_after": after}
