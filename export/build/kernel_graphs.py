"""Graph rewrites onto nmtserve's custom ops (export/runtime/kernels.cc), made at export time.

The decoder step attends with one query per row and head; ONNX Runtime's GroupQueryAttention and
MultiHeadAttention make two MLAS calls per row and head for a few thousand multiply-adds. The custom ops
do each row and head in one loop:
- `nmtserve.DecodeSelfAttention`: the self-attention, writing the new K/V into the cache in place;
- `nmtserve.DecodeBeamSelfAttention`: the same, each slot read from the row that wrote it (`cache_origin`:
  a beam row that continues another's hypothesis copies no cache);
- `nmtserve.DecodeCrossAttention`: each source's queries over its one copy of the cross K/V;
- `nmtserve.SearchHead`: the step's search head (step_graphs.with_search_head) in one pass;
- `nmtserve.RowQuantize`: each DynamicQuantizeLinear of an int8 graph, each row on a scale of its own, so
  that a sentence's int8 result does not depend on its batch-mates;
- `nmtserve.Embed`: the step's input rows (token embedding, scaled, plus position) in one node.

The rewritten graphs need the library to load; export/build/step_graphs.py writes them into the bundle beside
the portable ones, and the runtime chooses between them (export/runtime/kernels.py says when). Never imported
at serving time.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def with_custom_kernels(model: onnx.ModelProto, beam_origin: bool = False) -> onnx.ModelProto:
    """The decoder-step graph (changed in place) with its GroupQueryAttention nodes (past K/V in, present
    K/V out, packed q, k and v: the self-attention, and the server step's cross-attention, whose "new"
    key and value are the row's eos K/V written at its cross_slot) as nmtserve.DecodeSelfAttention,
    `with_shared_cross`'s MultiHeadAttention nodes as nmtserve.DecodeCrossAttention, and
    `with_search_head`'s If as nmtserve.SearchHead. A node with attributes beyond the head counts (a
    scale, a soft cap, rotary embeddings…), or a search head with more than LogSoftmax and TopK (an Add of
    suppressed ids' -inf), keeps ONNX Runtime's nodes. beam_origin: the self-attentions (over the `past_`
    caches) become nmtserve.DecodeBeamSelfAttention, over a new input `cache_origin` (B, C) int32, the row
    whose cache holds each slot of each row (BatchState.origin); the server step's cross-attention stays
    DecodeSelfAttention."""
    def heads_only(node: onnx.NodeProto) -> bool:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        return set(attributes) <= {"num_heads", "kv_num_heads"} \
            and attributes.get("kv_num_heads", attributes.get("num_heads")) == attributes.get("num_heads")

    nodes = []
    for node in model.graph.node:
        logits = _search_head_logits(node)
        if logits is not None:
            node = helper.make_node("SearchHead", [logits, "candidates", "with_scores", "whole_rows"],
                                    list(node.output), domain="nmtserve")
        elif node.op_type == "GroupQueryAttention" and heads_only(node) and beam_origin \
                and node.input[3].startswith("past_"):
            node = helper.make_node("DecodeBeamSelfAttention", [node.input[0], *node.input[3:6], "cache_origin"],
                                    list(node.output), domain="nmtserve")
        elif node.op_type == "GroupQueryAttention" and heads_only(node):
            node = helper.make_node("DecodeSelfAttention", [node.input[0], *node.input[3:6]], list(node.output),
                                    domain="nmtserve")
        elif node.op_type == "MultiHeadAttention" and heads_only(node):
            node = helper.make_node("DecodeCrossAttention", [*node.input[:3], node.input[4]], list(node.output),
                                    domain="nmtserve")
        nodes.append(node)
    set_nodes(model, nodes)
    _flat_self_attention(model)
    _flat_cross_attention(model)
    _fused_embedding(model)
    if beam_origin:
        model.graph.input.append(helper.make_tensor_value_info("cache_origin", onnx.TensorProto.INT32, ["batch", "slots"]))
    model.opset_import.append(helper.make_opsetid("nmtserve", 1))
    return model


def _flat_self_attention(model: onnx.ModelProto) -> None:
    """(with_custom_kernels' part.) Each self-attention kernel whose packed qkv is Unsqueeze(x, axis 1) and whose
    output one Gather of index 0 on axis 1 alone reads (the exported step's (B, 3·D) -> (B, 1, 3·D) and (B, 1, D)
    -> (B, D) around GroupQueryAttention) reads x and writes the Gather's output itself: given qkv (B, 3·H·Dh) the
    kernel writes (B, H·Dh). Two nodes fewer a layer, and the Gather's copy."""
    def unsqueezed(node: onnx.NodeProto, made_by: dict) -> bool:
        return len(node.input) == 2 and _constant(model, made_by, node.input[1]) == [1]

    def gathered(node: onnx.NodeProto, made_by: dict) -> bool:
        return _constant(model, made_by, node.input[1]) == 0 \
            and _attribute(node, "axis") == 1

    _without_reshaping(model, ("DecodeSelfAttention", "DecodeBeamSelfAttention"), "Unsqueeze", unsqueezed, "Gather",
                       gathered)


def _flat_cross_attention(model: onnx.ModelProto) -> None:
    """(with_custom_kernels' part.) Each DecodeCrossAttention between with_shared_cross's two Reshapes, the step's
    rows (B, D) to (B / width, width, D) by the `query_shape` input and its output back to (B, D), reads the rows
    and writes its output itself: two nodes fewer a layer, and their copies. `query_shape` stays an input, which
    nothing reads then."""
    _without_reshaping(model, ("DecodeCrossAttention",), "Reshape", lambda node, _: node.input[1] == "query_shape",
                       "Reshape", lambda node, made_by: len(_constant(model, made_by, node.input[1]) or []) == 2)


def _without_reshaping(model: onnx.ModelProto, ops: tuple[str, ...], before_op: str, before_ok, after_op: str,
                       after_ok) -> None:
    """Each node of `ops` whose first input a `before_op` node alone makes and whose first output an `after_op` node
    alone reads, both as before_ok and after_ok(node, made_by) say, reads that node's input and writes its output
    itself; the two go."""
    made_by, readers = _graph_readers(model)
    read_by = {name: node for node in model.graph.node for name in node.input}  # the one reader, where one
    dropped = []
    for node in model.graph.node:
        if node.op_type not in ops:
            continue
        before = _made_once(made_by, readers, node.input[0], before_op)
        after = read_by.get(node.output[0]) if readers.get(node.output[0]) == 1 else None
        if before is None or after is None or after.op_type != after_op or not before_ok(before, made_by) \
                or not after_ok(after, made_by):
            continue
        node.input[0], node.output[0] = before.input[0], after.output[0]
        dropped += [before, after]
    _rebuild(model, {}, dropped)


def _fused_embedding(model: onnx.ModelProto) -> None:
    """(with_custom_kernels' part.) The step's input rows, Add(Mul(Gather(table, tokens), scale), Gather(position
    table, positions)) (or without the Mul) over the `tokens` and `positions` inputs, as one nmtserve.Embed: three
    nodes fewer (two without the Mul), and as many passes over the rows."""
    made_by, readers = _graph_readers(model)

    def gathered(name: str, ids: str) -> onnx.NodeProto | None:  # Gather(table, ids) on axis 0, read once
        node = _made_once(made_by, readers, name, "Gather")
        return node if node is not None and node.input[1] == ids and _attribute(node, "axis", 0) == 0 else None

    for add in model.graph.node:
        if add.op_type != "Add":
            continue
        for x, y in (add.input, add.input[::-1]):
            mul = _made_once(made_by, readers, x, "Mul")
            scale = mul and next((s for s in mul.input if isinstance(_constant(model, made_by, s), float)), None)
            embedding = gathered(next(i for i in mul.input if i != scale), "tokens") if scale else gathered(x, "tokens")
            position = gathered(y, "positions")
            if embedding is None or position is None:
                continue
            fused = helper.make_node("Embed", [embedding.input[0], "tokens", position.input[0], "positions",
                                               *([scale] if scale else [])], list(add.output), domain="nmtserve")
            _rebuild(model, {id(add): fused}, [n for n in (mul if scale else None, embedding, position) if n])
            return


def _attribute(node: onnx.NodeProto, name: str, default=None):
    """The value of a node's attribute `name`, or `default` where the node has none."""
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _constant(model: onnx.ModelProto, made_by: dict[str, onnx.NodeProto], name: str) -> list | int | float | None:
    """The value of a Constant node's output or an initializer, as a Python list or number; else None."""
    node = made_by.get(name)
    if node is not None and node.op_type == "Constant" and [a.name for a in node.attribute] == ["value"]:
        return numpy_helper.to_array(node.attribute[0].t).tolist()
    tensor = next((i for i in model.graph.initializer if i.name == name), None)
    return None if tensor is None else numpy_helper.to_array(tensor).tolist()


def with_packed_attention(model: onnx.ModelProto) -> onnx.ModelProto:
    """The encoder graph (changed in place) with each self-attention over unpacked tokens — the exported
    encoder runs on the batch's real tokens packed in one row, (1, T, D), and for attention Gathers q, k and
    v into a padded (B, L, D), runs MultiHeadAttention with src_mask as the key padding mask and Gathers its
    output back into the packed row — as one nmtserve.EncodeSelfAttention over the packed q, k and v. A
    MultiHeadAttention of another form (attributes beyond num_heads, a bias, another mask, an output used
    elsewhere) keeps ONNX Runtime's nodes; a graph without any comes back unchanged. Each cross K and V that
    the graph unpacks the same way and transposes into (B, H, L, Dh) becomes one nmtserve.PackedToHeads."""
    made_by = {output: node for node in model.graph.node for output in node.output}
    used_by: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            used_by.setdefault(name, []).append(node)
    inputs = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}

    def only_user(name: str, op_type: str) -> onnx.NodeProto | None:
        users = used_by.get(name, [])
        return users[0] if len(users) == 1 and users[0].op_type == op_type else None

    def unpacked(name: str) -> tuple | None:  # Reshape(Gather(packed, indices, axis=1)) used by the attention alone
        reshape = made_by.get(name)
        gather = made_by.get(reshape.input[0]) if reshape is not None and reshape.op_type == "Reshape" else None
        if gather is None or gather.op_type != "Gather" or only_user(gather.output[0], "Reshape") is not reshape:
            return None
        return gather.input[0], (reshape, gather)

    replaced, dropped, heads_dropped, heads_names, masks = {}, set(), set(), {}, set()
    for node in model.graph.node:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type != "MultiHeadAttention" or set(attributes) != {"num_heads"} or len(node.input) != 5 \
                or node.input[3] or any(only_user(x, "MultiHeadAttention") is not node for x in node.input[:3]):
            continue
        cast = made_by.get(node.input[4])
        mask = cast.input[0] if cast is not None and cast.op_type == "Cast" else None
        qkv = [unpacked(x) for x in node.input[:3]]
        back = only_user(node.output[0], "Reshape")
        pack = only_user(back.output[0], "Gather") if back is not None else None
        if inputs.get(mask) != onnx.TensorProto.BOOL or None in qkv or pack is None:
            continue
        heads = attributes["num_heads"]
        if heads not in heads_names:
            heads_names[heads] = f"nmtserve_heads_{heads}"
            model.graph.initializer.append(numpy_helper.from_array(np.array([heads], np.int64), heads_names[heads]))
        replaced[id(node)] = helper.make_node("EncodeSelfAttention", [*(x for x, _ in qkv), mask, heads_names[heads]],
                                              list(pack.output), name=node.name, domain="nmtserve")
        dropped |= {id(n) for _, pair in qkv for n in pair} | {id(back), id(pack)}
        masks.add(mask)
    # each cross K or V output, Transpose(Reshape(Reshape(Gather(packed, indices, axis=1)))) into (B, H, L, Dh),
    # as one nmtserve.PackedToHeads of the same rows, when the attentions above gave the mask and head count
    outputs = {o.name for o in model.graph.output}
    if len(heads_names) == 1 and len(masks) == 1:
        mask, casts = next(iter(masks)), set()
        for node in model.graph.node:
            chain = [made_by.get(node.input[0])] if node.op_type == "Transpose" and _attribute(node, "perm") == [0, 2, 1, 3] \
                and node.output[0] in outputs else []
            while chain and chain[-1] is not None and chain[-1].op_type == "Reshape" and len(chain) < 3:
                chain.append(made_by.get(chain[-1].input[0]))
            gather = chain[-1] if len(chain) == 3 else None
            if gather is None or gather.op_type != "Gather" or _attribute(gather, "axis") != 1:
                continue
            if only_user(chain[0].output[0], "Transpose") is not node:
                continue
            index = f"{gather.input[1]}_int64"  # the op reads int64 indices, whatever the graph's type: one Cast each
            cast = [] if index in casts else [
                helper.make_node("Cast", [gather.input[1]], [index], to=onnx.TensorProto.INT64)]
            casts.add(index)
            heads_node = helper.make_node("PackedToHeads", [gather.input[0], index, mask, *heads_names.values()],
                                          list(node.output), name=node.name, domain="nmtserve")
            replaced[id(node)] = [*cast, heads_node]
            heads_dropped |= {id(n) for n in chain}
    if not replaced:
        return model
    nodes = _rebuilt(model, replaced, dropped | heads_dropped)
    made = {i.name for i in [*model.graph.initializer, *model.graph.input]} | {o for n in nodes for o in n.output}
    made.add("")  # an optional input left out
    read = [name for node in nodes for name in node.input] + [o.name for o in model.graph.output]
    if any(name not in made for name in read):  # a removed node's output is still read or an output:
        replaced = {k: v for k, v in replaced.items() if not isinstance(v, list)}  # the cross K/V stay as exported
        nodes = _rebuilt(model, replaced, dropped)
    set_nodes(model, nodes)
    if not any(opset.domain == "nmtserve" for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid("nmtserve", 1))
    return model


def _rebuilt(model: onnx.ModelProto, replaced: dict, dropped: set) -> list[onnx.NodeProto]:
    """The graph's nodes, each in `replaced` (by id) as its node or list of nodes (itself included where listed),
    less the other nodes in `dropped` (ids), less those that no longer lead to an output (`_live`)."""
    nodes = []
    for node in model.graph.node:
        new = replaced.get(id(node), [] if id(node) in dropped else node)
        nodes.extend(new if isinstance(new, list) else [new])
    return _live(nodes, {o.name for o in model.graph.output})


def _live(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """The nodes that lead to a graph output, in order: those left with no reader by a rewrite (the shape
    computations of the Reshapes it removed) go too, so that none reads a tensor no node makes any more."""
    needed, live = set(outputs), []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            live.append(node)
            needed.update(_reads(node))
    return live[::-1]


def sort_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph's nodes (in place) in an order where each comes after every node whose output it reads, its
    subgraphs' reads counted (onnxruntime's quantize_dynamic leaves an If before the Cast its branches read,
    which the rewrites here, walking the nodes in order, would take for unread); otherwise as they were."""
    made_by = {o: i for i, node in enumerate(model.graph.node) for o in node.output}
    order, state = [], {}  # state: 1 while visiting, 2 done

    def visit(i: int) -> None:
        stack = [(i, iter(_reads(model.graph.node[i])))]
        state[i] = 1
        while stack:
            node, pending = stack[-1]
            for name in pending:
                j = made_by.get(name)
                if j is not None and j not in state:
                    state[j] = 1
                    stack.append((j, iter(_reads(model.graph.node[j]))))
                    break
            else:
                stack.pop()
                state[node] = 2
                order.append(node)

    for i in range(len(model.graph.node)):
        if i not in state:
            visit(i)
    nodes = [model.graph.node[i] for i in order]
    set_nodes(model, nodes)
    return model


def set_nodes(model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> None:
    """The graph's nodes replaced, in place, by `nodes` in their order."""
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _reads(node: onnx.NodeProto) -> list[str]:
    """The values a node reads: its inputs, and those its subgraphs (an If's branches) read from the graph
    around it, which are not among its inputs."""
    names = list(node.input)
    for attribute in node.attribute:
        for graph in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs:
            made = {o for inner in graph.node for o in inner.output} | {i.name for i in graph.input} \
                | {i.name for i in graph.initializer}
            names += [name for inner in graph.node for name in _reads(inner) if name not in made]
    return names


def with_row_quantize(model: onnx.ModelProto) -> onnx.ModelProto:
    """An int8 graph of `quantize_dynamic` (changed in place) with each DynamicQuantizeLinear as
    nmtserve.RowQuantize: a scale per row (the last axis) instead of one for the tensor. Its zero point,
    which the MatMulInteger after it reads, becomes a constant: 0 where the input is a Relu's output (it
    cannot be negative: 255 levels above zero), else 128 (symmetric, 127 levels each side). ONNX Runtime
    then fuses MatMulInteger, its Cast and the scales' Mul into MatMulIntegerToFloat, which multiplies each
    output row by its own scale. It would fold the bias Add after them into that node too, and then scale
    the bias by the row's scale as well (onnxruntime 1.32: off by up to a quarter of the output in a test
    of one such node), so each such Add becomes a Sub of the negated bias, which it leaves as it is. A
    graph without DynamicQuantizeLinear (fp32) comes back unchanged."""
    if not any(node.op_type == "DynamicQuantizeLinear" for node in model.graph.node):
        return model
    sort_nodes(model)
    made_by = {output: node for node in model.graph.node for output in node.output}
    initializers = {i.name: i for i in model.graph.initializer}

    def constant(name: str) -> onnx.TensorProto | None:  # an initializer, or one passed on by Identity nodes
        while name in made_by and made_by[name].op_type == "Identity":
            name = made_by[name].input[0]
        return initializers.get(name)

    nodes = []
    for node in model.graph.node:
        if node.op_type == "DynamicQuantizeLinear":
            quantized, scale, zero_point = node.output
            source = made_by.get(node.input[0])
            nonnegative = source is not None and source.op_type == "Relu"
            model.graph.initializer.append(numpy_helper.from_array(np.array(0 if nonnegative else 128, np.uint8), zero_point))
            node = helper.make_node("RowQuantize", [node.input[0], zero_point], [quantized, scale], name=node.name,
                                    domain="nmtserve")
        elif node.op_type == "Add" and any(_scaled_product(made_by, x, "DynamicQuantizeLinear") and constant(y) is not None
                                            for x, y in (node.input, node.input[::-1])):
            product, bias = node.input if constant(node.input[1]) is not None else node.input[::-1]
            negated = numpy_helper.from_array(-numpy_helper.to_array(constant(bias)), f"{bias}_negated")
            model.graph.initializer.append(negated)
            node = helper.make_node("Sub", [product, negated.name], list(node.output), name=node.name)
        nodes.append(node)
    set_nodes(model, nodes)
    _scale_logits_in_search_head(model)
    _fuse_epilogues(model)
    _bias_into_attention(model)
    for domain in ("nmtserve", "com.microsoft"):
        if not any(opset.domain == domain for opset in model.opset_import):
            model.opset_import.append(helper.make_opsetid(domain, 1))
    return model


def _scaled_product(made_by: dict[str, onnx.NodeProto], name: str, quantizer: str) -> tuple | None:
    """The nodes of quantize_dynamic's product that `name` is, Mul(Cast(MatMulInteger(q, …)), scales) with q
    made by a `quantizer` node, as (mul, cast, matmul, quantizer node); else None."""
    mul = made_by.get(name)
    if mul is None or mul.op_type != "Mul":
        return None
    cast = next((made_by[x] for x in mul.input if x in made_by and made_by[x].op_type == "Cast"), None)
    matmul = made_by.get(cast.input[0]) if cast is not None else None
    if matmul is None or matmul.op_type != "MatMulInteger":
        return None
    quantize = made_by.get(matmul.input[0])
    return (mul, cast, matmul, quantize) if quantize is not None and quantize.op_type == quantizer else None


def _graph_readers(model: onnx.ModelProto) -> tuple[dict[str, onnx.NodeProto], dict[str, int]]:
    """Each value's node, and how many nodes (and graph outputs) read each value."""
    made_by = {output: node for node in model.graph.node for output in node.output}
    readers: dict[str, int] = {}
    for name in [x for node in model.graph.node for x in _reads(node)] + [o.name for o in model.graph.output]:
        readers[name] = readers.get(name, 0) + 1
    return made_by, readers


def _made_once(made_by: dict[str, onnx.NodeProto], readers: dict[str, int], name: str, op: str) -> onnx.NodeProto | None:
    """The node of type `op` that makes `name`, where one node alone reads `name`; else None."""
    node = made_by.get(name)
    return node if node is not None and node.op_type == op and readers.get(name) == 1 else None


def _bias_sub(made_by: dict[str, onnx.NodeProto], readers: dict[str, int], name: str,
              reads: int = 1) -> onnx.NodeProto | None:
    """with_row_quantize's Sub of a negated bias that makes `name`, read by `reads` nodes; else None."""
    sub = made_by.get(name)
    return sub if sub is not None and sub.op_type == "Sub" and readers.get(name) == reads \
        and sub.input[1].endswith("_negated") else None


def _weight_scaled(model: onnx.ModelProto, made_by: dict[str, onnx.NodeProto], readers: dict[str, int], name: str,
                   inserted: dict[int, list[onnx.NodeProto]], dropped: list[onnx.NodeProto]) -> str | None:
    """For a row-scaled product `name` (quantize_dynamic's Mul(Cast(MatMulInteger(q, …)), row scale × weight
    scale), q from a RowQuantize) that one node alone reads: one com.microsoft MatMulIntegerToFloat on the
    weights' scale alone writes `name` instead (put into `inserted` and `dropped`, for _rebuild), and the row
    scale, which its reader is to apply, is returned. None, and nothing changed, for anything else."""
    found = _scaled_product(made_by, name, "RowQuantize")
    if found is None or any(readers.get(n.output[0]) != 1 for n in found[:3]):
        return None
    mul, cast, product, quantize = found
    row_scale = quantize.output[1]
    scales = made_by.get(next(x for x in mul.input if x != cast.output[0]))
    if scales is None or scales.op_type != "Mul" or row_scale not in scales.input:
        return None
    weight_scale = next(x for x in scales.input if x != row_scale)
    if not any(i.name == "row_quantize_one" for i in model.graph.initializer):
        model.graph.initializer.append(numpy_helper.from_array(np.array(1, np.float32), "row_quantize_one"))
    inserted[id(product)] = [helper.make_node("MatMulIntegerToFloat", [product.input[0], product.input[1],
                                              "row_quantize_one", weight_scale, *product.input[2:4]], [name],
                                              name=product.name, domain="com.microsoft")]
    dropped += [mul, cast, product] + ([scales] if readers[scales.output[0]] == 1 else [])
    return row_scale


def _rebuild(model: onnx.ModelProto, inserted: dict[int, list[onnx.NodeProto]], dropped: list[onnx.NodeProto]) -> None:
    """The graph's nodes, in place, as `_rebuilt` gives them."""
    nodes = _rebuilt(model, inserted, {id(n) for n in dropped})
    set_nodes(model, nodes)


def _scale_logits_in_search_head(model: onnx.ModelProto) -> None:
    """(with_row_quantize's part.) The output projection whose logits only nmtserve.SearchHead reads
    becomes one com.microsoft MatMulIntegerToFloat with the weights' scale alone, and the search head takes
    the row scales and the bias as inputs and applies them to each row as it reads it: on a vocabulary of
    58,101 the two passes over the (B, V) output (the row scales, the bias) cost as much as a fifth of an
    int8 step at batch 32 (docs/performance-journal.md, "int8 scales per row")."""
    made_by, readers = _graph_readers(model)
    inserted, dropped = {}, []
    for head in [n for n in model.graph.node if n.op_type == "SearchHead" and len(n.input) == 4]:
        logits, bias = head.input[0], None
        to_float = _made_once(made_by, readers, logits, "Cast")  # the export's Cast of the logits to float,
        if to_float is not None and helper.get_attribute_value(to_float.attribute[0]) == onnx.TensorProto.FLOAT:
            logits = to_float.input[0]  # which they already are
        else:
            to_float = None
        sub = _bias_sub(made_by, readers, logits)
        if sub is not None:
            logits, bias = sub.input[0], sub.input[1].removesuffix("_negated")
        row_scale = _weight_scaled(model, made_by, readers, logits, inserted, dropped)
        if row_scale is None:
            continue
        dropped += [n for n in (to_float, sub) if n is not None]
        head.input[0] = logits
        head.input.extend([row_scale, *([bias] if bias else [])])
    _rebuild(model, inserted, dropped)


def _fuse_epilogues(model: onnx.ModelProto) -> None:
    """(with_row_quantize's part.) What follows a row-scaled product, in one nmtserve node each where the
    graph has it: the end of a post-norm sublayer, Sub (the bias) → Add (the residual) →
    LayerNormalization → RowQuantize, as AddNormQuantize; a feed-forward block's middle, Sub → Relu →
    RowQuantize, as BiasReluQuantize, or Sub → Sigmoid and Mul (swish: x · sigmoid(x), Marian's) → RowQuantize,
    as BiasSwishQuantize. The product becomes a MatMulIntegerToFloat on the weights' scale
    alone and the new node applies the row scale: each node has a fixed cost in ONNX Runtime, and each row scale
    was a pass of its own over the product (docs/performance-journal.md, "The epilogues fused")."""
    made_by, readers = _graph_readers(model)
    quantizers: dict[str, list[onnx.NodeProto]] = {}  # each value's RowQuantize readers
    for node in model.graph.node:
        if node.op_type == "RowQuantize":
            quantizers.setdefault(node.input[0], []).append(node)
    inserted, dropped = {}, []
    for node in model.graph.node:
        found = quantizers.get(node.output[0], []) if node.output else []
        quantize = found[0] if len(found) == 1 else None
        if node.op_type == "LayerNormalization":
            attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            add = _made_once(made_by, readers, node.input[0], "Add")
            sub = next((s for s in (_bias_sub(made_by, readers, x) for x in add.input) if s is not None), None) \
                if add is not None else None
            if attributes.get("axis", -1) != -1 or len(node.input) < 3 or len(node.output) > 1 \
                    or quantize is None or sub is None:
                continue
            row_scale = _weight_scaled(model, made_by, readers, sub.input[0], inserted, dropped)
            if row_scale is None:
                continue
            residual = next(x for x in add.input if x != sub.output[0])
            epsilon = numpy_helper.from_array(np.array(attributes.get("epsilon", 1e-5), np.float32),
                                              f"{node.output[0]}_epsilon")
            model.graph.initializer.append(epsilon)
            inserted[id(node)] = [helper.make_node(
                "AddNormQuantize", [sub.input[0], row_scale, sub.input[1], residual, *node.input[1:3], epsilon.name],
                [node.output[0], *quantize.output], name=node.name, domain="nmtserve")]
            dropped += [sub, add, quantize]
        elif node.op_type == "Relu":
            sub = _bias_sub(made_by, readers, node.input[0])
            if quantize is None or readers.get(node.output[0]) != 1 or sub is None:
                continue
            row_scale = _weight_scaled(model, made_by, readers, sub.input[0], inserted, dropped)
            if row_scale is None:
                continue
            inserted[id(node)] = [helper.make_node("BiasReluQuantize", [sub.input[0], row_scale, sub.input[1]],
                                                   list(quantize.output), name=node.name, domain="nmtserve")]
            dropped += [sub, quantize]
        elif node.op_type == "Mul":
            swish = _swish(made_by, readers, node) if quantize is not None and readers.get(node.output[0]) == 1 else None
            if swish is None:
                continue
            sub, sigmoid = swish
            row_scale = _weight_scaled(model, made_by, readers, sub.input[0], inserted, dropped)
            if row_scale is None:
                continue
            inserted[id(node)] = [helper.make_node("BiasSwishQuantize", [sub.input[0], row_scale, sub.input[1]],
                                                   list(quantize.output), name=node.name, domain="nmtserve")]
            dropped += [sub, sigmoid, quantize]
    _rebuild(model, inserted, dropped)


def _swish(made_by: dict[str, onnx.NodeProto], readers: dict[str, int], mul: onnx.NodeProto) -> tuple | None:
    """A Mul that is swish of with_row_quantize's bias Sub, Mul(x, Sigmoid(x)) with x = Sub(product, negated
    bias) read by these two nodes alone, as (sub, sigmoid); else None."""
    for x, s in (mul.input, mul.input[::-1]):
        sigmoid = _made_once(made_by, readers, s, "Sigmoid")
        sub = _bias_sub(made_by, readers, x, reads=2)
        if sigmoid is not None and sigmoid.input[0] == x and sub is not None:
            return sub, sigmoid
    return None


def _bias_into_attention(model: onnx.ModelProto) -> None:
    """(with_row_quantize's part.) The bias Sub before an attention kernel's packed qkv (the self-attentions),
    or before the Reshape of its queries (the offline step's cross-attention), goes: the kernel reads the
    product and subtracts the negated bias as it reads each row (one pass over the projection fewer, and a
    node). A kernel that already has one, or reads anything else, keeps its inputs."""
    made_by, readers = _graph_readers(model)
    inputs = {"DecodeSelfAttention": 4, "DecodeBeamSelfAttention": 5, "DecodeCrossAttention": 4}  # without a bias
    dropped = []
    for node in model.graph.node:
        if inputs.get(node.op_type) != len(node.input):
            continue
        reader = _made_once(made_by, readers, node.input[0], "Reshape") or node  # the node that reads the Sub
        sub = _bias_sub(made_by, readers, reader.input[0])
        if sub is None:
            continue
        reader.input[0] = sub.input[0]
        node.input.append(sub.input[1])
        dropped.append(sub)
    _rebuild(model, {}, dropped)


def _search_head_logits(node: onnx.NodeProto) -> str | None:
    """The logits an If of `with_search_head` reads when its scoring branch is LogSoftmax then TopK (and the
    whole rows' Gather) over them alone; else None (another node, or a head that adds suppressed ids' -inf
    after the log-softmax: it keeps ONNX Runtime's nodes)."""
    if node.op_type != "If" or list(node.input) != ["with_scores"]:
        return None
    scoring = _attribute(node, "then_branch")
    return scoring.node[0].input[0] if [n.op_type for n in scoring.node] == ["LogSoftmax", "TopK", "Gather"] else None
