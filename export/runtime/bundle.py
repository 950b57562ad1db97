"""The bundle: the contract between export and server. Torch-free and onnx-free.

A directory holding, per precision variant, every graph the runtime runs, as export prepared and verified it
(export/build/step_graphs.py: the encoder, the served and offline decoder steps, and their versions on
nmtserve's kernels), one weights file they all point into (each tensor once), the device-tensor op graphs, the SentencePiece
model, the aligner graph (attention weights), the ranker graph (beam search's ranking) and manifest.json (schema version, model dimensions, special ids, limits, opset, the exported graphs'
inputs and outputs, the variants, the sha256 and size of every file, the source checkpoint and its measured
BLEU). export/build/manifest.py writes it; `load_bundle` refuses a bundle whose schema or any file does not
match, naming the file and what is wrong. Nothing here edits a graph.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from nmtserve.decoding import Limits
from nmtserve.errors import BundleError

SCHEMA_VERSION = 8  # 5: each variant lists every graph the runtime runs (search head, shared cross, kernels), their
# large initializers in one weights file; 6: the search head gives the whole rows' logits (whole_logits); 7: the
# ranker graph (beam search's ranking); 8: the decoder steps' stopping rule (last_position in, eos_candidates and
# at_budget out), the ranker's eos among the k best (eos in, ended out)
MANIFEST = "manifest.json"


def default_variant(device: str) -> str:
    """The variant a device runs when none is named: fp32 on a CPU, fp16 on CUDA (the only one it takes)."""
    return "fp16" if device == "cuda" else "fp32"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class Bundle:
    """A checked bundle directory and its manifest."""

    path: Path
    manifest: dict

    @property
    def model(self) -> dict:
        return self.manifest["model"]

    @property
    def limits(self) -> Limits:
        return Limits(self.manifest["limits"]["max_source_tokens"], self.manifest["limits"]["max_target_tokens"])

    @property
    def special_ids(self) -> dict[str, int]:
        return self.manifest["special_ids"]

    @property
    def variants(self) -> list[str]:
        return list(self.manifest["variants"])

    def variant(self, variant: str) -> dict:
        """The manifest's entry of a precision variant (graphs, devices, kv_dtype)."""
        if variant not in self.manifest["variants"]:
            raise BundleError(f"{self.path}: no variant {variant!r}; this bundle has {', '.join(self.variants)}")
        return self.manifest["variants"][variant]

    def has_graph(self, variant: str, graph: str) -> bool:
        return graph in self.variant(variant)["graphs"]

    def graph_path(self, variant: str, graph: str) -> Path:
        """The file of one of a variant's graphs (export/build/step_graphs.py names them)."""
        graphs = self.variant(variant)["graphs"]
        if graph not in graphs:
            raise BundleError(f"{self.path}: variant {variant!r} has no graph {graph!r}; it has {', '.join(graphs)}")
        return self.path / graphs[graph]

    @property
    def aligner_path(self) -> Path | None:
        """The aligner graph's file (export/build/graphs.py), which gives a translation's attention; None in a
        bundle exported before it existed."""
        name = self.manifest.get("aligner")
        return self.path / name if name else None

    @property
    def ranker_path(self) -> Path:
        """The ranker graph's file (export/build/ranker.py): beam search's ranking, one for every variant."""
        return self.path / self.manifest["ranker"]

    def tensor_ops(self, variant: str) -> dict[str, dict[str, Path]]:
        """The device-tensor op graphs (export/build/tensor_ops.py) for the variant's caches:
        {element type: {op: path}}."""
        dtype = self.variant(variant)["kv_dtype"]
        ops = self.manifest.get("tensor_ops", {}).get(dtype)
        if ops is None:
            raise BundleError(f"{self.path}: no device-tensor ops for {dtype} (variant {variant!r})")
        return {dtype: {op: self.path / file for op, file in ops.items()}}

    def tokenizer(self):
        from nmtserve.tokenizer import from_bundle

        try:
            return from_bundle(self.path, self.manifest.get("tokenizer"))
        except (OSError, ValueError) as e:
            raise BundleError(f"{self.path}: tokenizer: {e}") from None


def load_bundle(path: str | Path, verify_hashes: bool = True) -> Bundle:
    """Read and check a bundle: schema version, presence, size and sha256 of every file."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise BundleError(f"{path}: no such bundle directory")
    if not manifest_path.is_file():
        raise BundleError(f"{manifest_path}: missing; not an nmtserve bundle (export one with `nmtserve export`)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{manifest_path}: not valid JSON ({e})") from None
    version = manifest.get("schema_version") if isinstance(manifest, dict) else None
    if version != SCHEMA_VERSION:
        raise BundleError(f"{manifest_path}: schema_version {version!r}, this nmtserve reads {SCHEMA_VERSION} "
                          "(export the bundle again with `nmtserve export`)")
    for key in ("model", "special_ids", "variants", "files", "graphs", "limits", "weights", "ranker"):
        if key not in manifest:
            raise BundleError(f"{manifest_path}: missing field {key!r}")
    for name, entry in manifest["files"].items():
        _check_file(path / name, entry, verify_hashes)
    return Bundle(path, manifest)


def _check_file(file: Path, entry: dict, verify_hash: bool) -> None:
    if not file.is_file():
        raise BundleError(f"{file}: missing from the bundle (listed in {MANIFEST})")
    size = file.stat().st_size
    if size != entry["bytes"]:
        what = "truncated" if size < entry["bytes"] else "larger than recorded"
        raise BundleError(f"{file}: {what}: {size} bytes, manifest says {entry['bytes']}")
    if verify_hash:
        digest = sha256_of(file)
        if digest != entry["sha256"]:
            raise BundleError(f"{file}: sha256 mismatch: found {digest[:12]}…, manifest says {entry['sha256'][:12]}…; "
                              f"the file was modified after export")
