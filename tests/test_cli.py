"""The command line as a whole: every command listed, environment variables read inside the error
handling (one line, exit 2, for every command), unknown commands refused in one line, one spelling per
concept across the commands, --version and --log-level."""

import argparse

from nmtserve import __version__
from nmtserve.cli import COMMANDS, _parse, build_parser, command_parsers
from tests.helpers import run_cli


def test_help_lists_every_command():
    result = run_cli("--help")
    assert result.returncode == 0
    assert all(name in result.stdout for name in COMMANDS)


def test_a_bad_nmtserve_variable_is_one_line_naming_it_for_every_command(tmp_path):
    env = {"NMTSERVE_PORT": "abc"}
    result = run_cli("serve", "--help", env=env)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "NMTSERVE_PORT='abc': expected int" in result.stderr
    # commands that do not serve never read it, and their own errors stay one line
    result = run_cli("check-slo", str(tmp_path / "none"), "--slo", str(tmp_path / "slo.toml"), env=env)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "no such SLO file" in result.stderr, result.stderr


def test_an_unknown_command_is_one_line_exit_2():
    result = run_cli("serv")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "invalid choice: 'serv'" in result.stderr


def test_words_after_options_join_a_commands_list_of_positional_words():
    """argparse gives a positional list only the words before the first option; nmtserve's commands take
    them wherever they are (translate's texts, serve's bundles, average's checkpoints)."""
    for argv, dest, expected in ((["translate", "BUNDLE", "--beam-size", "4", "a", "b"], "inputs", ["BUNDLE", "a", "b"]),
                                 (["serve", "en-fr", "--port", "50051", "fr-en"], "bundle", ["en-fr", "fr-en"]),
                                 (["average", "a.pt", "--out", "avg.pt", "b.pt"], "checkpoints", ["a.pt", "b.pt"])):
        assert getattr(_parse(build_parser(argv[0]), argv[0], argv), dest) == expected
    # a command without such a list still refuses a stray word, in one line
    result = run_cli("bench", "offline", "BUNDLE", "--runs", "1", "stray")
    assert result.returncode == 2 and result.stderr.strip().endswith("unrecognized arguments: stray"), result.stderr


def _every_parser():
    """(command words, parser) of every command that runs something: serve, bench offline, …"""
    for name in COMMANDS:
        sub = next(a for a in build_parser(name)._actions if isinstance(a, argparse._SubParsersAction))
        for leaf in command_parsers(sub.choices[name]):
            yield leaf.prog.removeprefix("nmtserve ").split(), leaf


# each concept's one spelling, and the spellings it replaced
RETIRED = {"--max-len": "--max-decoding-length", "--max-length": "--max-decoding-length",
           "--max-output-tokens": "--max-decoding-length", "--source-language": "--source-lang",
           "--target-language": "--target-lang", "--bundle": "a positional BUNDLE",
           "--flooded-sentences": "--flooded-sentences-file", "--probed-sentences": "--probed-sentences-file"}


def test_every_command_spells_each_concept_one_way():
    """A walk over every command's parser: no retired spelling; --json is always a flag (print JSON on stdout);
    --sentences is always a count and every file of sentences is --…sentences-file; the length limit and the
    languages take one name; a bundle is positional; every command has --log-level."""
    walked = 0
    for words, parser in _every_parser():
        walked += 1
        options = {o: a for a in parser._actions for o in a.option_strings}
        where = " ".join(words)
        assert not set(options) & set(RETIRED), f"{where}: {sorted(set(options) & set(RETIRED))}"
        assert "--log-level" in options, where
        if "--json" in options:
            assert options["--json"].nargs == 0, f"{where}: --json takes a value"
        for option, action in options.items():
            if option.endswith("sentences"):
                assert action.type is int, f"{where}: {option} is not a count"
            if "sentences-file" in option or "file" == option.removeprefix("--"):
                assert action.type is None and action.nargs in (None, "+"), f"{where}: {option}"
        positional = [a.dest for a in parser._actions if not a.option_strings]
        if "bundle" in parser.format_usage().lower() and words[0] not in ("translate", "evaluate", "export"):
            assert "bundle" in positional or {"flooded", "probed"} <= set(positional), f"{where}: {positional}"
    assert walked >= len(COMMANDS) + 4  # bench's five subcommands


def test_version_and_log_level():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"nmtserve {__version__}"
    result = run_cli("check-slo", "x", "--slo", "y", "--log-level", "loud")
    assert result.returncode == 2 and "--log-level: invalid choice: 'loud'" in result.stderr, result.stderr
    result = run_cli("check-slo", "x", "--slo", "y", env={"NMTSERVE_LOG_LEVEL": "loud"})
    assert result.returncode == 2 and result.stderr.strip() == \
        "nmtserve check-slo: error: NMTSERVE_LOG_LEVEL 'loud': choose from debug, info, warning, error", result.stderr
