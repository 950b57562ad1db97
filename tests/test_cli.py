"""The command line as a whole: every command listed, environment variables read inside the error
handling (one line, exit 2, for every command), unknown commands refused in one line."""

from nmtserve.cli import COMMANDS, _parse, build_parser
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
