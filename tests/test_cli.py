"""The command line as a whole: every command listed, environment variables read inside the error
handling (one line, exit 2, for every command), unknown commands refused in one line."""

from nmtserve.cli import COMMANDS
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
