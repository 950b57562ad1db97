"""A real gRPC server on a free port, run on its own event loop thread, and channels to it."""

import asyncio
import threading

import grpc
import pytest

from server.app import start_server
from server.config import ServerConfig


class ServerThread:
    """start_server() on a private event loop; `stop()` drains it like SIGTERM does."""

    def __init__(self, config: ServerConfig):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running = asyncio.run_coroutine_threadsafe(start_server(config), self.loop).result(120)
        self.target = f"localhost:{self.running.port}"

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)

    def stop(self, timeout: float = 5.0) -> None:
        asyncio.run_coroutine_threadsafe(self.running.drain_and_stop(timeout), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def served(tiny_bundle):
    server = ServerThread(ServerConfig(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=0,
                                       max_sentences=8, max_sentence_chars=300, max_output_tokens=64))
    yield server
    server.stop()
