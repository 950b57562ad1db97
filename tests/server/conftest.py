"""A real gRPC server on a free port, shared by a test module."""

import pytest

from nmtserve.server.config import ServerConfig
from tests.helpers import ServerThread


@pytest.fixture(scope="module")
def served(tiny_bundle):
    server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=0,
                                       max_sentences=8, max_sentence_chars=300, max_decoding_length=64))
    yield server
    server.stop()
