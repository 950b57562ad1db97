"""The one-node graphs that DeviceTensors (export/runtime/tensors.py) runs on a device to zero, pad, join, take,
slice and scatter the running batch's K/V there, written into the bundle for each element type its variants'
caches use: the runtime builds no graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, checker, helper, save_model

OPSET = 17
OPS = ("zeros", "pad", "concat", "take", "slice", "scatter_rows")


def write_tensor_ops(out: Path, dtype: str) -> dict[str, str]:
    """Each op's graph over `dtype` (a numpy name: float32, float16) in out/ops -> {op: file, relative to out}."""
    (out / "ops").mkdir(exist_ok=True)
    files = {}
    for op in OPS:
        files[op] = f"ops/{op}.{dtype}.onnx"
        save_model(_op_graph(op, helper.np_dtype_to_tensor_dtype(np.dtype(dtype))), str(out / files[op]))
    return files


RANK5 = [f"d{i}" for i in range(5)]  # every device tensor is (L, B, H, T|S, Dh)


def _graph(name: str, nodes: list, inputs: list, output_type: int):
    model = helper.make_model(
        helper.make_graph(nodes, name, inputs, [helper.make_tensor_value_info("y", output_type, RANK5)]),
        opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)  # IR 8 = opset 17: any onnxruntime >= 1.14 loads it
    checker.check_model(model)
    return model


def _op_graph(op: str, elem: int):
    """The one-purpose graph `op` over tensors of ONNX element type `elem`, output y."""
    x, u, i64 = (helper.make_tensor_value_info(n, t, shape) for n, t, shape in
                 (("x", elem, RANK5), ("u", elem, RANK5), ("i", TensorProto.INT64, ["n"])))
    if op == "zeros":  # i: the shape
        return _graph(op, [helper.make_node("ConstantOfShape", ["i"], ["y"], value=helper.make_tensor("v", elem, [1], [0]))],
                      [i64], elem)
    if op == "pad":  # i: the ONNX pads (begins, then ends)
        return _graph(op, [helper.make_node("Pad", ["x", "i"], ["y"])], [x, i64], elem)
    if op == "concat":
        return _graph(op, [helper.make_node("Concat", ["x", "x2"], ["y"], axis=1)],
                      [x, helper.make_tensor_value_info("x2", elem, RANK5)], elem)
    if op == "take":  # i: row indices along axis 1
        return _graph(op, [helper.make_node("Gather", ["x", "i"], ["y"], axis=1)], [x, i64], elem)
    if op == "slice":  # start, stop, axis: one-element host tensors
        return _graph(op, [helper.make_node("Slice", ["x", "start", "stop", "axis"], ["y"])],
                      [x] + [helper.make_tensor_value_info(n, TensorProto.INT64, [1]) for n in ("start", "stop", "axis")],
                      elem)
    if op == "scatter_rows":  # r: (1, n, 1, 1, 1) row indices; u: (L, n, …) the rows' new values
        return _graph(op, [helper.make_node("Shape", ["u"], ["shape"]),
                           helper.make_node("Expand", ["r", "shape"], ["index"]),
                           helper.make_node("ScatterElements", ["x", "index", "u"], ["y"], axis=1)],
                      [x, helper.make_tensor_value_info("r", TensorProto.INT64, RANK5), u], elem)
    raise ValueError(op)


