"""nmtserve's decoding kernels (export/runtime/kernels.cc, kernels.py) and the kernel graphs export writes
(export/build/kernel_graphs.py): each op against a numpy reference, the cache written in place, the step
graph's nodes swapped, and whole searches equal to the portable graphs' (ONNX Runtime's own attention
kernels). `make test` builds the library first (`make kernels`)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from nmtserve.decoding import DecodingOptions
from nmtserve.errors import ConfigError
from nmtserve.export.build import kernel_graphs
from nmtserve.export.build.exporter import ExportConfig, export_bundle
from nmtserve.export.runtime import kernels
from nmtserve.export.runtime.sessions import session_options
from nmtserve.export.runtime.translator import OnnxTranslator
from nmtserve.training.data import read_tsv
from tests.helpers import TEST_SCORE_TOLERANCE, TEST_VARIANT

ROWS, HEADS, SLOTS, DIM = 3, 2, 8, 16

pytestmark = pytest.mark.usefixtures("kernel_library")  # every test here runs the library


def _session(node: onnx.NodeProto, inputs: list, outputs: list) -> ort.InferenceSession:
    """One op; outputs: names of float outputs, or (name, type)."""
    outputs = [o if isinstance(o, tuple) else (o, TensorProto.FLOAT) for o in outputs]
    graph = helper.make_graph([node], "op", [helper.make_tensor_value_info(n, t, None) for n, t in inputs],
                              [helper.make_tensor_value_info(n, t, None) for n, t in outputs])
    return _kernel_session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                                    helper.make_opsetid("nmtserve", 1)]))


def _kernel_session(model: onnx.ModelProto, optimized_path=None) -> ort.InferenceSession:
    """A one-thread CPU session of `model` with nmtserve's kernel library (and the graph ONNX Runtime optimised
    written to optimized_path, when given)."""
    options = session_options(1)
    options.register_custom_ops_library(str(kernels.LIBRARY))
    if optimized_path:
        options.optimized_model_filepath = str(optimized_path)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _attend(q, k, v):  # one query (D,) over keys and values (T, D)
    scores = k @ q / np.sqrt(len(q))
    p = np.exp(scores - scores.max())
    return (p / p.sum()) @ v


def test_the_library_is_built():
    assert kernels.available(), f"{kernels.LIBRARY} missing: build it with `make kernels`"


def test_the_library_lives_outside_the_package_under_a_name_keyed_by_its_source(tmp_path, monkeypatch):
    """A library built from another kernels.cc (an older checkout's, say) is never loaded: its name differs, so
    the translator says "not built (make kernels)" rather than calling into functions of another shape."""
    assert kernels.HERE not in kernels.LIBRARY.parents
    monkeypatch.setenv("NMTSERVE_KERNELS_DIR", str(tmp_path))
    assert kernels.library_path().parent == tmp_path
    edited = tmp_path / "kernels.cc"
    edited.write_bytes(kernels.SOURCE.read_bytes() + b"// an edit\n")
    names = {kernels.library_path().name}
    monkeypatch.setattr(kernels, "SOURCE", edited)
    names.add(kernels.library_path().name)
    assert len(names) == 2
    assert "is not built (make kernels)" in kernels.unavailable(kernels.library_path())


def test_self_attention_writes_each_rows_new_key_and_value_in_place_and_attends_over_its_slots():
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((ROWS, 1, 3 * HEADS * DIM), dtype=np.float32)
    past_k, past_v = (rng.standard_normal((ROWS, HEADS, SLOTS, DIM), dtype=np.float32) for _ in range(2))
    filled = np.array([0, 5, SLOTS], np.int32)  # the last row's slot is outside the cache: a hole, never read
    session = _session(helper.make_node("DecodeSelfAttention", ["qkv", "past_k", "past_v", "filled"],
                                        ["out", "present_k", "present_v"], domain="nmtserve"),
                       [("qkv", TensorProto.FLOAT), ("past_k", TensorProto.FLOAT), ("past_v", TensorProto.FLOAT),
                        ("filled", TensorProto.INT32)], ["out", "present_k", "present_v"])
    k, v = past_k.copy(), past_v.copy()
    binding = session.io_binding()  # as the runtime binds them: each cache is its layer's input and output
    for name, x in (("qkv", qkv), ("past_k", k), ("past_v", v), ("filled", filled)):
        binding.bind_input(name, "cpu", 0, x.dtype, x.shape, x.ctypes.data)
    binding.bind_output("out")
    for name, x in (("present_k", k), ("present_v", v)):
        binding.bind_output(name, "cpu", 0, x.dtype, x.shape, x.ctypes.data)
    session.run_with_iobinding(binding)
    out = binding.copy_outputs_to_cpu()[0].reshape(ROWS, HEADS, DIM)
    q, new_k, new_v = qkv.reshape(ROWS, 3, HEADS, DIM).transpose(1, 0, 2, 3)
    for row in range(2):
        slot = filled[row]
        expected_k, expected_v = past_k[row].copy(), past_v[row].copy()
        expected_k[:, slot], expected_v[:, slot] = new_k[row], new_v[row]
        assert np.array_equal(k[row], expected_k) and np.array_equal(v[row], expected_v)
        for h in range(HEADS):
            want = _attend(q[row, h], expected_k[h, :slot + 1], expected_v[h, :slot + 1])
            assert np.abs(out[row, h] - want).max() < 1e-5
    assert np.array_equal(k[2], past_k[2]) and np.array_equal(v[2], past_v[2]) and not out[2].any()
    # outputs not bound to the inputs: the caches are copied, then written
    unbound = session.run(None, {"qkv": qkv, "past_k": past_k, "past_v": past_v, "filled": filled})
    assert np.array_equal(unbound[1], k) and np.array_equal(unbound[2], v) and np.allclose(unbound[0].reshape(out.shape), out)


def test_beam_self_attention_reads_each_slot_from_the_row_its_origin_names():
    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((ROWS, 1, 3 * HEADS * DIM), dtype=np.float32)
    past_k, past_v = (rng.standard_normal((ROWS, HEADS, SLOTS, DIM), dtype=np.float32) for _ in range(2))
    filled = np.array([4, 4, 4], np.int32)  # a beam of 3 rows at one position
    origin = np.array([[0, 0, 0, 0, 0, 5, 5, 5],  # row 0's slots 0-3 all its own
                       [0, 0, 2, 1, 1, 5, 5, 5],  # row 1 continues a hypothesis that went 0, 0, 2, 1
                       [1, 2, 0, 2, 2, 5, 5, 5]], np.int32)  # slots past filled are never read
    origin[:, 4] = np.arange(ROWS)  # the slot each row writes is its own
    session = _session(helper.make_node("DecodeBeamSelfAttention", ["qkv", "past_k", "past_v", "filled", "origin"],
                                        ["out", "present_k", "present_v"], domain="nmtserve"),
                       [("qkv", TensorProto.FLOAT), ("past_k", TensorProto.FLOAT), ("past_v", TensorProto.FLOAT),
                        ("filled", TensorProto.INT32), ("origin", TensorProto.INT32)], ["out", "present_k", "present_v"])
    out, k, v = session.run(None, {"qkv": qkv, "past_k": past_k, "past_v": past_v, "filled": filled, "origin": origin})
    out = out.reshape(ROWS, HEADS, DIM)
    q, new_k, new_v = qkv.reshape(ROWS, 3, HEADS, DIM).transpose(1, 0, 2, 3)
    expected_k, expected_v = past_k.copy(), past_v.copy()
    expected_k[:, :, 4], expected_v[:, :, 4] = new_k, new_v  # each row's new K/V in its own slot 4
    assert np.array_equal(k, expected_k) and np.array_equal(v, expected_v)
    for row in range(ROWS):
        keys = np.stack([expected_k[origin[row, t], :, t] for t in range(5)], axis=1)  # (H, 5, D)
        values = np.stack([expected_v[origin[row, t], :, t] for t in range(5)], axis=1)
        for h in range(HEADS):
            assert np.abs(out[row, h] - _attend(q[row, h], keys[h], values[h])).max() < 1e-5
    origin[2, 1] = ROWS  # a row outside the batch: an error of the run, not a read outside the cache
    with pytest.raises(Exception, match="origin names a row outside the batch"):
        session.run(None, {"qkv": qkv, "past_k": past_k, "past_v": past_v, "filled": filled, "origin": origin})


@pytest.mark.parametrize("op", ["DecodeSelfAttention", "DecodeBeamSelfAttention"])
def test_self_attention_reads_a_flat_qkv_through_its_bias_and_writes_flat_rows(op):
    """qkv (B, 3·H·Dh) before its bias, and the negated bias as the last input (kernel_graphs._flat_self_attention,
    _bias_into_attention): out is (B, H·Dh) and equals the node's on qkv - negated_bias, (B, 1, 3·H·Dh),
    bit for bit, caches included; a bias of another size is an error of the run."""
    rng = np.random.default_rng(5)
    qkv = rng.standard_normal((ROWS, 3 * HEADS * DIM), dtype=np.float32)
    negated_bias = rng.standard_normal(3 * HEADS * DIM, dtype=np.float32)
    past_k, past_v = (rng.standard_normal((ROWS, HEADS, SLOTS, DIM), dtype=np.float32) for _ in range(2))
    filled = np.array([0, 5, 3], np.int32)
    origin = np.tile(np.arange(ROWS, dtype=np.int32)[:, None], (1, SLOTS))  # each row's slots its own
    extra = [("origin", TensorProto.INT32)] if op == "DecodeBeamSelfAttention" else []
    inputs = [("qkv", TensorProto.FLOAT), ("past_k", TensorProto.FLOAT), ("past_v", TensorProto.FLOAT),
              ("filled", TensorProto.INT32), *extra]
    feeds = {"past_k": past_k, "past_v": past_v, "filled": filled, **({"origin": origin} if extra else {})}
    outputs = ["out", "present_k", "present_v"]
    biased = _session(helper.make_node(op, [n for n, _ in inputs] + ["negated_bias"], outputs, domain="nmtserve"),
                      inputs + [("negated_bias", TensorProto.FLOAT)], outputs)
    plain = _session(helper.make_node(op, [n for n, _ in inputs], outputs, domain="nmtserve"), inputs, outputs)
    found = biased.run(None, {"qkv": qkv, "negated_bias": negated_bias, **feeds})
    expected = plain.run(None, {"qkv": (qkv - negated_bias)[:, None, :], **feeds})
    assert found[0].shape == (ROWS, HEADS * DIM) and expected[0].shape == (ROWS, 1, HEADS * DIM)
    assert np.array_equal(found[0], expected[0][:, 0]) and all(np.array_equal(x, y) for x, y in zip(found[1:], expected[1:]))
    assert not np.array_equal(found[0], plain.run(None, {"qkv": qkv[:, None, :], **feeds})[0][:, 0])  # the bias counts
    with pytest.raises(Exception, match=f"{op}: qkv must be"):
        biased.run(None, {"qkv": qkv, "negated_bias": negated_bias[:-1], **feeds})


@pytest.mark.parametrize("op", ["DecodeSelfAttention", "DecodeBeamSelfAttention", "DecodeCrossAttention"])
def test_attention_over_caches_larger_than_a_cores_l2_gives_the_reference_results(op):
    """Caches of ~6 MB, past any core's L2 cache, which the kernels read asking for each item's keys ahead
    (kernels.cc, prefetch_keys): each row and head as numpy attends, holes (a slot outside the cache, or below
    it) give zeros, and beam rows read the slots their origin names."""
    rng = np.random.default_rng(7)
    rows, heads, slots, dim = 48, 4, 96, 64
    filled = rng.integers(40, slots, rows).astype(np.int32)
    filled[[5, 17]] = slots, -1  # holes
    if op == "DecodeCrossAttention":  # a source per row, its first `filled` keys
        q = rng.standard_normal((rows, 1, heads * dim), dtype=np.float32)
        k, v = (rng.standard_normal((rows, heads, slots, dim), dtype=np.float32) for _ in range(2))
        session = _session(helper.make_node(op, ["q", "k", "v", "lengths"], ["out"], domain="nmtserve"),
                           [("q", TensorProto.FLOAT), ("k", TensorProto.FLOAT), ("v", TensorProto.FLOAT),
                            ("lengths", TensorProto.INT32)], ["out"])
        out = session.run(None, {"q": q, "k": k, "v": v, "lengths": filled})[0].reshape(rows, heads, dim)
        q = q.reshape(rows, heads, dim)
        keys = [k[b, :, :max(n, 0)] for b, n in enumerate(filled)]
        values = [v[b, :, :max(n, 0)] for b, n in enumerate(filled)]
    else:  # a new key and value written at slot filled[b], then attention over slots 0..filled[b]
        qkv = rng.standard_normal((rows, 1, 3 * heads * dim), dtype=np.float32)
        past_k, past_v = (rng.standard_normal((rows, heads, slots, dim), dtype=np.float32) for _ in range(2))
        inputs = [("qkv", TensorProto.FLOAT), ("past_k", TensorProto.FLOAT), ("past_v", TensorProto.FLOAT),
                  ("filled", TensorProto.INT32)]
        feeds = {"qkv": qkv, "past_k": past_k, "past_v": past_v, "filled": filled}
        origin = np.tile(np.arange(rows, dtype=np.int32)[:, None], (1, slots))
        if op == "DecodeBeamSelfAttention":  # beams of 4 rows at one position: slots from any row of the beam
            filled = feeds["filled"] = np.repeat(filled[::4], 4)
            beam = np.arange(rows)[:, None] // 4 * 4
            origin = (beam + rng.integers(0, 4, (rows, slots))).astype(np.int32)
            origin[np.arange(rows), filled] = np.arange(rows)  # the slot a row writes is its own
            inputs.append(("origin", TensorProto.INT32))
            feeds["origin"] = origin
        session = _session(helper.make_node(op, [n for n, _ in inputs], ["out", "present_k", "present_v"],
                                            domain="nmtserve"), inputs, ["out", "present_k", "present_v"])
        out, k, v = session.run(None, feeds)
        out = out.reshape(rows, heads, dim)
        q = qkv.reshape(rows, 3, heads, dim)[:, 0]
        keys = [np.stack([k[origin[b, t], :, t] for t in range(n + 1)], axis=1) if 0 <= n < slots else None
                for b, n in enumerate(filled)]
        values = [np.stack([v[origin[b, t], :, t] for t in range(n + 1)], axis=1) if 0 <= n < slots else None
                  for b, n in enumerate(filled)]
    for b in range(rows):
        if keys[b] is None or keys[b].shape[1] == 0:  # a hole, or a source of no key
            assert not out[b].any(), b
            continue
        for h in range(heads):
            assert np.abs(out[b, h] - _attend(q[b, h], keys[b][h], values[b][h])).max() < 1e-5, (b, h)


def test_cross_attention_reads_each_sources_keys_up_to_its_length():
    rng = np.random.default_rng(1)
    width, keys = 2, 6  # each source's queries: a beam of 2
    q = rng.standard_normal((ROWS, width, HEADS * DIM), dtype=np.float32)
    k, v = (rng.standard_normal((ROWS, HEADS, keys, DIM), dtype=np.float32) for _ in range(2))
    lengths = np.array([1, 4, keys], np.int32)
    session = _session(helper.make_node("DecodeCrossAttention", ["q", "k", "v", "lengths"], ["out"], domain="nmtserve"),
                       [("q", TensorProto.FLOAT), ("k", TensorProto.FLOAT), ("v", TensorProto.FLOAT),
                        ("lengths", TensorProto.INT32)], ["out"])
    out = session.run(None, {"q": q, "k": k, "v": v, "lengths": lengths})[0].reshape(ROWS, width, HEADS, DIM)
    for s in range(ROWS):
        for w in range(width):
            for h in range(HEADS):
                want = _attend(q.reshape(ROWS, width, HEADS, DIM)[s, w, h], k[s, h, :lengths[s]], v[s, h, :lengths[s]])
                assert np.abs(out[s, w, h] - want).max() < 1e-5
    lengths[0] = 0  # no key: zeros, not NaN
    out = session.run(None, {"q": q, "k": k, "v": v, "lengths": lengths})[0].reshape(ROWS, width, HEADS, DIM)
    assert not out[0].any() and np.isfinite(out).all()
    # q before its bias, and the negated bias (kernel_graphs._bias_into_attention): the same, bit for bit
    negated_bias = rng.standard_normal(HEADS * DIM, dtype=np.float32)
    biased = _session(helper.make_node("DecodeCrossAttention", ["q", "k", "v", "lengths", "negated_bias"], ["out"],
                                       domain="nmtserve"),
                      [("q", TensorProto.FLOAT), ("k", TensorProto.FLOAT), ("v", TensorProto.FLOAT),
                       ("lengths", TensorProto.INT32), ("negated_bias", TensorProto.FLOAT)], ["out"])
    found = biased.run(None, {"q": q, "k": k, "v": v, "lengths": lengths, "negated_bias": negated_bias})[0]
    assert np.array_equal(found, session.run(None, {"q": q - negated_bias, "k": k, "v": v, "lengths": lengths})[0])
    with pytest.raises(Exception, match="DecodeCrossAttention: q must be"):
        biased.run(None, {"q": q, "k": k, "v": v, "lengths": lengths, "negated_bias": negated_bias[:-1]})
    # the step's rows (Bs·W, H·Dh), a source's W rows one after another (kernel_graphs._flat_cross_attention): the
    # results of (Bs, W, H·Dh), as rows; a row count that is not a multiple of the sources is refused
    rows = {"q": q.reshape(ROWS * width, HEADS * DIM), "k": k, "v": v, "lengths": lengths, "negated_bias": negated_bias}
    flat = biased.run(None, rows)[0]
    assert flat.shape == (ROWS * width, HEADS * DIM) and np.array_equal(flat, found.reshape(flat.shape))
    with pytest.raises(Exception, match="DecodeCrossAttention: q must be"):
        biased.run(None, {**rows, "q": rows["q"][1:]})


@pytest.mark.parametrize("scaled", [True, False])
def test_embed_gives_the_rows_of_the_gathers_mul_and_add_it_replaces_bit_for_bit(scaled):
    rng = np.random.default_rng(4)
    table, positions_table = (rng.standard_normal((n, HEADS * DIM), dtype=np.float32) for n in (11, 7))
    tokens, positions = np.array([3, 0, 10, 3], np.int64), np.array([0, 6, 2, 2], np.int64)
    scale = np.array(np.sqrt(HEADS * DIM), np.float32)
    inputs = [("table", TensorProto.FLOAT), ("tokens", TensorProto.INT64), ("positions_table", TensorProto.FLOAT),
              ("positions", TensorProto.INT64)] + ([("scale", TensorProto.FLOAT)] if scaled else [])
    session = _session(helper.make_node("Embed", [n for n, _ in inputs], ["x"], domain="nmtserve"), inputs, ["x"])
    feed = {"table": table, "tokens": tokens, "positions_table": positions_table, "positions": positions,
            **({"scale": scale} if scaled else {})}
    x = session.run(None, feed)[0]
    assert np.array_equal(x, (table[tokens] * scale if scaled else table[tokens]) + positions_table[positions])
    for name, value in (("tokens", 11), ("tokens", -1), ("positions", 7)):
        wrong = feed[name].copy()
        wrong[1] = value
        with pytest.raises(Exception, match="Embed: row 1's token .* is outside its table"):
            session.run(None, {**feed, name: wrong})


def test_encoder_self_attention_attends_within_each_sentence_of_the_packed_tokens():
    rng = np.random.default_rng(2)
    mask = np.zeros((3, 5), bool)
    mask[0, :2], mask[1, :5], mask[2, :1] = True, True, True  # 2, 5 and 1 tokens: 8 packed rows
    q, k, v = (rng.standard_normal((1, 8, HEADS * DIM), dtype=np.float32) for _ in range(3))
    session = _session(helper.make_node("EncodeSelfAttention", ["q", "k", "v", "mask", "heads"], ["out"], domain="nmtserve"),
                       [("q", TensorProto.FLOAT), ("k", TensorProto.FLOAT), ("v", TensorProto.FLOAT),
                        ("mask", TensorProto.BOOL), ("heads", TensorProto.INT64)], ["out"])
    feed = {"q": q, "k": k, "v": v, "mask": mask, "heads": np.array([HEADS], np.int64)}
    out = session.run(None, feed)[0].reshape(8, HEADS, DIM)
    q, k, v = (x.reshape(8, HEADS, DIM) for x in (q, k, v))
    first = [0, 2, 7, 8]
    for s in range(3):
        rows = range(first[s], first[s + 1])
        for i in rows:
            for h in range(HEADS):
                want = _attend(q[i, h], k[rows.start:rows.stop, h], v[rows.start:rows.stop, h])
                assert np.abs(out[i, h] - want).max() < 1e-5
    feed["mask"] = np.ones((3, 5), bool)  # 15 tokens for 8 rows: refused, never read past the rows
    with pytest.raises(Exception, match="src_mask's tokens are not the packed rows of q"):
        session.run(None, feed)


def test_packed_to_heads_puts_each_slot_s_row_into_every_head_and_refuses_an_index_outside_the_rows():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 5, HEADS * DIM), dtype=np.float32)
    index = np.array([0, 1, 1, 2, 3, 4], np.int64)  # 2 sentences of 3 slots: rows 0 1 1 (a padded slot), 2 3 4
    session = _session(helper.make_node("PackedToHeads", ["x", "index", "mask", "heads"], ["out"], domain="nmtserve"),
                       [("x", TensorProto.FLOAT), ("index", TensorProto.INT64), ("mask", TensorProto.BOOL),
                        ("heads", TensorProto.INT64)], ["out"])
    feed = {"x": x, "index": index, "mask": np.ones((2, 3), bool), "heads": np.array([HEADS], np.int64)}
    out = session.run(None, feed)[0]
    want = x[0, index].reshape(2, 3, HEADS, DIM).transpose(0, 2, 1, 3)
    assert out.shape == (2, HEADS, 3, DIM) and np.array_equal(out, want)
    feed["index"] = np.array([0, 1, 1, 2, 3, 5], np.int64)
    with pytest.raises(Exception, match="an index is outside the packed rows"):
        session.run(None, feed)


def test_the_encoder_attends_on_packed_tokens_with_the_results_of_ort_nodes(tiny_bundle):
    """with_packed_attention swaps each self-attention's unpacking Gathers, MultiHeadAttention and packing
    Gather for one EncodeSelfAttention, and each cross K/V's Gather, Reshapes and Transpose for one
    PackedToHeads; a batch of sources of different lengths encodes as before, padded slots too."""
    translator = OnnxTranslator(tiny_bundle)
    path = translator.bundle.graph_path("fp32", "encoder")
    before, after = onnx.load(str(path)), kernel_graphs.with_packed_attention(onnx.load(str(path)))
    assert [n.op_type for n in _graph(translator, 0).node] == [n.op_type for n in after.graph.node]  # as exported
    ops = [n.op_type for n in after.graph.node]
    layers = translator.bundle.model["n_encoder_layers"]
    assert [n.op_type for n in before.graph.node].count("MultiHeadAttention") == layers
    assert ops.count("EncodeSelfAttention") == layers and "MultiHeadAttention" not in ops
    # each decoder layer's cross K and V straight from the packed rows into (B, H, L, Dh)
    assert ops.count("PackedToHeads") == 2 * translator.n_layers
    onnx.checker.check_model(after)  # no node reads what the removed nodes made
    sources = [[5, 6, 7, 8, 9, 10, 11, translator.eos_id], [12, translator.eos_id], [13, 14, 15, translator.eos_id]]
    src_ids, src_mask = translator.pad(sources)
    ours = _kernel_session(after)
    theirs = ort.InferenceSession(before.SerializeToString(), session_options(1), providers=["CPUExecutionProvider"])
    for a, b in zip(*(s.run(None, {"src_ids": src_ids, "src_mask": src_mask}) for s in (ours, theirs))):
        assert np.abs(a - b).max() < 1e-5
    # a cross K whose unpacked rows are read elsewhere too (here: an output) keeps the exported nodes
    transposed = next(n for n in before.graph.node if n.op_type == "Transpose" and n.output[0] == "cross_k_0")
    made_by = {o: n for n in before.graph.node for o in n.output}
    gather = made_by[made_by[made_by[transposed.input[0]].input[0]].input[0]]
    before.graph.output.append(helper.make_tensor_value_info(gather.output[0], TensorProto.FLOAT, ["one", "rows", "dim"]))
    kept = kernel_graphs.with_packed_attention(before)
    onnx.checker.check_model(kept)
    ops = [n.op_type for n in kept.graph.node]
    assert ops.count("EncodeSelfAttention") == layers and "PackedToHeads" not in ops


@pytest.mark.parametrize("k", [1, 3, 64, 65, 200])  # 65 and up: the partial sort's path (200: the whole vocabulary)
def test_search_head_gives_each_rows_best_logits_in_order_with_their_log_softmax(k):
    rng = np.random.default_rng(2)
    vocab = 200  # three blocks of 64 and a tail of 8
    logits = rng.standard_normal((4, vocab), dtype=np.float32)
    logits[1, [5, 70, 150]] = logits[1].max() + 1  # equal best values: lower id first
    logits[2, 130:] = -np.inf  # suppressed ids (a bias of -inf folded into the projection)
    logits[3] = 0.5  # all equal
    session = _session(helper.make_node("SearchHead", ["logits", "candidates", "with_scores", "whole_rows"],
                                        ["scores", "ids", "whole"], domain="nmtserve"),
                       [("logits", TensorProto.FLOAT), ("candidates", TensorProto.INT64), ("with_scores", TensorProto.BOOL),
                        ("whole_rows", TensorProto.INT64)],
                       ["scores", ("ids", TensorProto.INT64), "whole"])
    expected_ids = np.argsort(-logits, axis=1, kind="stable")[:, :k]  # ties: lower id first
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    for with_scores, expected in ((True, log_probs), (False, logits)):
        for whole_rows in ([], [2, 0]):  # and those rows' logits over the whole vocabulary, unranked
            scores, ids, whole = session.run(None, {"logits": logits, "candidates": np.array([k], np.int64),
                                                    "with_scores": np.array(with_scores),
                                                    "whole_rows": np.array(whole_rows, np.int64)})
            assert ids.shape == scores.shape == (4, k) and ids.dtype == np.int64
            assert np.array_equal(ids, expected_ids)
            assert np.allclose(scores, np.take_along_axis(expected, ids, axis=1), atol=1e-5, rtol=0)
            assert whole.shape == (len(whole_rows), vocab)  # with scores or without, those rows' logits
            assert np.array_equal(whole, logits[whole_rows])
    scores, ids, _ = session.run(None, {"logits": logits, "candidates": np.array([vocab + 5], np.int64),
                                        "with_scores": np.array(True), "whole_rows": np.zeros(0, np.int64)})
    assert ids.shape == (4, vocab)  # at most the vocabulary
    for whole_rows in ([1, 1], [4]):
        with pytest.raises(Exception, match="whole_rows must name distinct rows of the batch"):
            session.run(None, {"logits": logits, "candidates": np.array([k], np.int64), "with_scores": np.array(True),
                               "whole_rows": np.array(whole_rows, np.int64)})


def test_search_head_applies_each_rows_scale_and_the_bias_when_given():
    """With row_scale (B, 1) and bias (V,) the logits are logits * row_scale + bias (int8 scales per row):
    the same candidates and log-softmax as the plain head over those logits; bad shapes are run errors."""
    rng = np.random.default_rng(5)
    raw, scale, bias = (rng.standard_normal((3, 130), dtype=np.float32), rng.uniform(0.1, 3, (3, 1)).astype(np.float32),
                        rng.standard_normal(130, dtype=np.float32))
    inputs = [("logits", TensorProto.FLOAT), ("candidates", TensorProto.INT64), ("with_scores", TensorProto.BOOL),
              ("whole_rows", TensorProto.INT64)]
    outputs = ["scores", ("ids", TensorProto.INT64), "whole"]
    plain = _session(helper.make_node("SearchHead", [n for n, _ in inputs], ["scores", "ids", "whole"], domain="nmtserve"),
                     inputs, outputs)
    for extra, logits in ((["row_scale"], raw * scale), (["row_scale", "bias"], raw * scale + bias)):
        scaled = _session(helper.make_node("SearchHead", [n for n, _ in inputs] + extra, ["scores", "ids", "whole"],
                                           domain="nmtserve"), inputs + [(n, TensorProto.FLOAT) for n in extra], outputs)
        for with_scores in (True, False):
            common = {"candidates": np.array([4], np.int64), "with_scores": np.array(with_scores),
                      "whole_rows": np.array([1], np.int64)}
            feeds = {"logits": raw, "row_scale": scale, "bias": bias}
            got = scaled.run(None, {**common, **{n: feeds[n] for n in ["logits"] + extra}})
            expected = plain.run(None, {**common, "logits": logits})
            assert np.array_equal(got[1], expected[1]) and np.allclose(got[0], expected[0], atol=1e-5)
            assert np.allclose(got[2], expected[2], atol=1e-5)
    with pytest.raises(Exception, match="row_scale must have one value a row"):
        scaled.run(None, {"logits": raw, "candidates": np.array([4], np.int64), "with_scores": np.array(True),
                          "whole_rows": np.zeros(0, np.int64), "row_scale": scale[:2], "bias": bias})


def _ops(translator: OnnxTranslator) -> list[str]:
    """The op types of the decoder step the translator runs."""
    return [n.op_type for n in _graph(translator).node]


def _graph(translator: OnnxTranslator, which: int = 1) -> onnx.GraphProto:
    """The graph the translator runs: its encoder (0) or its decoder step (1), as the bundle holds it."""
    return onnx.load(str(translator.bundle.graph_path(translator.variant, translator.graphs[which]))).graph


def _exported_without(rewrites: tuple[str, ...], checkpoint, out, monkeypatch):
    """The checkpoint exported (fp32, int8) with these kernel_graphs rewrites turned off."""
    for rewrite in rewrites:
        monkeypatch.setattr(kernel_graphs, rewrite, lambda model: None)
    export_bundle(ExportConfig(str(checkpoint), str(out), ["fp32", "int8"]))
    return out


def test_the_step_graph_swaps_ort_attention_for_the_kernels_on_a_cpu(tiny_bundle):
    offline, served = OnnxTranslator(tiny_bundle), OnnxTranslator(tiny_bundle, shared_cross=False)
    layers = offline.n_layers
    assert offline.attention_kernel and served.attention_kernel
    ops = _ops(offline)
    # offline, a beam row reads its common past from the rows that wrote it (BatchState.origin)
    assert ops.count("DecodeBeamSelfAttention") == ops.count("DecodeCrossAttention") == layers and offline.cache_origin
    assert "GroupQueryAttention" not in ops and "MultiHeadAttention" not in ops
    assert ops.count("SearchHead") == 1 and "If" not in ops  # the search head in one node
    # the server's step: its cross-attention over per-row copies (eos K/V written at the row's cross slot)
    # is a GroupQueryAttention like the self-attention, and becomes DecodeSelfAttention; its self-attention
    # reads a beam's common past through origins, as offline
    ops = _ops(served)
    assert ops.count("DecodeSelfAttention") == ops.count("DecodeBeamSelfAttention") == layers
    assert "GroupQueryAttention" not in ops and ops.count("SearchHead") == 1 and served.cache_origin
    ops = _ops(OnnxTranslator(tiny_bundle, shared_cross=False, attention_kernel=False))
    assert ops.count("GroupQueryAttention") == 2 * layers and "DecodeSelfAttention" not in ops
    assert "If" in ops and "SearchHead" not in ops and ops.count("Unsqueeze") == 2 * layers


def test_the_kernels_read_the_projections_around_them_directly(tiny_bundle, tiny_checkpoint, tiny_corpus, monkeypatch,
                                                              tmp_path):
    """Each self-attention kernel reads its (B, 3·D) projection and writes (B, D) without the exported
    Unsqueeze and Gather around it (_flat_self_attention), and the offline cross-attention its (B, D) rows
    without with_shared_cross's Reshapes (_flat_cross_attention); the step's input rows are one Embed
    (_fused_embedding); in the int8 graphs each attention kernel (the server's cross-attention, whose queries
    are concatenated with the eos K/V, excepted) reads its projection before the bias Sub and subtracts the
    negated bias itself (_bias_into_attention). The same arithmetic: the tokens and scores of the graphs
    without any of them, exactly."""
    layers = OnnxTranslator(tiny_bundle).n_layers
    for variant in ("fp32", "int8"):
        for shared_cross in (True, False):
            ops = _ops(OnnxTranslator(tiny_bundle, variant=variant, shared_cross=shared_cross))
            assert "Unsqueeze" not in ops  # the server's cross-attention too: its Concat is (B, 3·D) already
            assert "Reshape" not in ops and "Gather" not in ops and ops.count("Embed") == 1
            assert ops.count("Sub") == (layers if variant == "int8" and not shared_cross else 0)
    texts = [s for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
    found = {}
    bundle = tiny_bundle
    for arm in ("rewritten", "plain"):
        if arm == "plain":
            bundle = _exported_without(("_flat_self_attention", "_flat_cross_attention", "_fused_embedding",
                                        "_bias_into_attention"), tiny_checkpoint, tmp_path / "plain", monkeypatch)
            ops = _ops(OnnxTranslator(bundle, variant="int8"))
            assert "Sub" in ops and "Reshape" in ops and "Embed" not in ops
        for shared_cross in (True, False):
            tr = OnnxTranslator(bundle, variant="int8", shared_cross=shared_cross, intra_op_threads=1)
            sources = [tr.tokenizer.encode(t) for t in texts]
            for options in (DecodingOptions(), DecodingOptions(beam_size=4, num_hypotheses=2)):
                found[arm, shared_cross, options.beam_size] = [[(h.tokens, h.score) for h in x] for x in
                                                               tr.search_ids(sources, options, max_batch_size=8)]
    assert all(found[key] == found[("plain", *key[1:])] for key in found if key[0] == "rewritten")


def test_the_kernel_graphs_refuse_where_they_cannot_run_when_asked_and_fall_back_saying_why(tiny_bundle, monkeypatch,
                                                                                              caplog):
    with pytest.raises(ConfigError, match="not with io_binding"):
        OnnxTranslator(tiny_bundle, io_binding=True, attention_kernel=True)
    monkeypatch.setattr(kernels, "LIBRARY", kernels.LIBRARY.with_name("missing.so"))
    with pytest.raises(ConfigError, match="missing.so is not built"):
        OnnxTranslator(tiny_bundle, attention_kernel=True)
    with caplog.at_level("INFO", logger="nmtserve.runtime"):
        assert OnnxTranslator(tiny_bundle, io_binding=True).graphs == ("encoder", "decoder_shared")
        fallback = OnnxTranslator(tiny_bundle, variant="int8", shared_cross=False)
    assert not fallback.attention_kernel and fallback.graphs == ("encoder", "decoder")
    assert fallback.kernel_note.startswith("ONNX Runtime's own nodes: ") and "missing.so is not built" in fallback.kernel_note
    io_binding, record = [r for r in caplog.records if r.name == "nmtserve.runtime"]
    assert io_binding.levelname == "INFO" and "not with io_binding" in io_binding.getMessage()  # as asked: no warning
    assert record.levelname == "WARNING" and "graphs encoder and decoder" in record.getMessage()
    assert "missing.so is not built (make kernels)" in record.getMessage()
    assert "DynamicQuantizeLinear" in _ops(fallback)  # ONNX Runtime's scale per tensor


def test_a_library_built_for_a_newer_onnxruntime_api_is_not_loaded(tiny_bundle, monkeypatch):
    """The library says which C API version its headers had (nmt_ort_api_version); an onnxruntime that serves
    an older one would fail inside it, so it is refused, naming both."""
    monkeypatch.setattr(ort, "__version__", "1.20.0")
    monkeypatch.setattr(kernels, "LIBRARY", kernels.LIBRARY)  # restored after the test, with the cache cleared
    kernels._unavailable.cache_clear()
    try:
        reason = kernels.unavailable()
        assert reason is not None and "built for ONNX Runtime's API 21" in reason and "1.20.0 serves up to 20" in reason
        with pytest.raises(ConfigError, match="API 21"):
            OnnxTranslator(tiny_bundle, attention_kernel=True)
        assert not OnnxTranslator(tiny_bundle).attention_kernel
    finally:
        kernels._unavailable.cache_clear()


@pytest.mark.parametrize("shared_cross", [True, False], ids=["offline", "server-step"])
def test_searches_with_the_kernels_give_the_tokens_and_scores_of_ort_nodes(tiny_bundle, tiny_corpus, shared_cross):
    texts = [s for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
    ours, theirs = (OnnxTranslator(tiny_bundle, variant=TEST_VARIANT if TEST_VARIANT != "fp16" else "fp32",
                                   shared_cross=shared_cross, attention_kernel=kernel) for kernel in (True, False))
    sources = [ours.tokenizer.encode(t) for t in texts]
    for options, scores in ((DecodingOptions(), True), (DecodingOptions(), False),
                            (DecodingOptions(beam_size=4, num_hypotheses=2), True),
                            (DecodingOptions(sampling_topk=0, seed=7), True)):  # 0: the whole vocabulary
        for batch in (1, 8):
            a, b = (tr.search_ids(sources, options, max_batch_size=batch, scores=scores) for tr in (ours, theirs))
            assert [[h.tokens for h in x] for x in a] == [[h.tokens for h in x] for x in b]
            pairs = np.array([(h.score, g.score) for x, y in zip(a, b) for h, g in zip(x, y)])
            if scores:
                assert np.abs(pairs[:, 0] - pairs[:, 1]).max() < TEST_SCORE_TOLERANCE
            else:  # greedy without scores scores nothing
                assert np.isnan(pairs).all()


def test_row_quantize_gives_each_row_its_own_scale():
    """Against numpy: q = round(x / scale) + zero point, ties to even; scale max |x| / 127 around 128, or
    max x / 255 from 0 (a Relu's output); a row of zeros gets scale 1. Rows of 3 and 21 values (the
    vectorised loop's tail) and a leading batch axis."""
    session = _session(helper.make_node("RowQuantize", ["x", "zero_point"], ["q", "scale"], domain="nmtserve"),
                       [("x", TensorProto.FLOAT), ("zero_point", TensorProto.UINT8)], [("q", TensorProto.UINT8), "scale"])
    rng = np.random.default_rng(3)
    for shape in ((4, 21), (2, 3, 3)):
        x = (rng.standard_normal(shape) * rng.uniform(0.01, 100, shape[:-1] + (1,))).astype(np.float32)
        x[(0,) * (len(shape) - 1)] = 0  # a row of zeros
        for zero_point, levels in ((128, 127), (0, 255)):
            source = x if zero_point else np.maximum(x, 0)
            q, scale = session.run(None, {"x": source, "zero_point": np.array(zero_point, np.uint8)})
            top = np.abs(source).max(axis=-1, keepdims=True)
            safe = np.where(top > 0, top, levels)  # a row of zeros: scale 1
            expected_scale = (safe / levels).astype(np.float32)
            assert scale.shape == shape[:-1] + (1,) and np.allclose(scale, expected_scale, rtol=1e-6)
            expected = np.rint(source * (levels / safe).astype(np.float32)) + zero_point
            assert q.dtype == np.uint8 and np.abs(q.astype(int) - expected).max() <= 1  # at most a tie rounded apart
            assert np.mean(q == expected) > 0.95 and (q[(0,) * (len(shape) - 1)] == zero_point).all()
            assert np.allclose((q.astype(np.float32) - zero_point) * scale, source, atol=float(scale.max()) / 2 + 1e-6)
    with pytest.raises(Exception, match="zero_point must be one value, 128 or 0"):
        session.run(None, {"x": np.ones((1, 4), np.float32), "zero_point": np.array(7, np.uint8)})


def _row_quantized(x: np.ndarray, zero_point: int) -> tuple[np.ndarray, np.ndarray]:
    levels = 127 if zero_point else 255
    top = np.abs(x).max(axis=-1, keepdims=True)
    scale = np.where(top > 0, top / levels, 1).astype(np.float32)
    return np.rint(x / scale) + zero_point, scale


def test_add_norm_quantize_ends_a_sublayer_in_one_node():
    """Against numpy: x = product * row_scale - negated_bias + residual, its layer norm over the last axis
    (gamma, beta, epsilon), and that quantised around 128 as RowQuantize does; rows of 21 values (the
    vectorised loop's tail), a leading batch axis; a residual of another shape is refused."""
    node = helper.make_node("AddNormQuantize", ["product", "row_scale", "negated_bias", "residual", "gamma", "beta",
                                                "epsilon"], ["normed", "q", "scale"], domain="nmtserve")
    names = ["product", "row_scale", "negated_bias", "residual", "gamma", "beta", "epsilon"]
    session = _session(node, [(n, TensorProto.FLOAT) for n in names], ["normed", ("q", TensorProto.UINT8), "scale"])
    rng = np.random.default_rng(5)
    for shape in ((4, 21), (2, 3, 8)):
        feed = {"product": rng.standard_normal(shape), "row_scale": rng.uniform(0.01, 2, shape[:-1] + (1,)),
                "negated_bias": rng.standard_normal(shape[-1]), "residual": 3 * rng.standard_normal(shape),
                "gamma": rng.uniform(0.5, 2, shape[-1]), "beta": rng.standard_normal(shape[-1]), "epsilon": np.array(1e-5)}
        feed = {k: v.astype(np.float32) for k, v in feed.items()}
        normed, q, scale = session.run(None, feed)
        x = feed["product"].astype(np.float64) * feed["row_scale"] - feed["negated_bias"] + feed["residual"]
        expected = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * feed["gamma"] + feed["beta"]
        assert normed.shape == shape and np.abs(normed - expected).max() < 1e-4
        expected_q, expected_scale = _row_quantized(normed, 128)
        assert np.allclose(scale, expected_scale, rtol=1e-6) and np.abs(q.astype(int) - expected_q).max() <= 1
        assert np.mean(q == expected_q) > 0.95
    with pytest.raises(Exception, match="residual must match product"):
        session.run(None, feed | {"residual": feed["residual"][:1]})


def test_bias_relu_quantize_quantises_the_relu_of_each_scaled_row_from_zero():
    """Against numpy: Relu(product * row_scale - negated_bias) quantised from 0 (max / 255) as RowQuantize
    does after a Relu; a row that is all below zero gets scale 1 and zeros."""
    node = helper.make_node("BiasReluQuantize", ["product", "row_scale", "negated_bias"], ["q", "scale"], domain="nmtserve")
    session = _session(node, [(n, TensorProto.FLOAT) for n in ("product", "row_scale", "negated_bias")],
                       [("q", TensorProto.UINT8), "scale"])
    rng = np.random.default_rng(6)
    product = rng.standard_normal((5, 37)).astype(np.float32)
    product[0] = -np.abs(product[0]) - 10  # all below zero after the bias
    row_scale = rng.uniform(0.01, 2, (5, 1)).astype(np.float32)
    negated_bias = rng.standard_normal(37).astype(np.float32)
    q, scale = session.run(None, {"product": product, "row_scale": row_scale, "negated_bias": negated_bias})
    expected_q, expected_scale = _row_quantized(np.maximum(product * row_scale - negated_bias, 0), 0)
    assert np.allclose(scale, expected_scale, rtol=1e-6) and np.abs(q.astype(int) - expected_q).max() <= 1
    assert np.mean(q == expected_q) > 0.95 and (q[0] == 0).all() and scale[0, 0] == 1


def test_bias_swish_quantize_quantises_the_swish_of_each_scaled_row_around_128():
    """Against numpy: y · sigmoid(y), y = product * row_scale - negated_bias, quantised around 128 as RowQuantize
    does (swish can be negative, down to -0.28); values far out on both sides (no overflow of exp)."""
    node = helper.make_node("BiasSwishQuantize", ["product", "row_scale", "negated_bias"], ["q", "scale"],
                            domain="nmtserve")
    session = _session(node, [(n, TensorProto.FLOAT) for n in ("product", "row_scale", "negated_bias")],
                       [("q", TensorProto.UINT8), "scale"])
    rng = np.random.default_rng(7)
    product = (rng.standard_normal((5, 37)) * 4).astype(np.float32)
    product[0, :4] = [-200, 200, -90, 90]
    row_scale = rng.uniform(0.5, 2, (5, 1)).astype(np.float32)
    negated_bias = rng.standard_normal(37).astype(np.float32)
    q, scale = session.run(None, {"product": product, "row_scale": row_scale, "negated_bias": negated_bias})
    y = product.astype(np.float64) * row_scale - negated_bias
    expected_q, expected_scale = _row_quantized(y / (1 + np.exp(-y)), 128)
    assert np.allclose(scale, expected_scale, rtol=1e-5) and np.abs(q.astype(int) - expected_q).max() <= 1
    assert np.mean(q == expected_q) > 0.95
    with pytest.raises(Exception, match="BiasSwishQuantize: row_scale must have one value a row"):
        session.run(None, {"product": product, "row_scale": row_scale[:2], "negated_bias": negated_bias})


def test_fused_epilogues_give_the_int8_tokens_of_the_nodes_they_replace(tiny_bundle, tiny_checkpoint, tiny_corpus,
                                                                        monkeypatch, tmp_path):
    """The int8 step and encoder with the fused epilogues against the same graphs without them (RowQuantize
    after ONNX Runtime's LayerNormalization and Relu): greedy and beam 4, the same tokens for all but at
    most one of the 40 sentences, and their scores equal within 1e-4 for most and within 0.1 for all. The
    layer norm's sums are ours, in another order, which can move a value across a rounding boundary of its
    quantisation: a score a few hundredths off in a greedy sentence or two, more on hosts whose int8 kernels
    (AVX-512 VNNI) round differently, and a beam-4 sentence of this barely trained model's near-ties taking another
    path; int8's own difference from fp32, the bundle's cached_decode log_prob_diff, is larger."""
    fused = OnnxTranslator(tiny_bundle, variant="int8", intra_op_threads=1)
    assert "AddNormQuantize" in _ops(fused)
    plain = OnnxTranslator(_exported_without(("_fuse_epilogues",), tiny_checkpoint, tmp_path, monkeypatch),
                           variant="int8", intra_op_threads=1)
    assert "AddNormQuantize" not in _ops(plain)
    sources = [fused.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
    for options in (DecodingOptions(), DecodingOptions(beam_size=4)):
        found, expected = (tr.search_ids(sources, options, max_batch_size=16, scores=True) for tr in (fused, plain))
        same = [(x[0], y[0]) for x, y in zip(found, expected) if x[0].tokens == y[0].tokens]
        assert len(same) >= len(sources) - 1
        differences = [abs(x.score - y.score) for x, y in same]
        assert np.median(differences) < 1e-4 and max(differences) < 0.1


def test_int8_graphs_quantise_each_row_on_its_own_scale_with_the_kernels(tiny_bundle):
    """Every DynamicQuantizeLinear of the int8 encoder and step becomes RowQuantize, with zero point 0
    after a Relu and 128 elsewhere; without the kernels the graphs keep ONNX Runtime's per-tensor node."""
    rows, plain = (OnnxTranslator(tiny_bundle, variant="int8", attention_kernel=kernel) for kernel in (True, False))
    decoder = _graph(plain)
    quantized = sum(n.op_type == "DynamicQuantizeLinear" for n in decoder.node)
    after_relu = sum(n.op_type == "Relu" for n in decoder.node)
    graph = _graph(rows)
    ops = [n.op_type for n in graph.node]
    # each quantiser is a RowQuantize or the last part of a fused epilogue (_fuse_epilogues): a sublayer's
    # bias, residual Add, LayerNormalization and quantiser as AddNormQuantize, a bias, Relu and quantiser as
    # BiasReluQuantize; none of the step's LayerNormalizations or Relus is left
    assert ops.count("RowQuantize") + ops.count("AddNormQuantize") + ops.count("BiasReluQuantize") == quantized
    assert ops.count("BiasReluQuantize") == after_relu > 0 and ops.count("AddNormQuantize") == 3 * after_relu
    assert not {"DynamicQuantizeLinear", "LayerNormalization", "Relu"} & set(ops)
    zero_points = {i.name: int(onnx.numpy_helper.to_array(i)) for i in graph.initializer if i.name.endswith("zero_point")}
    made_by = {o: n.op_type for n in graph.node for o in n.output}
    zero_point_input = {"MatMulInteger": 2, "MatMulIntegerToFloat": 4}  # the quantised rows' zero point
    quantized_by = {n.input[0]: n.input[zero_point_input[n.op_type]] for n in graph.node if n.op_type in zero_point_input}
    for node in (n for n in graph.node if n.op_type == "RowQuantize"):
        assert zero_points[node.input[1]] == 128  # no Relu's output is left to a RowQuantize
    for node in (n for n in graph.node if n.op_type in ("AddNormQuantize", "BiasReluQuantize")):
        q = node.output[-2]  # the quantised rows, read by the next product with the matching zero point
        assert zero_points[quantized_by[q]] == (0 if node.op_type == "BiasReluQuantize" else 128)
    # the output projection: one MatMulIntegerToFloat on the weights' scale, the rows' scales in the head
    [head] = [n for n in graph.node if n.op_type == "SearchHead"]
    assert head.input[4] in {n.output[-1] for n in graph.node if n.op_type in ("RowQuantize", "AddNormQuantize")}
    assert made_by[head.input[0]] == "MatMulIntegerToFloat"
    assert "DynamicQuantizeLinear" in _ops(plain)
    assert "DynamicQuantizeLinear" not in [n.op_type for n in _graph(rows, 0).node]


@pytest.mark.parametrize("options", [DecodingOptions(), DecodingOptions(beam_size=4, num_hypotheses=2)], ids=["greedy", "beam4"])
def test_int8_results_are_the_same_in_any_batch_with_row_scales(tiny_bundle, tiny_corpus, options):
    """With a scale per row (RowQuantize) a sentence's int8 tokens and scores are the same alone and in
    batches of 4 and 40, in any order of its batch-mates; with ONNX Runtime's per-tensor scale 14 of these
    40 sentences changed between alone and a batch of 40 (greedy; docs/performance-journal.md, "int8 scales per row")."""
    tr = OnnxTranslator(tiny_bundle, variant="int8", intra_op_threads=1)
    sources = [tr.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
    alone = [tr.search_ids([s], options, max_batch_size=1, scores=True)[0] for s in sources]
    for batch, order in ((4, sources), (40, sources[::-1])):
        found = tr.search_ids(order, options, max_batch_size=batch, scores=True)
        found = found if order is sources else found[::-1]
        assert [[h.tokens for h in x] for x in found] == [[h.tokens for h in x] for x in alone]
        assert np.abs(np.array([h.score - g.score for x, y in zip(found, alone) for h, g in zip(x, y)])).max() < 1e-5


def test_a_row_quantized_matmul_adds_its_bias_once(tmp_path):
    """x @ W + b through quantize_dynamic and with_row_quantize, in a session with ONNX Runtime's
    optimisations on: each row equals numpy's product of that row quantised on its own scale, plus b.
    (ONNX Runtime would fold the bias Add into MatMulIntegerToFloat and scale the bias by each row's scale;
    with_row_quantize turns that Add into a Sub it leaves alone.)"""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    rng = np.random.default_rng(4)
    w, b = rng.standard_normal((32, 24)).astype(np.float32), 10 * rng.standard_normal(24).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["b", "xw"], ["y"])],
                              "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 24])],
                              [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(b, "b")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "fp32.onnx")
    quantize_dynamic(tmp_path / "fp32.onnx", tmp_path / "int8.onnx", weight_type=QuantType.QInt8)
    model = kernel_graphs.with_row_quantize(onnx.load(tmp_path / "int8.onnx"))
    assert [n.op_type for n in model.graph.node].count("Sub") == 1
    session = _kernel_session(model)
    x = (rng.standard_normal((5, 32)) * rng.uniform(0.1, 10, (5, 1))).astype(np.float32)
    [[w_scale], [w_q]] = [[onnx.numpy_helper.to_array(i) for i in model.graph.initializer if i.name.endswith(suffix)]
                          for suffix in ("w_scale", "w_quantized")]
    x_scale = np.abs(x).max(axis=1, keepdims=True) / 127
    expected = (np.rint(x / x_scale) @ w_q.astype(np.float32)) * x_scale * w_scale + b
    assert np.abs(session.run(None, {"x": x})[0] - expected).max() < 1e-3 * np.abs(expected).max()


@pytest.mark.parametrize("model", ["tiny", "marian"])
def test_no_row_scaled_product_has_its_bias_folded_in(tiny_bundle, marian_bundle, tmp_path, model):
    """After ONNX Runtime's optimisations, no MatMulIntegerToFloat with a scale per row takes a bias (which
    it would scale by the row's scale): the int8 graphs of the tiny model, and the Marian model's, whose
    exporter passes biases on through Identity nodes."""
    from nmtserve.export.build.variants import quantize_int8

    for graph in ("encoder", "decoder"):
        if model == "tiny":
            path = tiny_bundle / f"{graph}.int8.onnx"
        else:
            path = tmp_path / f"{graph}.int8.onnx"
            quantize_int8(marian_bundle / f"{graph}.onnx", path)
        quantized = onnx.load(str(path))
        linear = sum(n.op_type == "DynamicQuantizeLinear" for n in quantized.graph.node)
        swishes = sum(n.op_type == "Sigmoid" for n in quantized.graph.node)
        _kernel_session(kernel_graphs.with_row_quantize(quantized), tmp_path / f"{graph}.optimized.onnx")
        nodes = onnx.load(str(tmp_path / f"{graph}.optimized.onnx")).graph.node
        fused = [n for n in nodes if n.op_type == "MatMulIntegerToFloat"]
        quantizers = [n for n in nodes if n.op_type in ("RowQuantize", "AddNormQuantize", "BiasReluQuantize",
                                                        "BiasSwishQuantize")]
        assert len(quantizers) == linear > 0 and fused
        # a swish (Marian's Sub → Sigmoid, Mul) ends in BiasSwishQuantize: no Sigmoid or QuickGelu is left
        assert sum(n.op_type == "BiasSwishQuantize" for n in nodes) == swishes
        assert not any(n.op_type in ("Sigmoid", "QuickGelu") for n in nodes)
        assert all(len(n.input) < 7 or not n.input[6] for n in fused), [list(n.input) for n in fused]


def test_the_swish_epilogue_gives_the_encoder_outputs_of_the_nodes_it_replaces(marian_bundle, tmp_path, monkeypatch):
    """The Marian model's int8 encoder with its fused epilogues (BiasSwishQuantize, or BiasReluQuantize for the
    relu model, and AddNormQuantize) against the same graph without them (ONNX Runtime's nodes for the bias,
    the activation and the norm): every cross K/V within a few quantisation steps (the exponential and the
    norm's sums are nmtserve's, and a value on a rounding boundary may round the other way)."""
    from nmtserve.export.build.variants import quantize_int8

    quantize_int8(marian_bundle / "encoder.onnx", tmp_path / "encoder.int8.onnx")
    rng = np.random.default_rng(8)
    src_ids = rng.integers(4, 60, (3, 9)).astype(np.int64)
    src_mask = np.ones((3, 9), bool)
    src_mask[1, 6:] = src_mask[2, 3:] = False
    outputs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(kernel_graphs, "_fuse_epilogues", lambda model: None)
        model = kernel_graphs.with_row_quantize(onnx.load(str(tmp_path / "encoder.int8.onnx")))
        outputs.append(_kernel_session(model).run(None, {"src_ids": src_ids, "src_mask": src_mask}))
    for x, y in zip(*outputs):
        assert x.shape == y.shape and np.abs(x - y).max() < 0.05 * np.abs(y).max()
        assert np.median(np.abs(x - y)) < 1e-3 * np.abs(y).max()
