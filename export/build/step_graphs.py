"""The graphs a bundle variant serves, prepared at export time: the runtime loads them as they are.

From a variant's encoder and decoder-step graphs (export/build/graphs.py, then variants.py's precision) this
writes, for each variant:
- `encoder`: as exported;
- `decoder`: the step with its search head (`with_search_head`) and greedy's stopping rule (`with_stop_rule`),
  each row with its own cross K/V (the server's running batch, whose rows have different widths);
- `decoder_shared`: the same reading each source's one copy of its cross K/V for all its rows
  (`with_shared_cross`: offline batches, where a beam's rows share a source);
- the decoders' output projection, where it is the embedding table a lookup reads too, on a copy of its own
  (`with_own_projection`);
- on CPU variants, `encoder_kernels`, `decoder_kernels` and `decoder_shared_kernels`: the same on nmtserve's
  custom ops (kernel_graphs.py), which need the kernel library where they run;
Their large initializers live once each in the bundle's one weights file (`WeightStore`, ONNX external data,
page-aligned): the graphs of a variant, and the variants, share the same bytes on disk, and ONNX Runtime maps
the file, so that sessions over graphs holding the same tensor (the encoder's and the decoder's tied embedding)
read one copy of it.
"""

from __future__ import annotations

import copy
import hashlib
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.external_data_helper import set_external_data

from nmtserve.export.build import kernel_graphs

WEIGHTS = "weights.bin"
ALIGNER = "aligner.onnx"  # the aligner graph (graphs.py), one for every variant: fp32
EXTERNAL_MIN_BYTES = 1 << 10  # smaller initializers stay in their graph
ALIGNMENT = 1 << 16  # each tensor starts at a multiple of the largest page size a loader maps in one piece
PROJECTION = ".projection"  # the name's end of an output projection's own copy of the embedding table


def file_name(graph: str, variant: str) -> str:
    return f"{graph}.onnx" if variant == "fp32" else f"{graph}.{variant}.onnx"


def prepare_variant(exported: Path, out: Path, variant: str, heads: int, dim: int, eos: int, kernels: bool,
                    weights: WeightStore) -> dict:
    """Write the variant's graphs into `out`, from its exported encoder and decoder in `exported` (the decoder as
    the served step), their large initializers into `weights` -> {name: file}, the manifest's `graphs` of the
    variant."""
    encoder = kernel_graphs.sort_nodes(onnx.load(str(exported / file_name("encoder", variant))))
    decoder = with_stop_rule(with_search_head(with_own_projection(
        kernel_graphs.sort_nodes(onnx.load(str(exported / file_name("decoder", variant)))))), eos)
    models = {"encoder": encoder, "decoder": decoder,
              "decoder_shared": with_shared_cross(copy.deepcopy(decoder), heads, dim)}
    if kernels:
        quantised = any(n.op_type == "DynamicQuantizeLinear" for n in decoder.graph.node)
        row_scales = kernel_graphs.with_row_quantize if quantised else (lambda model: model)
        models["encoder_kernels"] = row_scales(kernel_graphs.with_packed_attention(copy.deepcopy(encoder)))
        for name in ("decoder", "decoder_shared"):
            models[f"{name}_kernels"] = row_scales(
                kernel_graphs.with_custom_kernels(copy.deepcopy(models[name]), beam_origin=True))
    graphs = {}
    for name, model in models.items():
        graphs[name] = file_name(name, variant)
        weights.externalize(model)
        onnx.save(model, str(out / graphs[name]))
    return graphs


class WeightStore:
    """One file of a bundle's large initializers, each distinct tensor once, page-aligned; the graphs point into
    it (ONNX external data, `location` relative to the graph's folder)."""

    def __init__(self, path: Path):
        self.path, self.offsets = path, {}
        self.file = open(path, "wb")

    def externalize(self, model: onnx.ModelProto) -> None:
        """Move the model's initializers of at least EXTERNAL_MIN_BYTES into the file (in place), the tensors
        already there pointing at their earlier copy."""
        for tensor in model.graph.initializer:
            if not tensor.HasField("raw_data") or len(tensor.raw_data) < EXTERNAL_MIN_BYTES:
                continue
            data = tensor.raw_data
            # an output projection's copy stays apart from the table it copies (with_own_projection)
            key = hashlib.sha256(data).digest() + (tensor.name.encode() if tensor.name.endswith(PROJECTION) else b"")
            if key not in self.offsets:
                self.file.write(b"\0" * (-self.file.tell() % ALIGNMENT))
                self.offsets[key] = self.file.tell()
                self.file.write(data)
            set_external_data(tensor, self.path.name, self.offsets[key], len(data))
            tensor.ClearField("raw_data")

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


