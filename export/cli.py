"""The `export` command (the train extra): checkpoint → verified ONNX bundle.

    nmtserve export runs/default/average.pt --out bundles/default --variants fp32,int8 --verify
"""

from __future__ import annotations

import sys

from nmtserve.console import Progress, print_json


def cmd_export(args) -> int:
    from nmtserve.export.build.exporter import ExportConfig, export_bundle, parse_variants

    cfg = ExportConfig(args.checkpoint, args.out, parse_variants(args.variants), args.verify, args.verify_split,
                       args.verify_limit, args.source_lang, args.target_lang)
    with Progress(f"export {args.out}", total=1 + len(cfg.variants) + cfg.verify, unit="stage") as progress:
        manifest = export_bundle(cfg, progress)
    report = manifest.get("verification")
    if args.json:
        print_json(manifest)
    else:
        print(f"wrote bundle {args.out} with variants {', '.join(manifest['variants'])}")
        if report:
            for name, ok in report["checks"].items():
                print(f"  {'pass' if ok else 'FAIL'}  {name}")
            for name, why in report["not_measured"].items():
                print(f"  not measured  {name}: {why}")
    if report and not report["passed"]:
        failed = [name for name, ok in report["checks"].items() if not ok]
        print(f"nmtserve export: verification failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def add_parser(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text)
    p.add_argument("checkpoint")
    p.add_argument("--out", required=True, help="bundle directory")
    p.add_argument("--variants", default="fp32,int8", help="comma-separated: fp32, int8 (CPU), fp16 (CUDA)")
    p.add_argument("--verify", action="store_true", help="check the bundle against PyTorch (exit 1 if a check fails)")
    p.add_argument("--verify-split", default="test", help="data split for the end-to-end checks (default %(default)s)")
    p.add_argument("--verify-limit", type=int, default=0, help="only the first N pairs of that split (0: all)")
    p.add_argument("--source-lang", default="", help="source language code for the manifest "
                   "(default: the training data's corpus.json; the built-in corpus is en)")
    p.add_argument("--target-lang", default="", help="target language code (likewise; the built-in corpus is fr)")
    p.add_argument("--json", action="store_true", help="print the manifest")
    p.set_defaults(func=cmd_export)
