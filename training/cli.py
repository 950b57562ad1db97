"""Commands of nmtserve.training: data, train, average, import, evaluate (the train extra).

    nmtserve data --out data/default --pairs 200000 --seed 1
    nmtserve train --data data/default --out runs/default --max-minutes 20
    nmtserve average runs/default/step_*.pt --out runs/default/average.pt
    nmtserve import ~/models/opus-mt-en-de --out runs/opus-en-de.pt
    nmtserve evaluate runs/default/best.pt --split test --json
    nmtserve evaluate bundles/default --split novel --beam-size 4 --length-penalty 1
"""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

from nmtserve.console import Progress, print_json
from nmtserve.errors import NmtserveError


# ---------------------------------------------------------------- data
def cmd_data(args) -> int:
    from nmtserve.training.corpus import generate_corpus

    for name in ("pairs", "valid", "test", "novel"):
        if getattr(args, name) < (1 if name == "pairs" else 0):
            raise NmtserveError(f"--{name} {getattr(args, name)}: must be positive")
    total = args.pairs + args.valid + args.test + args.novel
    with Progress(f"data {args.out}", total=total, unit="pair") as progress:
        stats = generate_corpus(Path(args.out), args.pairs, seed=args.seed, valid=args.valid, test=args.test,
                                novel=args.novel, workers=args.workers, progress=progress)
    summary = {"out": args.out, **stats.__dict__}
    if args.json:
        print_json(summary)
    else:
        w = stats.written
        print(f"wrote {w['train']} train, {w['valid']} valid, {w['test']} test, {w['novel']} novel pairs to {args.out}; "
              f"dropped {stats.dropped_unrealisable} unrealisable, {stats.dropped_duplicate} duplicates")
    return 0


# ---------------------------------------------------------------- train / average
def cmd_train(args) -> int:
    from nmtserve.training.train import TrainConfig, train

    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    summary = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, one process reports
        print_json(summary) if args.json else print(
            f"trained {summary['steps']} steps; best valid BLEU {summary['best_valid_bleu']:.2f}; checkpoints in {cfg.out}")
    return 0


def cmd_average(args) -> int:
    from nmtserve.training.checkpoint import average

    print(average(args.checkpoints, args.out))
    return 0


def cmd_import(args) -> int:
    from nmtserve.training.hf_import import import_model

    summary = import_model(args.directory, args.out, args.source_lang, args.target_lang)
    if args.json:
        print_json(summary)
    else:
        c = summary["model_config"]
        print(f"imported {args.directory}: {summary['parameters']:,} parameters, {c['n_encoder_layers']}+"
              f"{c['n_decoder_layers']} layers, d_model {c['d_model']}, {c['activation']}; wrote {args.out}")
    return 0


# ---------------------------------------------------------------- evaluate
def _split_pairs(args) -> tuple[list[tuple[str, str]], str]:
    """The pairs to score: --file's, or a split of the data the model was trained on (a checkpoint's
    train_config, a bundle's manifest)."""
    from nmtserve.training.data import read_corpus, split_file

    if args.file:
        corpus = read_corpus(args.file)
        return corpus.pairs, corpus.source
    data_dir = args.data or _trained_on(args.model)
    if not data_dir:
        raise NmtserveError("no evaluation data: give --data DIR or --file FILE [TARGET_FILE]")
    path = split_file(data_dir, args.split)
    return read_corpus([path]).pairs, str(path)


def _trained_on(model: str) -> str | None:
    if Path(model).is_dir():
        from nmtserve.export.runtime.bundle import load_bundle

        return load_bundle(model).manifest.get("source", {}).get("data")
    from nmtserve.training.checkpoint import read

    return (read(model).get("train_config") or {}).get("data")  # the payload only: no model is built


EVALUATE_CHUNK = 512  # sentences translated between two updates of evaluate's progress


def cmd_evaluate(args) -> int:
    from nmtserve.local import given_options, local_translator
    from nmtserve.training.evaluate import calibration, score

    pairs, source = _split_pairs(args)
    if args.limit:
        pairs = pairs[: args.limit]
    if not pairs:
        raise NmtserveError(f"{source}: no sentence pairs to evaluate")
    if args.calibration < 0:
        raise NmtserveError(f"--calibration {args.calibration}: must be at least 1 group (0: no calibration)")
    if args.calibration and not Path(args.model).is_dir():
        raise NmtserveError(f"--calibration: {args.model} is a checkpoint, whose PyTorch reference gives no confidence; "
                            "give a bundle")
    translate, best = local_translator(args.model, args), []
    with Progress(f"evaluate {args.model}", total=len(pairs), unit="sentence") as progress:
        for start in range(0, len(pairs), EVALUATE_CHUNK):  # results do not depend on the batches: chunks only count
            chunk = [s for s, _ in pairs[start:start + EVALUATE_CHUNK]]
            best += [hypotheses[0] for hypotheses in translate(chunk)]
            progress.update(len(chunk))
    hyps, references = [found.text for found in best], [t for _, t in pairs]
    scores = score(hyps, references)
    result = {"model": str(args.model), "engine": "onnxruntime" if Path(args.model).is_dir() else "pytorch",
              "decoding": given_options(args), "data": source, "split": None if args.file else args.split,
              **scores.to_dict()}
    if args.calibration:
        result["calibration"] = calibration([found.confidence for found in best], hyps, references, args.calibration)
    if args.output:
        Path(args.output).write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    if args.json:
        print_json(result)
    else:
        print(f"{source}: BLEU {scores.bleu:.2f}  chrF {scores.chrf:.2f}  exact {scores.exact_match:.1%}  "
              f"({scores.sentences} sentences)")
        if args.calibration:
            print(f"{'confidence':>15}  {'sentences':>9}  {'exact':>6}  {'chrF':>6}  {'BLEU':>6}")
            for group in result["calibration"]:
                low, high = group["confidence"]
                print(f"{low:.3f} – {high:.3f}  {group['sentences']:>9}  {group['exact_match']:>6.1%}  "
                      f"{group['chrf']:>6.2f}  {group['bleu']:>6.2f}")
    return 0


