"""Writing a bundle's manifest.json: file hashes and graph signatures (the reader is export/runtime/bundle.py)."""

from __future__ import annotations

import json
from pathlib import Path

import onnx

from nmtserve.export.runtime.bundle import MANIFEST, SCHEMA_VERSION, sha256_of


def file_entry(path: Path) -> dict:
    return {"sha256": sha256_of(path), "bytes": path.stat().st_size}


def graph_signature(onnx_path: Path) -> dict:
    """Inputs and outputs of an ONNX graph: name, element type and shape (symbolic dims by name)."""
    model = onnx.load(str(onnx_path), load_external_data=False)

    def describe(values):
        out = []
        for v in values:
            t = v.type.tensor_type
            shape = [d.dim_param or d.dim_value for d in t.shape.dim]
            out.append({"name": v.name, "dtype": onnx.TensorProto.DataType.Name(t.elem_type).lower(), "shape": shape})
        return out

    return {"inputs": describe(model.graph.input), "outputs": describe(model.graph.output)}


def bundle_files(manifest: dict) -> set[str]:
    """Every graph the variants and the device-tensor ops list, the aligner, the ranker, and the weights file they
    point into."""
    files = {f for ops in manifest.get("tensor_ops", {}).values() for f in ops.values()} | {manifest["weights"]}
    files |= {manifest["aligner"]} if manifest.get("aligner") else set()
    files |= {manifest["ranker"]} if manifest.get("ranker") else set()
    for variant in manifest["variants"].values():
        files |= set(variant["graphs"].values())
    return files


def write_manifest(bundle_dir: Path, manifest: dict) -> Path:
    """Add the hash of every listed file and write manifest.json."""
    files = sorted(set(manifest["tokenizer"]["files"]) | bundle_files(manifest))
    manifest = {"schema_version": SCHEMA_VERSION, **manifest,
                "files": {name: file_entry(bundle_dir / name) for name in files}}
    path = bundle_dir / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path