def with_own_projection(model: onnx.ModelProto) -> onnx.ModelProto:
    """The decoder-step graph (changed in place) with each Gemm whose weight another node reads too (the tied
    output projection over the embedding that the lookup reads) on a copy of that weight of its own. ONNX Runtime
    packs a Gemm's constant weight and frees the original once no other node needs it: on the shared table, the
    packing would read every page of the mapped original, which then stays resident beside the packed copy for the
    lookup's sake, where the lookup alone touches only the rows it reads."""
    initializers = {t.name: t for t in model.graph.initializer}
    readers = Counter(name for node in model.graph.node for name in node.input)
    for node in model.graph.node:
        weight = node.input[1] if node.op_type == "Gemm" else None
        if weight in initializers and readers[weight] > 1:
            own = onnx.TensorProto()
            own.CopyFrom(initializers[weight])
            own.name = weight + PROJECTION
            model.graph.initializer.append(own)
            node.input[1] = own.name
    return model


def with_search_head(model: onnx.ModelProto) -> onnx.ModelProto:
    """The decoder-step graph (changed in place) with a search head in place of its log_probs output:
    inputs `candidates` (1,) int64 = K and `with_scores` () bool, outputs candidate_ids (B, K) int64 and
    candidate_scores (B, K): each row's K best tokens, best first (ties: lower id first, as ArgMax). Greedy
    search asks for 1, beam search for 2 × beam, so only these cross to the host. With with_scores the
    scores are the tokens' log-probabilities; without, an If skips the log-softmax over the vocabulary and
    gives each row's one best token by the values before it (ArgMax: K must be 1; the same token up to
    rounding ties; its score is then that value), as CTranslate2's greedy search does when return_scores
    is off (the log-softmax is a pass over the vocabulary of every row). log_probs leaves the outputs, since ONNX Runtime runs every node of
    the graph whatever outputs a run asks for; `Decoder.step` rebuilds it from the K = V best.
    Input `whole_rows` (R,) int64 and output whole_logits (R, V): those rows' logits over the whole vocabulary
    (the values before the log-softmax, in either branch), for the rows whose search ranks the vocabulary itself
    (a sampler without top-k, disabled tokens, a repetition penalty, which CTranslate2 applies to the logits)
    among rows that need K: the step then ranks K per row, not the vocabulary of every row."""
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    chain = [producer["log_probs"]]  # LogSoftmax, then perhaps an Add of the suppressed ids' -inf
    while chain[0].op_type != "LogSoftmax":
        chain.insert(0, producer[next(name for name in chain[0].input if name in producer)])
    for node in chain:
        graph.node.remove(node)

    def branch(name: str, softmax: bool) -> onnx.GraphProto:
        rename = {out: f"{out}_{name}" for node in chain for out in node.output}
        if not softmax:  # the log-softmax's readers read its input
            rename[chain[0].output[0]] = chain[0].input[0]
        nodes = []
        for node in chain[0 if softmax else 1:]:
            node = copy.deepcopy(node)
            node.input[:] = [rename.get(i, i) for i in node.input]
            node.output[:] = [rename[o] for o in node.output]
            node.name = ""
            nodes.append(node)
        outputs = [f"candidate_scores_{name}", f"candidate_ids_{name}", f"whole_logits_{name}"]
        if softmax:
            nodes.append(helper.make_node("TopK", [rename["log_probs"], "candidates"], outputs[:2], axis=-1, largest=1,
                                          sorted=1))
        else:  # greedy's one best: ArgMax is cheaper than TopK at K = 1
            nodes += [helper.make_node("ArgMax", [rename["log_probs"]], [outputs[1]], axis=-1, keepdims=1),
                      helper.make_node("GatherElements", [rename["log_probs"], outputs[1]], [outputs[0]], axis=-1)]
        # the whole rows' logits, whichever branch: gathered before the log-softmax, then what follows it (an Add
        # of the suppressed ids' -inf) on those rows alone
        whole = f"whole_{name}" if len(chain) > 1 else outputs[2]
        nodes.append(helper.make_node("Gather", [chain[0].input[0], "whole_rows"], [whole], axis=0))
        for i, node in enumerate(chain[1:], 1):
            node = copy.deepcopy(node)
            node.input[:] = [whole if n == chain[i - 1].output[0] else n for n in node.input]
            node.output[:] = [outputs[2] if i == len(chain) - 1 else f"{node.output[0]}_whole_{name}"]
            whole = node.output[0]
            node.name = ""
            nodes.append(node)
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(outputs[0], onnx.TensorProto.FLOAT, None),
                                                   helper.make_tensor_value_info(outputs[1], onnx.TensorProto.INT64, None),
                                                   helper.make_tensor_value_info(outputs[2], onnx.TensorProto.FLOAT, None)])

    graph.input.extend([helper.make_tensor_value_info("candidates", onnx.TensorProto.INT64, [1]),
                        helper.make_tensor_value_info("with_scores", onnx.TensorProto.BOOL, []),
                        helper.make_tensor_value_info("whole_rows", onnx.TensorProto.INT64, ["whole"])])
    graph.node.append(helper.make_node("If", ["with_scores"], ["candidate_scores", "candidate_ids", "whole_logits"],
                                       then_branch=branch("scores", True), else_branch=branch("ranks", False)))
    outputs = [o for o in graph.output if o.name != "log_probs"]
    del graph.output[:]
    graph.output.extend(outputs + [helper.make_tensor_value_info("candidate_ids", onnx.TensorProto.INT64, ["batch", "k"]),
                                   helper.make_tensor_value_info("candidate_scores", onnx.TensorProto.FLOAT, ["batch", "k"]),
                                   helper.make_tensor_value_info("whole_logits", onnx.TensorProto.FLOAT, ["whole", "vocab"])])
    return model


