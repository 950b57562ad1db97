"""A bundle exported from the session's tiny checkpoint (fp32 and int8)."""

import pytest

from export.exporter import ExportConfig, export_bundle


@pytest.fixture(scope="session")
def tiny_bundle(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle")
    export_bundle(ExportConfig(str(tiny_checkpoint), str(out), ["fp32", "int8"]))
    return out
