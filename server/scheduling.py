"""The server's threads on the host's cores: the threads that wake for every call yield to the decoding threads.

The event loop, gRPC's threads and the engines' hand-back threads each wake many times a call, for a few
microseconds each; a thread of the default policy (SCHED_OTHER) that wakes may preempt the thread running on its
core, and on a host whose cores are all busy that is an engine's thread in the middle of a decoder step, which
then waits for a core and finds its caches cold. A SCHED_BATCH thread that wakes never preempts: it takes a free
core or its turn when the running thread's slice ends (Linux's fair scheduler, CFS and EEVDF alike). So once
`nmtserve serve` has started (app.serve: the process is the server's), every thread of it runs SCHED_BATCH but the
decoding ones: the engines' threads and ONNX Runtime's pools, which the models start as they load
(app.start_server notes them; docs/performance-journal.md, "The serving threads yield to the decoding ones").
Threads started later inherit their starter's policy: the event loop's and gRPC's are SCHED_BATCH by then. Any
user may choose SCHED_BATCH (it keeps the thread's nice value; no capability is needed in a container); where the
call is missing (not Linux) or refused, nothing changes.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("nmtserve.server")
TASKS = "/proc/self/task"  # a directory per thread of this process, named by its thread id


def threads() -> set[int]:
    """This process's thread ids; empty where the host does not list them."""
    try:
        return {int(tid) for tid in os.listdir(TASKS)}
    except OSError:
        return set()


def yield_to(decoding: set[int]) -> None:
    """Every thread of this process but `decoding` (ids) runs SCHED_BATCH from now on."""
    if not hasattr(os, "sched_setscheduler"):
        return
    serving = threads() - decoding
    for tid in serving:
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except OSError as e:
            log.warning("the serving threads keep the default scheduling policy: %s", e)
            return
    log.debug("%d serving thread(s) SCHED_BATCH, %d decoding thread(s) not", len(serving), len(decoding))
