"""Progress of long jobs: lines in pipes (a start, each stage with the elapsed time and the estimate left, the
end), a tqdm bar on a terminal."""

import re

from nmtserve.console import Progress, duration


def test_lines_in_a_pipe_say_the_stage_the_elapsed_time_and_the_estimate(capsys):
    with Progress("export b", total=3, unit="stage", lines=True) as progress:
        progress.stage("graphs")
        progress.stage("int8")
        progress.stage("verify")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "export b: started (3 stages)"
    assert re.fullmatch(r"export b \[0/3, \d+\.\d s\]: graphs", lines[1]), lines[1]
    assert re.fullmatch(r"export b \[2/3, \d+\.\d s, about \d+\.\d s left\]: verify", lines[3]), lines[3]
    assert re.fullmatch(r"export b: done, 3 stages in \d+\.\d s", lines[4]), lines[4]
    assert len(lines) == 5


def test_a_terminal_gets_a_bar_and_a_total_learnt_later(capsys):
    with Progress("bench offline", unit="measurement", lines=False) as progress:
        progress.expect(4)
        progress.update(2)
    err = capsys.readouterr().err
    assert "bench offline:" in err and "2/4" in err and "started" not in err


def test_durations_read_as_people_write_them():
    assert [duration(s) for s in (4.24, 185, 3720)] == ["4.2 s", "3 min 05 s", "1 h 02 min"]


def test_a_failed_job_prints_nothing_more_than_what_it_did(capsys):
    """Its error is the one line that follows; a job that failed before any work printed nothing at all."""
    try:
        with Progress("export b", total=3, unit="stage", lines=True):
            raise ValueError("no such checkpoint")
    except ValueError:
        pass
    assert capsys.readouterr().err == ""
    try:
        with Progress("export b", total=3, unit="stage", lines=True) as progress:
            progress.stage("graphs")
            raise ValueError("bad graph")
    except ValueError:
        pass
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "export b: started (3 stages)" and lines[1].endswith(": graphs") and len(lines) == 2
