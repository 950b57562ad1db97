"""The ranker graph: beam search's one ranking, written into every bundle (ranker.onnx) and run by every decoding
loop (export/runtime/ranker.py: the portable loop through ONNX Runtime's Python API, the kernel library's loop
through its C API), so that which extensions a beam keeps is decided in one place.

Inputs, for n searches of one beam size k whose rows each bring w candidates (the decoder's search head: each row's
w best tokens, best first, ties by lower id):
- beam (n, k) float64: each row's cumulative log-probability (-inf: a row not started yet);
- ids (n, k, w) int64 and scores (n, k, w) float32: each row's candidates and their log-probabilities;
- eos () int64: the model's end-of-sentence id.
Outputs, each search's w best extensions (beam + score, added in float64), best first, ties by the lower row and
then the row's better candidate (TopK's rule: the lower index first):
- rows (n, w) int64, the row each extends (0 … k-1, within the search); tokens (n, w) int64; totals (n, w) float64;
- ended (n,) bool: whether an eos is among the search's k best extensions, which makes the step one that
  BeamSearch.select takes (a hypothesis finishes), not an ordinary one (BeamSearch.ordinary).
"""

from __future__ import annotations

from pathlib import Path

from onnx import TensorProto, checker, helper, save_model

OPSET = 17
RANKER = "ranker.onnx"


def write_ranker(out: Path) -> str:
    """The ranker graph into out/ranker.onnx -> its file name, relative to out."""
    save_model(ranker_graph(), str(out / RANKER))
    return RANKER


def ranker_graph():
    double, int64 = TensorProto.DOUBLE, TensorProto.INT64
    const = [helper.make_node("Constant", [], [name], value=helper.make_tensor(name, int64, [len(v)], v))
             for name, v in (("last", [2]), ("flat", [0, -1]), ("from", [2]), ("to", [3]), ("start", [0]),
                             ("one", [1]))]
    nodes = const + [
        helper.make_node("Cast", ["scores"], ["scores64"], to=double),
        helper.make_node("Unsqueeze", ["beam", "last"], ["beam3"]),
        helper.make_node("Add", ["beam3", "scores64"], ["total"]),  # (n, k, w)
        helper.make_node("Reshape", ["total", "flat"], ["total_flat"]),  # (n, k·w), row by row
        helper.make_node("Reshape", ["ids", "flat"], ["ids_flat"]),
        helper.make_node("Shape", ["scores"], ["shape"]),
        helper.make_node("Slice", ["shape", "from", "to"], ["w"]),
        helper.make_node("TopK", ["total_flat", "w"], ["totals", "best"], axis=1, largest=1, sorted=1),
        helper.make_node("Div", ["best", "w"], ["rows"]),
        helper.make_node("GatherElements", ["ids_flat", "best"], ["tokens"], axis=1),
        helper.make_node("Shape", ["beam"], ["beam_shape"]),
        helper.make_node("Slice", ["beam_shape", "one", "from"], ["k"]),
        helper.make_node("Slice", ["tokens", "start", "k", "one"], ["kept"]),  # (n, k): the k best
        helper.make_node("Equal", ["kept", "eos"], ["eos_kept"]),
        helper.make_node("Cast", ["eos_kept"], ["eos_kept32"], to=TensorProto.INT32),
        helper.make_node("ReduceMax", ["eos_kept32"], ["ended32"], axes=[1], keepdims=0),
        helper.make_node("Cast", ["ended32"], ["ended"], to=TensorProto.BOOL),
    ]
    graph = helper.make_graph(
        nodes, "ranker",
        [helper.make_tensor_value_info("beam", double, ["n", "k"]),
         helper.make_tensor_value_info("ids", int64, ["n", "k", "w"]),
         helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["n", "k", "w"]),
         helper.make_tensor_value_info("eos", int64, [])],
        [helper.make_tensor_value_info(name, t, ["n", "w"])
         for name, t in (("rows", int64), ("tokens", int64), ("totals", double))]
        + [helper.make_tensor_value_info("ended", TensorProto.BOOL, ["n"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)
    checker.check_model(model)
    return model
