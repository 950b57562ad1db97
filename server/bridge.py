"""The bridge from the engine threads to the asyncio event loop that serves the RPCs: engine threads hand the
loop results (Wakeups.call) and streams' tokens (Inbox), with at most one wake-up of the loop pending at a time.
Knows nothing of protobuf or of the engine.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import os

# write(2) called with the GIL held (ctypes.PyDLL does not release it, as CDLL and Python's own writes do)
_LIBC = ctypes.PyDLL(None)
_LIBC.write.argtypes, _LIBC.write.restype = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t], ctypes.c_ssize_t


def _write(fd: int, hold_gil: bool) -> None:
    if hold_gil:
        _LIBC.write(fd, b"\0", 1)  # a full pipe (EAGAIN) already holds a wake-up
    else:
        try:
            os.write(fd, b"\0")
        except BlockingIOError:
            pass


class Wakeups:
    """Calls from the engine threads into the event loop, run in order there with one wake-up of the loop
    pending at a time (two engine threads racing may schedule a second one: harmless). A wake-up is a
    byte written to a pipe the loop reads (`add_reader`); one per finished request is a large cost to the engine
    thread at saturation (docs/performance-journal.md, "Waking the event loop"), where a step finishes several
    requests at once. While the engine has more work (`busy`) the byte is written with the GIL held: a write
    that released it (the loop's own `call_soon_threadsafe`) let the woken loop take the GIL and the engine
    thread wait for it mid-step; held, the loop gets it when the engine thread next lets go of it, in its next
    decoder step. An engine with nothing left to do lets it go at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.calls, self.pending = loop, collections.deque(), False
        self.reader, self.writer = os.pipe()  # not inherited by child processes (os.pipe's default)
        os.set_blocking(self.reader, False)
        os.set_blocking(self.writer, False)
        loop.add_reader(self.reader, self._run)

    def call(self, function, *args, busy: bool = False) -> None:
        """(Any thread.) Run function(*args) on the loop; wake it unless a wake-up is already on its way (busy:
        the calling engine thread goes on to another step, holding the GIL until then)."""
        self.calls.append((function, args))
        if not self.pending:
            self.pending = True
            _write(self.writer, busy)

    def _run(self) -> None:
        os.read(self.reader, 4096)  # the wake-ups written so far; one written after this line stays for the next
        self.pending = False  # before the calls are taken: a later call schedules its own wake-up
        for _ in range(len(self.calls)):
            function, args = self.calls.popleft()
            self.loop.call_soon(function, *args)  # each a handle of its own: one that raises stops no other

    def close(self) -> None:
        """(The loop's thread, once no engine thread calls any more.)"""
        self.loop.remove_reader(self.reader)
        os.close(self.reader)
        os.close(self.writer)


class Inbox:
    """A stream's tokens, from the engine thread to its handler: appended there with at most one wake-up
    of the handler pending (not a callback per token), taken by the handler all at once."""

    def __init__(self, wakeups: Wakeups):
        self.wakeups, self.items, self.ready, self.pending = wakeups, collections.deque(), asyncio.Event(), False

    def put(self, item) -> None:
        """(Engine thread.) Queue an item; wake the handler unless a wake-up is already on its way."""
        self.items.append(item)
        if not self.pending:
            self.pending = True
            self.wakeups.call(self._wake)

    def _wake(self) -> None:
        self.pending = False  # before the handler takes the items: a later put schedules its own wake-up
        self.ready.set()

    async def take(self) -> list:
        """Every item put since the last take (waits for one at least)."""
        while not self.items:
            await self.ready.wait()
            self.ready.clear()
        return [self.items.popleft() for _ in range(len(self.items))]
