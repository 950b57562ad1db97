"""The committed stubs in nmtserve/v1 and the API reference in docs/api.md are what protos/ gives today."""

import re
import runpy
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


def test_the_api_reference_is_the_protos_and_names_every_status_code_the_server_returns():
    """docs/api.md is protos/apidoc.py's rendering of the .proto's comments today, it describes every RPC, message,
    field and enum value (none without a comment), and its status codes are the ones server/ answers with."""
    from nmtserve.v1 import translation_pb2 as pb

    apidoc = runpy.run_path(str(ROOT / "protos" / "apidoc.py"))
    file = apidoc["descriptor"]()
    assert (ROOT / "docs" / "api.md").read_text() == apidoc["markdown"](file), "docs/api.md is stale: run `make protos`"
    described = {tuple(loc.path) for loc in file.source_code_info.location if loc.leading_comments.strip()}
    paths = [(6, 0)] + [(6, 0, 2, m) for m in range(len(file.service[0].method))]
    for i, message in enumerate(file.message_type):
        paths += [(4, i)] + [(4, i, 2, j) for j in range(len(message.field))]
    for i, enum in enumerate(file.enum_type):
        paths += [(5, i)] + [(5, i, 2, j) for j in range(len(enum.value))]
    assert not [p for p in paths if p not in described], "an element of the .proto has no comment to describe it"
    assert len(pb.DESCRIPTOR.message_types_by_name) == len(file.message_type)
    answered = set()
    for path in (ROOT / "server").glob("*.py"):
        answered |= set(re.findall(r"grpc\.StatusCode\.([A-Z_]+)", path.read_text()))  # not OpenTelemetry's
    documented = {code for code, _ in apidoc["STATUS_CODES"]}
    assert answered and answered <= documented, f"status codes server/ answers with but docs/api.md omits: {answered - documented}"
