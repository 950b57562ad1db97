"""The committed stubs in nmtserve/v1 are what protoc generates from protos/ today."""

import subprocess
import sys

from tests.helpers import ROOT


def test_generated_stubs_match_the_proto(tmp_path):
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", "nmtserve/v1/translation.proto"],
                   check=True, cwd=ROOT)
    for name in ("translation_pb2.py", "translation_pb2.pyi", "translation_pb2_grpc.py"):
        generated = (tmp_path / "nmtserve" / "v1" / name).read_text()
        committed = (ROOT / "nmtserve" / "v1" / name).read_text()
        assert generated == committed, f"nmtserve/v1/{name} is stale: run `make protos`"