# ---------------------------------------------------------------- parsers
def _add_train_args(p) -> None:
    from nmtserve.training.model import PRESETS
    from nmtserve.training.train import TrainConfig

    d = TrainConfig()
    p.add_argument("--out", default=d.out, help="run directory: checkpoints, logs, TensorBoard (default %(default)s)")
    p.add_argument("--data", default=d.data, help="a directory written by `nmtserve data`")
    p.add_argument("--train", nargs="+", metavar="FILE", help="a TSV file (source<TAB>target) or a Moses pair SRC TGT")
    p.add_argument("--valid", nargs="+", metavar="FILE", help="validation data, same forms as --train")
    p.add_argument("--preset", default=d.preset, choices=list(PRESETS), help="model size (default %(default)s)")
    p.add_argument("--pre-norm", action="store_true", help="pre-LN residual blocks instead of the paper's post-LN")
    p.add_argument("--dropout", type=float, default=d.dropout)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="SentencePiece vocabulary size (upper bound)")
    p.add_argument("--max-pair-tokens", dest="max_len", type=int, default=d.max_len,
                   help="skip training pairs with more tokens than this on either side (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="padded tokens per batch")
    p.add_argument("--lr-factor", type=float, default=d.lr_factor, help="scales the paper's learning-rate schedule")
    p.add_argument("--warmup", type=int, default=d.warmup, help="warm-up steps of the schedule")
    p.add_argument("--label-smoothing", type=float, default=d.label_smoothing)
    p.add_argument("--clip-norm", type=float, default=d.clip_norm, help="gradient clipping (0: off)")
    p.add_argument("--max-steps", type=int, default=d.max_steps)
    p.add_argument("--max-minutes", type=float, default=d.max_minutes, help="wall-clock training budget")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--valid-every", type=int, default=d.valid_every, help="validate and checkpoint every N steps")
    p.add_argument("--valid-bleu-sentences", type=int, default=d.valid_bleu_sentences)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    p.add_argument("--average-last", type=int, default=d.average_last,
                   help="at the end, average the last N periodic checkpoints into average.pt")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--resume", action="store_true", help="continue exactly from OUT/last.pt")
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--json", action="store_true")


def add_parser(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text)
    if name == "data":
        p.add_argument("--out", required=True, help="output directory")
        p.add_argument("--pairs", type=int, default=200_000, help="training pairs (default %(default)s)")
        p.add_argument("--valid", type=int, default=1000)
        p.add_argument("--test", type=int, default=2000)
        p.add_argument("--novel", type=int, default=1000,
                       help="test pairs whose (subject, verb, object) never occur in train")
        p.add_argument("--seed", type=int, default=1)
        p.add_argument("--workers", type=int, default=None,
                       help="processes (default: all cores); output does not depend on it")
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=cmd_data)
    elif name == "train":
        _add_train_args(p)
        p.set_defaults(func=cmd_train)
    elif name == "average":
        p.add_argument("checkpoints", nargs="+")
        p.add_argument("--out", required=True)
        p.set_defaults(func=cmd_average)
    elif name == "import":
        p.add_argument("directory", help="a local Hugging Face model folder: Marian (OPUS-MT), M2M100 or NLLB")
        p.add_argument("--out", required=True, help="the checkpoint to write")
        p.add_argument("--source-lang", default="", help="source language code (default: tokenizer_config.json's)")
        p.add_argument("--target-lang", default="", help="target language code (default: tokenizer_config.json's)")
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=cmd_import)
    elif name == "evaluate":
        from nmtserve.local import add_bundle_flags, add_decoding_flags

        p.add_argument("model", help="a checkpoint (the PyTorch reference) or a bundle directory (ONNX Runtime)")
        p.add_argument("--split", default="test", help="split of the data directory (default %(default)s)")
        p.add_argument("--data", help="data directory (default: the one the checkpoint was trained on)")
        p.add_argument("--file", nargs="+", metavar="FILE", help="evaluate on a TSV file or a Moses pair instead")
        p.add_argument("--limit", type=int, default=0, help="only the first N pairs")
        p.add_argument("--batch-size", type=int, default=128)
        p.add_argument("--output", help="write the translations here")
        p.add_argument("--calibration", type=int, default=0, metavar="GROUPS",
                       help="(a bundle) also cut the sentences by confidence into this many groups of equal size and "
                            "give each group's exact-match share, chrF and BLEU")
        p.add_argument("--device", default="cpu")
        add_bundle_flags(p)
        add_decoding_flags(p)
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=cmd_evaluate)
    else:
        raise ValueError(f"nmtserve.training.cli has no command {name!r}")
