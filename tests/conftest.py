"""Session fixtures: a small built-in corpus, a tiny trained checkpoint and its bundle, made once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from nmtserve.export.runtime.bundle import MANIFEST, sha256_of
from nmtserve.training.corpus import generate_corpus
from nmtserve.training.train import train
from tests.helpers import TEST_DEVICE, system_tool, tiny_config


def pytest_report_header(config) -> str:
    """Which kernels the CPU translators of this run load: the library's graphs, or the portable ones and why."""
    from nmtserve.export.runtime import kernels

    reason = kernels.unavailable()
    return (f"nmtserve kernels: {kernels.LIBRARY}" if reason is None
            else f"nmtserve kernels: unavailable, the bundles' portable graphs run ({reason})")


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """400 train pairs from the built-in generator, seed 7."""
    out = tmp_path_factory.mktemp("corpus")
    generate_corpus(out, 400, seed=7, valid=40, test=40, novel=20, workers=2)
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_corpus, tmp_path_factory) -> Path:
    """A tiny model trained for a few seconds: enough to exercise evaluate/translate, not to translate well."""
    out = tmp_path_factory.mktemp("run")
    train(tiny_config(out, tiny_corpus, max_steps=40, valid_every=20))
    return out / "best.pt"


@pytest.fixture(scope="session")
def tiny_bundle(tiny_checkpoint, tmp_path_factory) -> Path:
    """A bundle (fp32 and int8; fp16 too when the tests run on CUDA) exported from the tiny checkpoint."""
    from nmtserve.export.build.exporter import ExportConfig, export_bundle

    out = tmp_path_factory.mktemp("bundle")
    export_bundle(ExportConfig(str(tiny_checkpoint), str(out), ["fp32", "int8"] + (["fp16"] if TEST_DEVICE == "cuda" else [])))
    return out


@pytest.fixture(scope="session")
def eosless_bundle(tiny_bundle, tmp_path_factory) -> Path:
    """tiny_bundle as a model that never says eos would run: its decoder steps' stopping rule never sees eos
    (step_graphs.with_stop_rule's eos constant replaced by -1), so greedy runs each row to its budget. Searches
    read eos in Python: a test sets the translator's eos_id to -1 for them too."""
    import onnx
    from onnx import numpy_helper

    out = tmp_path_factory.mktemp("eosless") / "bundle"
    shutil.copytree(tiny_bundle, out)
    manifest = json.loads((out / MANIFEST).read_text())
    for name in {f for v in manifest["variants"].values() for g, f in v["graphs"].items() if g.startswith("decoder")}:
        model = onnx.load(str(out / name), load_external_data=False)
        eos = next(t for t in model.graph.initializer if t.name == "stop.eos")
        eos.CopyFrom(numpy_helper.from_array(np.array(-1, np.int64), "stop.eos"))
        onnx.save(model, str(out / name))
        manifest["files"][name] = {"sha256": sha256_of(out / name), "bytes": (out / name).stat().st_size}
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out


# two tiny random Marian (OPUS-MT layout) directories: swish with scaled embeddings,
# relu with unscaled embeddings and different encoder and decoder depths
MARIAN_CONFIGS = {
    "swish": dict(activation="swish", scale_embedding=True, encoder_layers=2, decoder_layers=2, seed=0),
    "relu": dict(activation="relu", scale_embedding=False, encoder_layers=3, decoder_layers=1, seed=1, fp16=True),
}


@pytest.fixture(scope="session", params=list(MARIAN_CONFIGS))
def marian_dir(request, tmp_path_factory) -> Path:
    from nmtserve.loadtests.marian_model import build_marian_dir

    return build_marian_dir(tmp_path_factory.mktemp(f"marian-{request.param}"), **MARIAN_CONFIGS[request.param])


@pytest.fixture(scope="session")
def nllb_dir(tmp_path_factory) -> Path:
    """A tiny NLLB folder, as transformers saves one (loadtests/m2m100_model.py)."""
    from nmtserve.loadtests.m2m100_model import build_m2m100_dir

    return build_m2m100_dir(tmp_path_factory.mktemp("nllb") / "nllb-tiny", family="nllb")


@pytest.fixture(scope="session")
def marian_checkpoint(marian_dir, tmp_path_factory) -> Path:
    from nmtserve.training.marian import import_marian

    out = tmp_path_factory.mktemp("marian-ckpt") / "model.pt"
    import_marian(marian_dir, out, "en", "fr")
    return out


@pytest.fixture(scope="session")
def marian_bundle(marian_checkpoint, tmp_path_factory) -> Path:
    """The imported Marian checkpoint exported (fp32)."""
    from nmtserve.export.build.exporter import ExportConfig, export_bundle

    out = tmp_path_factory.mktemp("marian-bundle")
    export_bundle(ExportConfig(str(marian_checkpoint), str(out), ["fp32"]))
    return out


@pytest.fixture(scope="session")
def fr_en_bundle(tmp_path_factory) -> Path:
    """A tiny random Marian model whose SentencePiece models learnt French sources and English targets,
    imported as fr→en and exported (fp32): a second model with other languages than tiny_bundle's."""
    from nmtserve.export.build.exporter import ExportConfig, export_bundle
    from nmtserve.loadtests.marian_model import ENGLISH, FRENCH, build_marian_dir
    from nmtserve.training.marian import import_marian

    tmp = tmp_path_factory.mktemp("fr-en")
    directory = build_marian_dir(tmp / "marian", source_words=FRENCH, target_words=ENGLISH, seed=3)
    import_marian(directory, tmp / "model.pt", "fr", "en")
    export_bundle(ExportConfig(str(tmp / "model.pt"), str(tmp / "bundle"), ["fp32"]))
    return tmp / "bundle"


@pytest.fixture
def kernel_library():
    """nmtserve's kernel library, which the tests that use this need: built (make kernels), or, where make was told not
    to install g++ (SYSTEM_PACKAGES=no) and it is missing, a skip naming g++."""
    from nmtserve.export.runtime import kernels

    if not kernels.available():
        system_tool("g++")
    return kernels.LIBRARY
