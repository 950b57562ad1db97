"""checkpoint -> bundle directory.

    nmtserve export runs/default/average.pt --out bundles/default --variants fp32,int8 --verify
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import onnx

import nmtserve
from nmtserve.errors import ConfigError
from nmtserve.export.build.graphs import OPSET, dynamic_axes, export_graphs
from nmtserve.export.build.manifest import bundle_files, graph_signature, write_manifest
from nmtserve.export.build.ranker import write_ranker
from nmtserve.export.build.step_graphs import ALIGNER, WEIGHTS, WeightStore, file_name, prepare_variant
from nmtserve.export.build.tensor_ops import write_tensor_ops
from nmtserve.export.build.variants import VARIANTS, fusion_report, write_variant
from nmtserve.export.runtime.bundle import MANIFEST, load_bundle, sha256_of
from nmtserve.training.checkpoint import load_model


@dataclass
class ExportConfig:
    checkpoint: str
    out: str
    variants: list[str] = field(default_factory=lambda: ["fp32", "int8"])
    verify: bool = False
    verify_split: str = "test"  # split of the checkpoint's data directory for the end-to-end checks
    verify_limit: int = 0  # 0: the whole split
    source_lang: str = ""  # default: the `languages` of the training data's corpus.json, if any
    target_lang: str = ""


def languages(cfg: ExportConfig, payload: dict) -> dict:
    """{"source", "target"} language codes: the flags, else the checkpoint's (an imported model's), else
    the training data's corpus.json, else ""."""
    found = {"source": "", "target": "", **(payload.get("languages") or {})}
    data = (payload.get("train_config") or {}).get("data")
    summary = Path(data) / "corpus.json" if data else None
    if summary is not None and summary.is_file() and not payload.get("languages"):
        try:
            found.update(json.loads(summary.read_text(encoding="utf-8")).get("languages") or {})
        except (OSError, ValueError):
            pass  # an unreadable summary only costs the language codes
    if cfg.source_lang:
        found["source"] = cfg.source_lang
    if cfg.target_lang:
        found["target"] = cfg.target_lang
    return {"source": str(found["source"]), "target": str(found["target"])}


def parse_variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise ConfigError(f"--variants {text!r}: choose from {', '.join(VARIANTS)}")
    return list(dict.fromkeys(["fp32", *names]))  # fp32 is always there: the others derive from it


def export_bundle(cfg: ExportConfig, progress=None) -> dict:
    """Write the bundle; returns its manifest (with verification results when asked). `progress` (console.Progress)
    is told each stage: the graphs, each variant, the verification."""
    def stage(name: str) -> None:
        if progress is not None:
            progress.stage(name)

    loaded = load_model(cfg.checkpoint)
    out = Path(cfg.out)
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise ConfigError(f"--out {out}: exists, is not empty and is not a bundle; choose another directory")
    out.mkdir(parents=True, exist_ok=True)
    c = loaded.model.config
    # the exported graphs and each precision's, in a folder of their own (a model over 2 GB has its tensors in files
    # beside them), until prepare_variant has written the served graphs over the bundle's one weights file
    with tempfile.TemporaryDirectory(dir=out, prefix=".export-") as exported:
        stage("the fp32 graphs from PyTorch")
        paths = export_graphs(loaded.model, Path(exported))
        for name in cfg.variants:
            if name != "fp32":
                for graph in ("encoder", "decoder"):
                    write_variant(name, paths[graph], Path(exported) / file_name(graph, name))
        eos = loaded.tokenizer.special_ids()["eos"]
        with WeightStore(out / WEIGHTS) as weights:
            variants = {}
            for name in cfg.variants:
                stage(f"the {name} variant's graphs")
                variants[name] = {"graphs": prepare_variant(Path(exported), out, name, c.n_heads, c.d_model, eos,
                                                            "cpu" in VARIANTS[name]["devices"], weights),
                                  **VARIANTS[name]}
            aligner = onnx.load(str(paths["aligner"]))  # fp32 for every variant: it decides no token
            weights.externalize(aligner)
            onnx.save(aligner, str(out / ALIGNER))
    tokenizer = loaded.tokenizer.save_files(out)
    served = {g: out / file_name(g, "fp32") for g in ("encoder", "decoder")}  # the manifest describes these
    signatures = {**{g: graph_signature(p) for g, p in served.items()}, "aligner": graph_signature(out / ALIGNER)}
    optimization = {g: fusion_report(p) for g, p in served.items()}
    tensor_ops = {dtype: write_tensor_ops(out, dtype) for dtype in sorted({v["kv_dtype"] for v in variants.values()})}
    ranker = write_ranker(out)
    kept = bundle_files({"variants": variants, "tensor_ops": tensor_ops, "weights": WEIGHTS, "aligner": ALIGNER,
                         "ranker": ranker})
    for stale in [*out.glob("*.onnx"), *out.glob("ops/*.onnx")]:  # a re-export leaves nothing behind
        if str(stale.relative_to(out)) not in kept:
            stale.unlink()

    payload = loaded.payload
    manifest = {
        "format": "nmtserve-bundle",
        "created_by": f"nmtserve {nmtserve.__version__}",
        "model": {k: getattr(c, k) for k in ("vocab_size", "d_model", "n_heads", "d_ff", "n_encoder_layers",
                                             "n_decoder_layers", "pre_norm", "max_len", "positions",
                                             "activation", "scale_embedding", "output_bias", "source_vocab_size",
                                             "tied_output")},
        "languages": languages(cfg, payload),
        "tokenizer": tokenizer,
        "special_ids": loaded.tokenizer.special_ids(),
        "limits": {"max_source_tokens": c.max_len, "max_target_tokens": c.max_len},
        "opset": OPSET,
        "graphs": {g: {**signatures[g], "dynamic_axes": dynamic_axes(c.n_decoder_layers)[g]} for g in signatures},
        "variants": variants,
        "tensor_ops": tensor_ops,
        "weights": WEIGHTS,
        "aligner": ALIGNER,
        "ranker": ranker,
        "optimization": optimization,
        # an imported model's generation defaults (DecodingOptions names): the server's defaults
        "decoding_defaults": payload.get("decoding_defaults") or {},
        "source": {"checkpoint": str(cfg.checkpoint), "sha256": sha256_of(Path(cfg.checkpoint)),
                   "step": payload.get("step"), "metrics": payload.get("metrics"),
                   "data": (payload.get("train_config") or {}).get("data")},
    }
    if "imported_from" in payload:
        manifest["source"]["imported_from"] = {k: payload["imported_from"][k] for k in ("format", "directory", "files")}
    if cfg.verify:
        from nmtserve.export.build.verify import verify_bundle

        write_manifest(out, manifest)  # verification reads the bundle as the server will
        stage("verify against PyTorch")
        manifest["verification"] = verify_bundle(out, loaded, split=cfg.verify_split, limit=cfg.verify_limit)
    write_manifest(out, manifest)
    return load_bundle(out).manifest
