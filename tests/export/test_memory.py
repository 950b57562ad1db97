"""glibc's malloc as OnnxTranslator leaves it (export/runtime/memory.py): freed memory kept for the next batch."""

import subprocess
import sys

import pytest

# In a fresh process: OnnxTranslator over the bundle (argv[1]), keeping freed memory or not (argv[2]), then the
# minor page faults of rounds that fill and free 48 MB in 96 kB blocks (below glibc's default mmap threshold:
# from the heap, whose top glibc trims at each free by default)
FAULTS_PER_ROUND = """
import resource, sys, numpy as np
from nmtserve.export.runtime.translator import OnnxTranslator
OnnxTranslator(sys.argv[1], keep_freed_memory=sys.argv[2] == "keep")
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def one_round():
    blocks = [np.ones(12_000) for _ in range(500)]
    del blocks
one_round()
before = faults()
for _ in range(5):
    one_round()
print((faults() - before) / 5)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc (mallopt)")
def test_a_translator_keeps_freed_memory_for_the_next_allocations_unless_told_not_to(tiny_bundle):
    def faults_per_round(mode: str) -> float:
        done = subprocess.run([sys.executable, "-c", FAULTS_PER_ROUND, str(tiny_bundle), mode], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return float(done.stdout.strip().splitlines()[-1])
    # off: the heap's top, trimmed at the frees, faulted in again page by page every round (how much of the 48 MB
    # glibc trims varies with the host); kept: nothing to fault in again
    assert faults_per_round("off") > 1000
    assert faults_per_round("keep") < 100


# In a fresh process under an address-space limit (ulimit -v) 256 MiB above what it holds: a running state's rows
# are appended with room for a million rows (32 GB: refused), then with room for 2,000 (128 MB: granted), and
# the cache grows to 1,024 slots a row (the room's 2,000 rows would take 1 GB: refused). Each time the state
# goes on in buffers of its own rows, with every filled slot kept.
ROOM_REFUSED = """
import resource, numpy as np
from nmtserve.export.runtime.batch import BatchState

def fresh(rows, capacity):
    cross = np.zeros((1, rows, 1, 4, 64), np.float32)
    return BatchState.from_encoded(cross, cross.copy(), np.zeros((1, rows, 2, 1, 64), np.float32),
                                   np.ones((rows, 4), bool), bos_id=1, capacity=capacity)

def address_space():
    status = open("/proc/self/status").read()
    return int(status.split("VmSize:")[1].split()[0]) * 1024

state = fresh(4, 128)
state.positions[:] = 3
state.k[...] = np.arange(4, dtype=np.float32)[None, :, None, None, None]
resource.setrlimit(resource.RLIMIT_AS, (address_space() + 256 * 2**20, resource.getrlimit(resource.RLIMIT_AS)[1]))
state = state.append(fresh(2, 0), room=10**6)
assert state.size == 6 and state.k.base.shape[1] == 6, state.k.base.shape
state = state.append(fresh(1, 0), room=2000)
assert state.size == 7 and state.k.base.shape[1] == 2000, state.k.base.shape
state.reserve(1024)
assert state.capacity == 1024 and state.k.base.shape[1] == 7, state.k.base.shape
assert (state.k[0, :4, 0, :3] == np.arange(4)[:, None, None]).all()
state.positions[:] = 1024
state.open_slot()
assert state.capacity == 2048 and (state.k[0, :4, 0, :3] == np.arange(4)[:, None, None]).all()
print("ok")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/status and RLIMIT_AS")
def test_a_state_refused_the_address_space_of_its_room_goes_on_in_buffers_of_its_own_rows():
    done = subprocess.run([sys.executable, "-c", ROOM_REFUSED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_encoder_in_calls_of_a_few_rows_writes_what_one_call_writes(tiny_bundle, monkeypatch):
    """A batch of more source slots than ENCODER_TOKENS goes through the encoder a few rows a call, each call's
    outputs bound to their rows of the stacked cross K/V: the same values as one call of every row."""
    import numpy as np

    from nmtserve.export.runtime import decoder
    from nmtserve.export.runtime.translator import OnnxTranslator

    tr = OnnxTranslator(tiny_bundle)
    sources = [tr.tokenizer.encode(text) for text in ["the cat sleeps", "a dog", "the old teacher reads the book",
                                                        "hello", "the house is big", "we run"]]
    src_ids, src_mask = tr.pad(sources)
    whole = tr.encode(src_ids, src_mask)
    monkeypatch.setattr(decoder, "ENCODER_TOKENS", 2 * src_ids.shape[1])  # two rows a call, three calls
    for got, expected in zip(tr.encode(src_ids, src_mask), whole):
        assert np.allclose(got, expected, atol=1e-5)


def test_a_translator_reads_its_tokenizer_at_first_use_and_shares_it_with_its_replicas(tiny_bundle):
    """Ids in, ids out (search_ids) never loads the tokenizer (a multilingual model's holds tens of MB)."""
    from nmtserve.decoding import DecodingOptions
    from nmtserve.export.runtime.translator import OnnxTranslator

    tr = OnnxTranslator(tiny_bundle)
    found = tr.search_ids([[5, 6, 7], [8, 9]], DecodingOptions(max_decoding_length=4))
    assert len(found) == 2 and tr._tokenizer.cache_info().currsize == 0
    replica = tr.replica()
    assert replica.tokenizer is tr.tokenizer and tr._tokenizer.cache_info().misses == 1