def with_stop_rule(model: onnx.ModelProto, eos: int) -> onnx.ModelProto:
    """The step with its search head (changed in place) with greedy search's stopping rule: input `last_position`
    (B,) int64, the position of each row's last step if no eos comes (its budget less one); outputs
    `eos_candidates` (B, K) bool, which candidates are eos, and `at_budget` (B,) bool, which rows have taken their
    last step. A greedy row finishes when its best candidate is eos or it is at its budget (on eos, then, if both):
    every greedy loop (the library's, the portable one, the server's mixed step) reads these two and never compares
    a token with eos or a position with a budget itself. Two plain operators after the head, so the kernel
    variants keep them (ONNX Runtime runs every node of every step, so the rule is as few nodes as it can be)."""
    graph = model.graph
    graph.initializer.append(numpy_helper.from_array(np.array(eos, np.int64), "stop.eos"))
    graph.node.extend([helper.make_node("Equal", ["candidate_ids", "stop.eos"], ["eos_candidates"]),
                       helper.make_node("GreaterOrEqual", ["positions", "last_position"], ["at_budget"])])
    graph.input.append(helper.make_tensor_value_info("last_position", onnx.TensorProto.INT64, ["batch"]))
    graph.output.extend([helper.make_tensor_value_info("eos_candidates", onnx.TensorProto.BOOL, ["batch", "k"]),
                         helper.make_tensor_value_info("at_budget", onnx.TensorProto.BOOL, ["batch"])])
    return model


def with_shared_cross(model: onnx.ModelProto, heads: int, dim: int) -> onnx.ModelProto:
    """The decoder-step graph (changed in place) for rows that share their source's cross K/V: each
    source's `width` rows in turn (1 for greedy and sampling; a beam's size after its first step), and
    cross_k_l, cross_v_l, cross_slot with one row per source. Each cross-attention becomes one
    com.microsoft MultiHeadAttention of a source's `width` queries (B / width, width, D) over its K/V,
    keys up to its cross_slot, in place of the GroupQueryAttention that takes K/V per row: a beam of 4
    reads its source's K/V once, not 4 times, and nobody copies them per row. New input `query_shape`
    (3,) int64 = (-1, width, D); cross_eos_l and the present_cross outputs go (the encoder's cross K/V
    already hold each eos key and value)."""
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    consumers = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    attentions = {node.output[0] for node in graph.node
                  if node.op_type == "GroupQueryAttention" and node.input[3].startswith("cross_k_")}
    dropped = set()  # GroupQueryAttention(Unsqueeze(Concat(query, cross_eos_l))), then Gather(axis 1) to rows
    for name in attentions:
        unsqueeze, [squeeze] = producer[producer[name].input[0]], consumers[name]
        dropped |= {name, unsqueeze.output[0], unsqueeze.input[0], squeeze.output[0]}
    graph.initializer.append(onnx.numpy_helper.from_array(np.array(1, np.int32), "shared_cross_one"))
    graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1, dim], np.int64), "shared_cross_rows"))
    nodes = [helper.make_node("Add", ["cross_slot", "shared_cross_one"], ["source_lengths"])]
    for node in graph.node:
        if node.output[0] in attentions:  # its group where it was: after its query, before its users
            query = producer[producer[node.input[0]].input[0]].input[0]  # Concat's first input
            name, [squeeze] = node.output[0], consumers[node.output[0]]
            nodes += [helper.make_node("Reshape", [query, "query_shape"], [name + "_queries"]),
                      helper.make_node("MultiHeadAttention", [name + "_queries", node.input[3], node.input[4], "",
                                                              "source_lengths"], [name + "_shared"],
                                       domain="com.microsoft", num_heads=heads),
                      helper.make_node("Reshape", [name + "_shared", "shared_cross_rows"], list(squeeze.output))]
        elif node.output[0] not in dropped:
            nodes.append(node)
    kernel_graphs.set_nodes(model, nodes)
    kept_inputs = [i for i in graph.input if not i.name.startswith("cross_eos_")]
    kept_outputs = [o for o in graph.output if not o.name.startswith("present_cross_")]
    del graph.input[:], graph.output[:]
    graph.input.extend(kept_inputs + [helper.make_tensor_value_info("query_shape", onnx.TensorProto.INT64, [3])])
    graph.output.extend(kept_outputs)
    return model
