"""Packaging: one top-level import package, no shadowing by folders in the working directory, a
serving path that never imports torch or onnx, and a base install (no extras) that serves and translates."""

import json
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from nmtserve.server.config import ServerConfig
from tests.helpers import ROOT, ServerThread, run_cli


def _copy_source(dest: Path) -> Path:
    """The checkout without its environment, outputs and caches (what a source distribution holds)."""
    top = {".git", ".venv", "data", "runs", "bundles", "build", "dist", ".pytest_cache", ".ruff_cache"}
    shutil.copytree(ROOT, dest, ignore=lambda folder, names: [
        n for n in names if (Path(folder) == ROOT and n in top) or n == "__pycache__" or n.endswith(".egg-info")])
    return dest


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.mark.slow
def test_the_wheel_adds_exactly_one_top_level_package(tmp_path):
    source = _copy_source(tmp_path / "src")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = (tmp_path / "dist").glob("nmtserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"nmtserve"}
    for module in ("training/train.py", "export/runtime/translator.py", "export/build/exporter.py",
                   "export/runtime/running_batch.py", "loadtests/locustfile.py", "loadtests/slo.toml", "v1/translation_pb2.py"):
        assert f"nmtserve/{module}" in names, module


@pytest.mark.slow
def test_lint_and_collection_pass_after_a_build_in_the_checkout(tmp_path):
    """`pip install .` and `pip wheel .` leave build/ (copies of the sources, the generated stubs among them)
    and *.egg-info in the checkout: `make test`'s lint and pytest's collection must not read them."""
    source = _copy_source(tmp_path / "src")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            "-w", str(source / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    assert (source / "build" / "lib" / "nmtserve" / "v1" / "translation_pb2.py").is_file()
    ruff = Path(sys.executable).parent / "ruff"
    lint = subprocess.run([ruff, "check", "--no-cache", "."], capture_output=True, text=True, cwd=source, timeout=120)
    assert lint.returncode == 0, lint.stdout[-3000:]
    linted = subprocess.run([ruff, "check", "--show-files", "."], capture_output=True, text=True, cwd=source).stdout
    assert "export/build/exporter.py" in linted and "build/lib" not in linted, linted[-3000:]  # export/build is ours
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                               capture_output=True, text=True, cwd=source, timeout=300)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    assert "build/" not in collected.stdout, collected.stdout[-3000:]
    artefacts = ["build/lib/nmtserve/cli.py", "dist/nmtserve-0-py3-none-any.whl", "nmtserve.egg-info/PKG-INFO"]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *artefacts], capture_output=True, text=True, cwd=ROOT)
    assert ignored.stdout.split() == artefacts, ignored.stdout


def test_unrelated_server_and_export_folders_in_the_working_directory_do_not_shadow_ours(tmp_path):
    for name in ("server", "export", "training", "loadtests"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the unrelated {name} package was imported')\n")
    result = _python("import nmtserve.server.app, nmtserve.export.runtime.translator, nmtserve.training.model, "
                     "nmtserve.loadtests.slo", tmp_path)
    assert result.returncode == 0, result.stderr
    result = run_cli("serve", "--help", cwd=tmp_path)
    assert result.returncode == 0 and "--max-running-rows" in result.stdout, result.stderr


def test_the_runtime_the_server_and_the_serving_commands_never_import_torch_or_onnx(tiny_bundle, tmp_path):
    server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1))
    slo = tmp_path / "slo.toml"
    slo.write_text("max_error_rate = 0.5\n")
    stats = tmp_path / "stats_stats.csv"
    stats.write_text("Type,Name,Request Count,Failure Count,Median Response Time,Average Response Time,"
                     "Min Response Time,Max Response Time,Average Content Size,Requests/s,Failures/s,50%,66%,75%,"
                     "80%,90%,95%,98%,99%,99.9%,99.99%,100%\n"
                     "grpc,Translate,10,0,5,5,1,9,0,2.0,0.0,5,5,5,5,8,9,9,9,9,9,9\n"
                     ",Aggregated,10,0,5,5,1,9,0,2.0,0.0,5,5,5,5,8,9,9,9,9,9,9\n")
    commands = [["serve", "--help"], ["translate", "--server", server.target, "The cat sleeps."],
                ["check-slo", str(stats), "--slo", str(slo)]]
    code = f"""
import contextlib, io, pkgutil, sys, importlib
import nmtserve.cli, nmtserve.export.runtime, nmtserve.server
for package in (nmtserve.export.runtime, nmtserve.server):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
codes = []
for argv in {json.dumps(commands)}:
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            codes.append(nmtserve.cli.main(argv))
        except SystemExit as e:
            codes.append(e.code)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "onnx")
                or m.startswith(("nmtserve.training", "nmtserve.export.build")))
print(codes, loaded)
"""
    try:
        result = _python(code, tmp_path)
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[0, 0, 0] []", result.stdout


@pytest.mark.slow
def test_a_base_install_serves_and_translates_without_torch(tiny_bundle, tmp_path):
    """pip install of the project without extras, in a fresh virtual environment."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py, nmt = env_dir / "bin" / "python", env_dir / "bin" / "nmtserve"
    source = _copy_source(tmp_path / "src")
    install = subprocess.run([py, "-m", "pip", "install", "--quiet", str(source)], capture_output=True, text=True,
                             timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    for absent in ("torch", "onnx"):  # the runtime loads the bundle's graphs as they are: no graph library
        assert subprocess.run([py, "-c", f"import {absent}"], capture_output=True, cwd=tmp_path).returncode != 0, absent
    missing = subprocess.run([nmt, "train", "--max-steps", "1"], capture_output=True, text=True, cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr
    assert "needs the 'train' extra" in missing.stderr and "nmtserve[train]" in missing.stderr
    server = subprocess.Popen([nmt, "serve", str(tiny_bundle), "--host", "127.0.0.1", "--port", "0",
                               "--metrics-port", "-1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=tmp_path)
    try:
        line = server.stdout.readline()
        assert "serving on port" in line, server.stderr.read()
        result = subprocess.run([nmt, "translate", "--server", f"127.0.0.1:{line.split()[-1]}", "--json",
                                 "The cat sleeps."], capture_output=True, text=True, cwd=tmp_path, timeout=60)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["source"] == "The cat sleeps."
    finally:
        server.terminate()
        server.wait(60)


def test_a_missing_system_tool_is_a_skip_naming_it_only_where_make_was_told_not_to_install_it(monkeypatch):
    """make test SYSTEM_PACKAGES=no: a test that needs a missing Debian tool is skipped in one line naming it;
    without that, the missing tool is a failure (never a silent pass)."""
    import shutil

    import pytest

    from tests.helpers import system_tool

    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("NMTSERVE_SYSTEM_PACKAGES", "no")
    with pytest.raises(pytest.skip.Exception, match=r"^promtool is not installed and make was told SYSTEM_PACKAGES=no"):
        system_tool("promtool")
    monkeypatch.setenv("NMTSERVE_SYSTEM_PACKAGES", "yes")
    with pytest.raises(pytest.fail.Exception, match=r"`make tools` installs Debian's prometheus package"):
        system_tool("promtool")
