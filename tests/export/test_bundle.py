"""The bundle contract: manifest contents, hashes, clear errors (the torch-free reader: tests/test_packaging.py)."""

import json
import shutil

import pytest

from nmtserve.errors import BundleError
from nmtserve.export.runtime.bundle import MANIFEST, SCHEMA_VERSION, load_bundle, sha256_of
from tests.helpers import run_cli_each


def test_manifest_records_model_graphs_variants_and_hashes(tiny_bundle, tiny_checkpoint):
    manifest = load_bundle(tiny_bundle).manifest
    assert manifest["schema_version"] == SCHEMA_VERSION
    assert manifest["model"]["d_model"] == 64 and manifest["model"]["n_decoder_layers"] == 2
    assert manifest["special_ids"] == {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    assert manifest["opset"] >= 17
    assert set(manifest["variants"]) == {"fp32", "int8"}
    decoder = manifest["graphs"]["decoder"]
    assert [i["name"] for i in decoder["inputs"]] == ["tokens", "positions", "cross_slot", "cache_slots", "source_slots",
                                                     "past_k_0", "past_v_0", "past_k_1", "past_v_1",
                                                     "cross_k_0", "cross_v_0", "cross_k_1", "cross_v_1",
                                                     "cross_eos_0", "cross_eos_1", "candidates", "with_scores",
                                                     "whole_rows", "last_position"]
    # each cache comes back as a `present` output, which the runtime binds to the same buffer; the search head's
    # candidates in place of the log-probs over the vocabulary; the stopping rule's outputs
    assert [o["name"] for o in decoder["outputs"]] == ["present_k_0", "present_v_0", "present_k_1",
                                                      "present_v_1", "present_cross_k_0", "present_cross_v_0",
                                                      "present_cross_k_1", "present_cross_v_1", "candidate_ids",
                                                      "candidate_scores", "whole_logits", "eos_candidates",
                                                      "at_budget"]
    past_k = next(i for i in decoder["inputs"] if i["name"] == "past_k_1")
    assert past_k["shape"] == ["batch", 4, "capacity", 16]
    assert [(i["dtype"], i["shape"]) for i in decoder["inputs"][2:5]] == [("int32", ["batch"]), ("int32", [1]),
                                                                         ("int32", [1])]
    assert [o["name"] for o in manifest["graphs"]["encoder"]["outputs"]] == ["cross_k_0", "cross_v_0", "cross_k_1", "cross_v_1",
                                                                             "cross_eos_0", "cross_eos_1"]
    eos = next(i for i in decoder["inputs"] if i["name"] == "cross_eos_1")
    assert eos["shape"] == ["batch", 2 * 64]  # key then value of the row's eos, heads × Dh each
    for name, entry in manifest["files"].items():
        assert sha256_of(tiny_bundle / name) == entry["sha256"]
    graphs = ["encoder", "decoder", "decoder_shared", "encoder_kernels", "decoder_kernels", "decoder_shared_kernels"]
    assert manifest["variants"]["int8"]["graphs"] == {g: f"{g}.int8.onnx" for g in graphs}
    ops = {f"ops/{op}.float32.onnx" for op in ("zeros", "pad", "concat", "take", "slice", "scatter_rows")}
    assert set(manifest["files"]) == {"spm.model", "weights.bin", "aligner.onnx", "ranker.onnx", *ops,
                                      *(f"{g}.onnx" for g in graphs), *(f"{g}.int8.onnx" for g in graphs)}
    # the aligner: a source and the tokens fed after it -> the attention at each target position (fp32, every variant's)
    assert manifest["aligner"] == "aligner.onnx"
    assert [(i["name"], i["shape"]) for i in manifest["graphs"]["aligner"]["inputs"]] == [
        ("src_ids", ["batch", "src_len"]), ("src_mask", ["batch", "src_len"]), ("target_ids", ["batch", "tgt_len"])]
    assert manifest["graphs"]["aligner"]["outputs"][0]["shape"] == ["batch", "tgt_len", "src_len"]
    assert manifest["source"]["checkpoint"] == str(tiny_checkpoint)
    assert manifest["source"]["metrics"]["valid_bleu"] >= 0
    report = manifest["optimization"]["decoder"]
    assert report["nodes_after"] < report["nodes_before"]


def test_each_attention_of_the_decoder_step_is_one_fused_node_and_int8_quantises_every_projection(tiny_bundle):
    """The step graph as written for ONNX Runtime (export/build/graphs.py): each attention one
    com.microsoft GroupQueryAttention that writes the cache in place, rows as (B, D) so each projection
    is one Gemm (self-attention's q, k, v packed into one). int8 turns those Gemms into MatMuls first,
    or dynamic quantisation would leave them fp32."""
    import collections

    import onnx

    graph = onnx.load(str(tiny_bundle / "decoder.onnx")).graph
    ops = collections.Counter(n.op_type for n in graph.node)
    assert ops["GroupQueryAttention"] == 2 * 2  # self and cross, per layer
    assert ops["Gemm"] == 6 * 2  # per layer q|k|v, out; cross q, out; ffn w1, w2
    assert not {"Softmax", "Transpose"} & set(ops) and ops["MatMul"] == 1  # no attention outside them; the logits
    caches = {name for n in graph.node if n.op_type == "GroupQueryAttention" for name in n.input[3:5]}
    assert caches == {i.name for i in graph.input if i.name.startswith(("past_", "cross_k", "cross_v"))}
    # the cross-attention "writes" each row's eos key and value, an input since schema 3: the step reads the
    # cross K/V in its attention only, no longer gathering each row's eos from them
    readers = {n.op_type for n in graph.node for name in n.input if name.startswith(("cross_k", "cross_v"))}
    assert readers == {"GroupQueryAttention"}
    # since schema 4 the slots come as inputs: no node computes them from src_mask or the caches' shapes
    attention = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert [(n.input[5], n.input[6]) for n in attention if n.input[3].startswith("cross_k")] == \
        [("cross_slot", "source_slots")] * 2
    assert {n.input[6] for n in attention if n.input[3].startswith("past_k")} == {"cache_slots"}
    assert not {"Shape", "ReduceSum"} & set(ops)
    assert all(len(n.input) == 7 for n in graph.node if n.op_type == "GroupQueryAttention")  # no attention bias (CUDA refuses one)
    int8 = collections.Counter(n.op_type for n in onnx.load(str(tiny_bundle / "decoder.int8.onnx")).graph.node)
    assert "Gemm" not in int8 and int8["MatMulInteger"] == ops["Gemm"] + 1  # and the output projection
    assert int8["GroupQueryAttention"] == ops["GroupQueryAttention"]


def test_int8_quantises_a_logits_gemm_that_shares_the_embedding_with_its_lookup(tmp_path):
    """An imported OPUS-MT model's logits are one Gemm (transB, the output bias as C) over the embedding
    matrix that the step's Gather also reads: int8 quantises a transposed copy and leaves the lookup's
    embedding as it was."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from nmtserve.export.build.variants import quantize_int8

    rng = np.random.default_rng(0)
    embedding, bias = rng.normal(size=(50, 16)).astype(np.float32), rng.normal(size=50).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["embedding", "ids"], ["vectors"]),
         helper.make_node("Gemm", ["x", "embedding", "bias"], ["logits"], transB=1)],
        "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B"]),
                 helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 16])],
        [helper.make_tensor_value_info("vectors", TensorProto.FLOAT, ["B", 16]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", 50])],
        [numpy_helper.from_array(embedding, "embedding"), numpy_helper.from_array(bias, "bias")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "fp32.onnx"))
    quantize_int8(tmp_path / "fp32.onnx", tmp_path / "int8.onnx")
    ids, x = np.array([3, 49, 0]), rng.normal(size=(3, 16)).astype(np.float32)
    session = ort.InferenceSession(str(tmp_path / "int8.onnx"), providers=["CPUExecutionProvider"])
    vectors, logits = session.run(None, {"ids": ids, "x": x})
    assert np.array_equal(vectors, embedding[ids])
    expected = x @ embedding.T + bias
    assert np.abs(logits - expected).max() < 0.05 * np.abs(expected).max()
    assert "MatMulInteger" in {n.op_type for n in onnx.load(str(tmp_path / "int8.onnx")).graph.node}


def test_cpu_sessions_leave_the_int8_encoders_add_and_layer_norm_unfused(tiny_bundle, tmp_path, monkeypatch):
    """ONNX Runtime would fuse each residual Add and LayerNormalization of the int8 encoder into
    SkipLayerNormalization, whose CPU kernel is slower than the two; CPU sessions leave that fusion out
    (the kernels a session made by make_session runs, from its profile), and so does the manifest's count."""
    import numpy as np

    from nmtserve.export.build.variants import optimized_op_counts
    from nmtserve.export.runtime import sessions

    path = tiny_bundle / "encoder.int8.onnx"
    assert optimized_op_counts(path, disabled_optimizers=[]).get("SkipLayerNormalization", 0) > 0
    assert "SkipLayerNormalization" not in optimized_op_counts(path)
    plain = sessions.session_options

    def profiled(threads=0):
        options = plain(threads)
        options.enable_profiling, options.profile_file_prefix = True, str(tmp_path / "profile")
        return options
    monkeypatch.setattr(sessions, "session_options", profiled)
    session = sessions.make_session(path)
    src_ids = np.array([[5, 6, 7, 3]])
    session.run(None, {"src_ids": src_ids, "src_mask": src_ids != 0})
    kernels = {e["args"]["op_name"] for e in json.loads(open(session.end_profiling()).read())
               if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")}
    assert "LayerNormalization" in kernels and "SkipLayerNormalization" not in kernels


@pytest.fixture()
def bundle_copy(tiny_bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, copy)
    return copy

@pytest.mark.parametrize("variant", ["fp32", "int8"])
def test_the_encoders_matmuls_run_on_the_real_tokens_only(tiny_bundle, tmp_path, variant):
    """Padding removal: a batch of a 1-token and a 20-token source is 21 real tokens in 2 × 20 slots;
    ONNX Runtime's profile shows each encoder projection and feed-forward multiplying 21 rows, not
    40, and the cross K/V coming out as (2, H, 20, Dh) rows all the same."""
    import numpy as np
    import onnxruntime as ort

    from nmtserve.export.runtime.sessions import session_options

    options = session_options(1)
    options.enable_profiling, options.profile_file_prefix = True, str(tmp_path / "profile")
    name = "encoder.onnx" if variant == "fp32" else "encoder.int8.onnx"
    session = ort.InferenceSession(str(tiny_bundle / name), options, providers=["CPUExecutionProvider"])
    src_ids = np.zeros((2, 20), np.int64)
    src_ids[0, 0], src_ids[1] = 5, np.arange(6, 26)
    outputs = session.run(None, {"src_ids": src_ids, "src_mask": src_ids != 0})
    assert outputs[0].shape[0] == 2 and outputs[0].shape[2] == 20
    events = json.loads(open(session.end_profiling()).read())
    products = [e["args"]["input_type_shape"][0] for e in events if e.get("cat") == "Node" and
                e["name"].endswith("_kernel_time") and e["args"]["op_name"] in
                ("MatMul", "Gemm", "FusedMatMul", "MatMulIntegerToFloat", "DynamicQuantizeMatMul")]
    rows = [shape[next(iter(shape))][-2] for shape in products]  # {"float": [1, T, D]} -> T
    assert len(rows) >= 6 and set(rows) == {21}


def test_missing_truncated_and_modified_files_are_named(bundle_copy):
    (bundle_copy / "encoder.int8.onnx").unlink()
    with pytest.raises(BundleError, match=r"encoder\.int8\.onnx: missing from the bundle"):
        load_bundle(bundle_copy)
    data = (bundle_copy / "decoder.onnx").read_bytes()
    shutil.copy(bundle_copy / "encoder.onnx", bundle_copy / "encoder.int8.onnx")
    manifest = json.loads((bundle_copy / MANIFEST).read_text())
    manifest["files"]["encoder.int8.onnx"] = manifest["files"]["encoder.onnx"]
    (bundle_copy / MANIFEST).write_text(json.dumps(manifest))
    (bundle_copy / "decoder.onnx").write_bytes(data[:-100])
    with pytest.raises(BundleError, match=r"decoder\.onnx: truncated: \d+ bytes, manifest says \d+"):
        load_bundle(bundle_copy)
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0xFF
    (bundle_copy / "decoder.onnx").write_bytes(bytes(flipped))
    with pytest.raises(BundleError, match=r"decoder\.onnx: sha256 mismatch"):
        load_bundle(bundle_copy)


def test_schema_and_manifest_problems_are_named(bundle_copy, tmp_path):
    manifest = json.loads((bundle_copy / MANIFEST).read_text())
    (bundle_copy / MANIFEST).write_text(json.dumps({**manifest, "schema_version": 99}))
    with pytest.raises(BundleError, match=f"schema_version 99, this nmtserve reads {SCHEMA_VERSION}"):
        load_bundle(bundle_copy)
    (bundle_copy / MANIFEST).write_text("{not json")
    with pytest.raises(BundleError, match="manifest.json: not valid JSON"):
        load_bundle(bundle_copy)
    with pytest.raises(BundleError, match="manifest.json: missing"):
        load_bundle(tmp_path)


def test_export_of_missing_or_corrupt_checkpoint_is_one_line_exit_2(tmp_path):
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a checkpoint at all")
    absent, unreadable, fp8 = run_cli_each(("export", str(tmp_path / "absent.pt"), "--out", str(tmp_path / "b")),
                                           ("export", str(corrupt), "--out", str(tmp_path / "b")),
                                           ("export", str(corrupt), "--out", str(tmp_path / "b"), "--variants", "fp8"))
    for result, expected in ((absent, "absent.pt: no such checkpoint"), (unreadable, "corrupt.pt: not a readable checkpoint"),
                             (fp8, "--variants 'fp8'")):
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and expected in result.stderr, result.stderr


def test_languages_come_from_the_corpus_summary_unless_flags_say_otherwise(tiny_corpus):
    from nmtserve.export.build.exporter import ExportConfig, languages

    payload = {"train_config": {"data": str(tiny_corpus)}}
    assert languages(ExportConfig("ckpt", "out"), payload) == {"source": "en", "target": "fr"}
    assert languages(ExportConfig("ckpt", "out", target_lang="de"), payload) == {"source": "en", "target": "de"}
    assert languages(ExportConfig("ckpt", "out"), {"train_config": {"data": None}}) == {"source": "", "target": ""}


def test_every_large_tensor_is_in_the_weights_file_once_and_every_graph_points_into_it(tiny_bundle):
    """The graphs of both variants hold no large initializer of their own: each is ONNX external data in
    weights.bin, where a tensor that several graphs hold (the tied embedding, every weight the kernel graphs share
    with the portable ones) is stored once, page-aligned."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    from nmtserve.export.build.step_graphs import ALIGNMENT, EXTERNAL_MIN_BYTES

    bundle = load_bundle(tiny_bundle)
    places, held = {}, 0
    for variant in bundle.variants:
        for graph in bundle.variant(variant)["graphs"]:
            model = onnx.load(str(bundle.graph_path(variant, graph)), load_external_data=False)
            for tensor in model.graph.initializer:
                if uses_external_data(tensor):
                    info = ExternalDataInfo(tensor)
                    assert info.location == "weights.bin" and info.offset % ALIGNMENT == 0, tensor.name
                    places.setdefault((info.offset, info.length), set()).add(tensor.name)
                    held += info.length
                else:
                    assert len(tensor.raw_data) < EXTERNAL_MIN_BYTES, (graph, tensor.name)
    size = (tiny_bundle / "weights.bin").stat().st_size
    stored = sum(length for _, length in places)
    assert stored <= size < stored + ALIGNMENT * len(places)  # each distinct tensor once, plus its alignment
    assert held > 2 * stored  # the 12 graphs point at each stored byte several times: inline, it would be repeated
    embedding = [names for names in places.values() if "model.embed.weight" in names]
    assert len(embedding) == 1  # one copy for the encoders, the decoders and both variants



def test_a_tied_output_projection_reads_a_copy_of_its_own_stored_apart_from_the_table(marian_bundle):
    """An imported OPUS-MT model's logits are a Gemm over the embedding table that the step's lookup reads too:
    each decoder graph's Gemm reads a copy of its own (ONNX Runtime packs it and frees it, where the table stays
    mapped for the lookup, which touches the rows it reads), stored once in the weights file, apart from the table,
    with the same values; the encoders read the table."""
    import numpy as np
    import onnx
    from onnx.external_data_helper import ExternalDataInfo

    from nmtserve.export.build.step_graphs import PROJECTION

    def stored(tensor) -> tuple[int, np.ndarray]:
        info = ExternalDataInfo(tensor)
        values = np.fromfile(marian_bundle / "weights.bin", np.float32, info.length // 4, offset=info.offset)
        return info.offset, values

    bundle = load_bundle(marian_bundle)
    places = set()
    for graph in bundle.variant("fp32")["graphs"]:
        model = onnx.load(str(bundle.graph_path("fp32", graph)), load_external_data=False)
        initializers = {t.name: t for t in model.graph.initializer}
        readers = {name: [n.op_type for n in model.graph.node if name in n.input] for name in initializers}
        copies = [name for name in initializers if name.endswith(PROJECTION)]
        if graph.startswith("encoder"):
            assert not copies and readers["model.embed.weight"], graph
            continue
        assert len(copies) == 1 and readers[copies[0]] == ["Gemm"], (graph, copies)
        assert "Gemm" not in readers["model.embed.weight"], graph
        (own, own_values), (table, table_values) = stored(initializers[copies[0]]), \
            stored(initializers["model.embed.weight"])
        assert own != table and np.array_equal(own_values, table_values)
        places.add(own)
    assert len(places) == 1  # one copy for every decoder graph
