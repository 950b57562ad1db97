"""One command from a Hugging Face model folder: `nmtserve import DIR` reads the family from config.json and names
what it found where it is not supported; `nmtserve translate DIR` and `nmtserve serve DIR` make the folder's bundle
once, into a cache keyed by the sha256 of its files, and reuse it until a file changes."""

from __future__ import annotations

import json
import shutil

import pytest

from nmtserve.export.runtime.bundle import MANIFEST, SCHEMA_VERSION
from nmtserve.export.runtime.translator import OnnxTranslator
from nmtserve.hf_folder import bundle_for, cache_dir, folder_key
from nmtserve.server.config import ServerConfig
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.helpers import ServerThread, run_cli, run_cli_each


@pytest.mark.parametrize("marian_dir", ["swish"], indirect=True)
def test_import_reads_the_family_and_names_what_is_not_supported(nllb_dir, marian_dir, tmp_path):
    bart = tmp_path / "bart"
    bart.mkdir()
    (bart / "config.json").write_text(json.dumps({"model_type": "bart"}))
    results = run_cli_each(["import", str(nllb_dir), "--out", str(tmp_path / "nllb.pt")],
                           ["import", str(marian_dir), "--out", str(tmp_path / "marian.pt")],
                           ["import", str(bart), "--out", str(tmp_path / "bart.pt")],
                           ["import", str(tmp_path), "--out", str(tmp_path / "none.pt")])
    assert [r.returncode for r in results] == [0, 0, 2, 2]
    assert (tmp_path / "nllb.pt").is_file() and (tmp_path / "marian.pt").is_file()
    for refused, found in zip(results[2:], ['model_type "bart": not supported', "no config.json"]):
        assert len(refused.stderr.strip().splitlines()) == 1 and found in refused.stderr, refused.stderr
        assert "marian (OPUS-MT), m2m_100 (M2M100, NLLB)" in refused.stderr


def test_a_folder_is_translated_and_served_from_its_cached_bundle(nllb_dir, tmp_path, monkeypatch):
    folder = tmp_path / "nllb-tiny"
    shutil.copytree(nllb_dir, folder)
    cache = tmp_path / "cache"
    env = {"NMTSERVE_CACHE": str(cache)}
    # what an older nmtserve left for this folder (its schema's bundles under the key alone, then with their schema):
    # never reused, whichever the manifest says
    key = folder_key(folder)[:32]
    for stale, schema in ((key, SCHEMA_VERSION - 1), (f"{key}-schema{SCHEMA_VERSION - 1}", SCHEMA_VERSION - 1)):
        (cache / "bundles" / stale).mkdir(parents=True)
        (cache / "bundles" / stale / MANIFEST).write_text(json.dumps({"schema_version": schema}))
    first = run_cli("translate", str(folder), "--source-lang", "eng_Latn", "--target-lang", "deu_Latn",
                    "The cat sees the dog.", env=env)
    assert first.returncode == 0 and "importing and exporting it once" in first.stderr, first.stderr
    monkeypatch.setenv("NMTSERVE_CACHE", str(cache))
    bundle = bundle_for(folder, log=lambda line: None)
    assert bundle == str(cache_dir() / "bundles" / f"{key}-schema{SCHEMA_VERSION}")
    expected = OnnxTranslator(bundle).translate_batch(["The cat sees the dog."], source_language="eng_Latn",
                                                      target_language="deu_Latn")[0].text
    assert first.stdout.strip() == expected
    server = ServerThread(ServerConfig.from_flags(bundle=str(folder), host="127.0.0.1", port=0, metrics_port=0))
    try:  # the cached bundle, under the folder's name
        with server.channel() as channel:
            stub = pb_grpc.TranslationServiceStub(channel)
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).model == "nllb-tiny"
            served = stub.Translate(pb.TranslateRequest(sentences=["The cat sees the dog."], source_language="eng_Latn",
                                                        target_language="deu_Latn", options=pb.DecodingOptions(
                                                            beam_size=1)), timeout=30)
    finally:
        server.stop()
    assert served.translations[0].text == expected
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "max_length": 20}))
    changed = bundle_for(folder, log=lambda line: None)  # a changed file: a new bundle, the old one kept
    assert changed != bundle and (cache / "bundles" / bundle.split("/")[-1] / MANIFEST).is_file()
    assert json.loads((cache / "bundles" / changed.split("/")[-1] / MANIFEST).read_text())["decoding_defaults"][
        "max_decoding_length"] == 19
