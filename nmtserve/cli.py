"""The `nmtserve` command line: one table from command to the module that owns it, and the error handling.

    nmtserve data --out data/ --pairs 200000 --seed 1                  # nmtserve.training (train extra)
    nmtserve train --data data/ --out runs/small --max-minutes 20
    nmtserve evaluate runs/small/best.pt --split test --json
    nmtserve average runs/small/step_*.pt --out runs/small/average.pt
    nmtserve import ~/models/opus-mt-en-de --out runs/opus-en-de.pt
    nmtserve export runs/small/average.pt --out bundles/small --verify  # nmtserve.export (train extra)
    nmtserve serve bundles/small --port 50051                           # nmtserve.server (base install)
    nmtserve api-key web-frontend --model en-fr >> keys.toml            # serve --api-keys keys.toml
    nmtserve translate --server localhost:50051 "The cat sleeps."       # base install; CHECKPOINT TEXT… needs train
    nmtserve models --server localhost:50051                            # what a server serves (ListModels)
    nmtserve bench offline|served bundles/small                         # nmtserve.loadtests
    nmtserve loadtest bundles/small --scenario steady                                # loadtest extra
    nmtserve check-slo runs/loadtest/steady --slo loadtests/slo.toml    # base install

Only the chosen command's module is imported, so a serving install without torch runs serve,
translate --server, models and check-slo. Every error, NMTSERVE_* variables included, is one line on
stderr and exit status 2; a missing optional dependency names the extra to install.

One spelling per concept across the commands (tests/test_cli.py walks every parser to keep it so): a
bundle is positional, the length limit is --max-decoding-length, languages are --source-lang and
--target-lang, a file of sentences is --sentences-file and a count --sentences, --json prints the result as
JSON on stdout, --report PATH writes a benchmark's report; every command takes --log-level and --log-format.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import nmtserve
from nmtserve import logs
from nmtserve.errors import NmtserveError

EXIT_USAGE = 2
LOG_LEVELS = ("debug", "info", "warning", "error")

# command: (module that adds its parser and runs it, one-line help for `nmtserve --help`)
COMMANDS = {
    "data": ("nmtserve.training.cli", "generate the built-in English→French corpus"),
    "train": ("nmtserve.training.cli", "train a model"),
    "average": ("nmtserve.training.cli", "average checkpoints of one run"),
    "import": ("nmtserve.training.cli", "import a local Hugging Face model folder (OPUS-MT, M2M100, NLLB) as a checkpoint"),
    "evaluate": ("nmtserve.training.cli", "BLEU and chrF of a checkpoint or bundle, any decoding mode"),
    "translate": ("nmtserve.translate", "translate sentences through a server, or with a bundle or checkpoint"),
    "models": ("nmtserve.translate", "list what a server serves: models, languages, limits, decoding defaults"),
    "export": ("nmtserve.export.cli", "export a checkpoint to an ONNX bundle"),
    "serve": ("nmtserve.server.cli", "serve a bundle over gRPC (flags also read NMTSERVE_* variables)"),
    "api-key": ("nmtserve.server.cli", "make a client's API key: the key on stderr, its --api-keys entry on stdout"),
    "bench": ("nmtserve.loadtests.cli", "benchmarks: offline (engines side by side), served, models, documents, cross-kv"),
    "loadtest": ("nmtserve.loadtests.cli", "run a locust scenario headless against a server"),
    "check-slo": ("nmtserve.loadtests.cli", "check a load test's results against service-level objectives"),
    "soak": ("nmtserve.loadtests.cli", "sustained mixed and odd traffic; exit 1 on a wrong status, a leak or a stuck gauge"),
}

# top-level module of an optional dependency -> the extra that installs it
EXTRAS = {"torch": "train", "pyrealb": "train", "sacrebleu": "train", "tensorboard": "train", "tqdm": "train",
          "safetensors": "train", "transformers": "marian",
          "locust": "loadtest", "gevent": "loadtest", "matplotlib": "loadtest", "ctranslate2": "bench",
          "opentelemetry": "otel"}


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but an error is a single line."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser(command: str | None) -> ArgumentParser:
    """Every command is listed; only `command`'s module is imported to add its arguments."""
    parser = ArgumentParser(prog="nmtserve", description="Train, export to ONNX and serve an encoder-decoder "
                            "Transformer for translation. `nmtserve COMMAND --help` for each command.")
    parser.add_argument("--version", action="version", version=f"nmtserve {nmtserve.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    for name, (module, help_text) in COMMANDS.items():
        if name == command:
            importlib.import_module(module).add_parser(sub, name, help_text)
            for leaf in command_parsers(sub.choices[name]):
                leaf.add_argument("--log-level", choices=LOG_LEVELS, default=_default_log_level(name),
                                  help="the least severe log records shown on stderr (env NMTSERVE_LOG_LEVEL; "
                                       "default %(default)s)")
                leaf.add_argument("--log-format", choices=logs.FORMATS, default=_default_log_format(name),
                                  help="json: one JSON object a line, for log collectors; text: for a terminal (env "
                                       "NMTSERVE_LOG_FORMAT; default %(default)s)")
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def command_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers that run something under `parser`: itself, or each of its subcommands' (bench offline, …)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [parser]
    return [leaf for child in subs[0].choices.values() for leaf in command_parsers(child)]


def _default_log_level(command: str) -> str:
    """NMTSERVE_LOG_LEVEL, else info for the server (its load and lifecycle) and warning for the others."""
    level = os.environ.get("NMTSERVE_LOG_LEVEL", "").lower()
    if level and level not in LOG_LEVELS:
        raise NmtserveError(f"NMTSERVE_LOG_LEVEL {level!r}: choose from {', '.join(LOG_LEVELS)}")
    return level or ("info" if command == "serve" else "warning")


def _default_log_format(command: str) -> str:
    """NMTSERVE_LOG_FORMAT, else json for the server (read by collectors) and text for the others."""
    fmt = os.environ.get("NMTSERVE_LOG_FORMAT", "").lower()
    if fmt and fmt not in logs.FORMATS:
        raise NmtserveError(f"NMTSERVE_LOG_FORMAT {fmt!r}: choose from {', '.join(logs.FORMATS)}")
    return fmt or ("json" if command == "serve" else "text")


def _listed_positional(parser: ArgumentParser, command: str | None) -> str | None:
    """The dest of `command`'s one positional that takes a list of words (nargs * or +: translate's
    MODEL_OR_TEXT, serve's bundles, average's checkpoints), else None."""
    sub = next((a for a in parser._actions if isinstance(a.choices, dict)), None)  # the commands
    command_parser = sub.choices.get(command) if sub is not None and command else None
    listed = [a.dest for a in getattr(command_parser, "_actions", []) if not a.option_strings and a.nargs in ("*", "+")]
    return listed[0] if len(listed) == 1 else None


def _parse(parser: ArgumentParser, command: str | None, argv: list[str]):
    """parse_args, except that words after options still join a command's list of positional words (argparse
    gives one only the words before the first option: `translate BUNDLE --beam-size 4 TEXT`, `serve
    BUNDLE --port 50051 BUNDLE2`)."""
    args, rest = parser.parse_known_args(argv)
    listed = _listed_positional(parser, command)
    words = getattr(args, listed) if listed else None  # its default when it took no word: not a list
    if rest and isinstance(words, list) and not any(a.startswith("-") for a in rest):
        words.extend(rest)
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def _missing_extra(e: ModuleNotFoundError) -> str | None:
    extra = EXTRAS.get((e.name or "").split(".")[0])
    return extra and f"needs the '{extra}' extra (no module named {e.name!r}): pip install 'nmtserve[{extra}]'"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    command = command if command in COMMANDS else None
    prefix = f"nmtserve {command or ''}".strip()
    try:
        args = _parse(build_parser(command), command, argv)
        logs.configure(args.log_level, args.log_format)
        return args.func(args)
    except (NmtserveError, OSError, ValueError) as e:
        print(f"{prefix}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ModuleNotFoundError as e:
        missing = _missing_extra(e)
        if missing and not os.environ.get("NMTSERVE_DEBUG"):
            print(f"{prefix}: error: {missing}", file=sys.stderr)
            return EXIT_USAGE
        return _internal_error(prefix, e)
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        return _internal_error(prefix, e)


def _internal_error(prefix: str, e: Exception) -> int:
    """A bug, not a user error: still one line, the traceback on request."""
    if os.environ.get("NMTSERVE_DEBUG"):
        raise e
    first = str(e).splitlines()[0][:300] if str(e) else ""
    print(f"{prefix}: internal error: {type(e).__name__}: {first} (set NMTSERVE_DEBUG=1 for the traceback)",
          file=sys.stderr)
    return 1

if __name__ == "__main__":
    sys.exit(main())
