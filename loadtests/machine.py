"""What a benchmark report records about where it ran: CPU model and instruction-set flags, cores,
and the versions of the libraries whose speed it measures (read without importing them); how
fast the host runs at a given moment (`host_probe`); and ONNX Runtime's MatMul rate on it (`product_peak`)."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from functools import partial
from importlib import metadata
from pathlib import Path

LIBRARIES = ("onnxruntime", "onnxruntime-gpu", "ctranslate2", "torch", "transformers", "numpy", "grpcio")
# the flags that decide which GEMM and int8 kernels the engines can use
CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512cd", "avx512dq", "avx512bw", "avx512vl",
             "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def _cpuinfo() -> tuple[str, str, list[str]]:
    """The CPU's model name, its family and model numbers ("family 25, model 17": a hypervisor may name every
    generation alike, "AMD EPYC"), and the flags of CPU_FLAGS it has."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), "", []
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)  # the last CPU's lines win
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    family = f"family {fields['cpu family']}, model {fields['model']}" if "cpu family" in fields else ""
    return fields.get("model name", platform.machine()), family, [f for f in CPU_FLAGS if f in flags]


def cpu_flags() -> list[str]:
    """The flags of CPU_FLAGS this CPU has."""
    return _cpuinfo()[2]


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), else all logical cores."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def gpu_info() -> str:
    """The GPU's name, memory and driver as nvidia-smi reports them; why not, where it cannot."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown (nvidia-smi: {e})"
    return done.stdout.strip().replace("\n", "; ") if done.returncode == 0 else f"unknown (nvidia-smi: {done.stderr.strip()})"


def machine_info(device: str = "cpu") -> dict:
    """Where a benchmark ran; with the GPU's name, memory and driver when it ran on `cuda`."""
    model, family, flags = _cpuinfo()
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {"cpu": model, "cpu_family": family, "cpu_flags": flags, "logical_cores": os.cpu_count(),
            "usable_cores": usable_cores(),
            "system": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "versions": versions, **({"gpu": gpu_info()} if device == "cuda" else {})}


def describe(info: dict) -> str:
    """One line for the top of a printed report."""
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    gpu = f"GPU {info['gpu']}; " if "gpu" in info else ""
    family = f"{info['cpu_family']}; " if info.get("cpu_family") else ""  # older reports lack it
    return (f"{gpu}{info['cpu']} ({family}{info['usable_cores']} usable cores; {' '.join(info['cpu_flags'])}); "
            f"Python {info['python']}; {versions}")


PROBES = {"exp_mps": "exp in L2, M values/s", "l3_gbps": "sum over 8 MB, GB/s"}  # host_probe's figures, described


def rate(work, amount: float, repeats: int = 7) -> float:
    """amount over the median time of `repeats` calls of work()."""
    timings = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        work()
        timings.append(time.perf_counter() - t0)
    return round(amount / statistics.median(timings), 1)


def host_probe() -> dict:
    """How fast one core of the host runs right now, with numpy (one thread whatever the engine's), the
    median of 7 timings each: `exp_mps`, exp over 65,536 float32 values in L2 (millions a second: the
    vector units), and `l3_gbps`, a sum over 8 MB (GB/s read from L3, where a step's weights come from).
    The benchmarks measure it beside each measurement, so a report shows which runs fell in a slow spell."""
    import numpy as np

    x, y, big = np.linspace(-4, 4, 65_536, dtype=np.float32), np.empty(65_536, np.float32), np.ones(1 << 21, np.float32)
    big.sum()
    return {"exp_mps": rate(lambda: [np.exp(x, out=y) for _ in range(20)], 20 * 65_536 / 1e6),
            "l3_gbps": rate(lambda: [big.sum() for _ in range(4)], 4 * big.nbytes / 1e9)}


# product_peak's chain: ROWS rows through LINKS products alternating IN -> OUT and OUT -> IN (a feed-forward block's
# shapes, large enough for ONNX Runtime's MatMul to run at its best on a CPU)
PEAK_ROWS, PEAK_IN, PEAK_OUT, PEAK_LINKS = 512, 512, 2048, 8


def product_peak(threads: int) -> dict:
    """ONNX Runtime's MatMul rate on this host with `threads` intra-op threads: `fp32_gflops`, and `int8_gops`
    through `quantize_dynamic` (int8 weights per channel, as nmtserve's int8 variant), each the median of 20
    runs of a chain of products (PEAK_*) after a warm-up."""
    import tempfile

    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import QuantType, quantize_dynamic

    rng = np.random.default_rng(0)
    nodes, weights, x = [], [], "x"
    for i in range(PEAK_LINKS):
        shape = (PEAK_IN, PEAK_OUT) if i % 2 == 0 else (PEAK_OUT, PEAK_IN)
        weights.append(numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32),
                                               f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"y{i}"]))
        x = f"y{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, PEAK_IN])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)], weights)
    ops = 2 * PEAK_ROWS * PEAK_IN * PEAK_OUT * PEAK_LINKS
    feed = {"x": rng.standard_normal((PEAK_ROWS, PEAK_IN)).astype(np.float32)}
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        fp32, int8 = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(fp32))
        quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8, per_channel=True)
        for name, path in (("fp32_gflops", fp32), ("int8_gops", int8)):
            options = ort.SessionOptions()
            options.intra_op_num_threads, options.log_severity_level = threads, 3
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            for _ in range(3):
                session.run(None, feed)
            rates[name] = rate(partial(session.run, None, feed), ops / 1e9, repeats=20)
    return {"threads": threads, **rates}


# A served cell's CPU by whom (thread_times): the server's event loop (its main thread), its engines (threads named
# as export/runtime/engine.py names them), its other threads (gRPC's, the metrics endpoint's, and ONNX Runtime's intra-op
# pool when an engine has more than one thread: `--threads 2`'s second thread counts here)
THREAD_KINDS = ("event loop", "engines", "other server threads")


def thread_times(pid: int) -> dict[str, tuple[float, float]] | None:
    """Seconds each kind of a server's threads (THREAD_KINDS) has run and has waited, runnable, for a core, summed
    over its threads, from Linux's /proc/PID/task/*/schedstat; None where that cannot be read (another OS, or a
    kernel without scheduler statistics). Threads that ended between two readings drop out of the later one."""
    times = {kind: [0.0, 0.0] for kind in THREAD_KINDS}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        if not (tasks[0] / "schedstat").exists():
            return None
    except (OSError, IndexError):
        return None
    for task in tasks:
        try:
            run_ns, wait_ns = (int(x) for x in (task / "schedstat").read_text().split()[:2])
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended
            continue
        kind = "event loop" if task.name == str(pid) else "engines" if name == "nmtserve-engine" else "other server threads"
        times[kind][0] += run_ns / 1e9
        times[kind][1] += wait_ns / 1e9
    return {kind: (run, wait) for kind, (run, wait) in times.items()}
