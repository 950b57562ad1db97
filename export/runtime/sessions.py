"""ONNX Runtime sessions and bindings as nmtserve runs them: the session options, the providers, and binding
buffers by address so that a decoder step reads and writes the caches in place. Knows nothing of translation.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import onnxruntime as ort

from nmtserve.errors import BundleError, ConfigError
from nmtserve.export.runtime.native import NativeBinding, NativeSession

PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
# left out on a CPU: SkipLayerNormFusion's kernel is slower there than the residual Add and LayerNormalization it
# replaces in the int8 encoder (docs/performance-journal.md, "The int8 encoder without SkipLayerNormalization")
CPU_DISABLED_OPTIMIZERS = ["SkipLayerNormFusion"]
# where a session made from a graph's bytes (the native library's) finds the weights file its graph points into
EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"
SPINNING = {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"}  # session_options says why
_DEVICES: dict = {}  # ONNX Runtime's C-level device of each device name, made once (bind_address)


def bind_address(binding: ort.IOBinding | NativeBinding, name: str, where: str, dtype, shape, address: int,
                 output: bool = False) -> None:
    """`binding.bind_input` (or `bind_output`) of a buffer at `address` on device `where`, through the
    binding's C object with a device made once per name: the Python wrappers make a new device on every
    call and keep bookkeeping for WebGPU graph capture only, which was half of the time of binding a new
    batch (docs/performance-journal.md, "Binding a new batch"). A NativeBinding binds host memory."""
    if isinstance(binding, NativeBinding):
        assert where == "cpu", where
        binding.bind(name, dtype, shape, address, output)
        return
    device = _DEVICES.get(where)
    if device is None:
        device = _DEVICES[where] = ort.OrtDevice.make(where, 0)._get_c_device()
    (binding._iobinding.bind_output if output else binding._iobinding.bind_input)(name, device, dtype, shape, address)


def run_bound(session: ort.InferenceSession | NativeSession, binding: ort.IOBinding | NativeBinding) -> None:
    """`session.run_with_iobinding(binding)` through the session's C object: the Python wrapper looks up
    WebGPU graph capture on every call (a few µs of each decoder step: our Python between steps)."""
    if isinstance(binding, NativeBinding):
        binding.run()
    else:
        session._sess.run_with_iobinding(binding._iobinding, None)


def session_options(intra_op_threads: int = 0) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = intra_op_threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    # no CPU arena: the arena keeps the largest buffers any shape ever needed, and the running batch's
    # shapes change every step; without it resident memory stays far lower at the same throughput
    # (docs/performance-journal.md, "Memory under sustained traffic")
    so.enable_cpu_mem_arena = False
    # workers spin between the kernels of one run (a futex wake-up per parallel kernel is a large share of a
    # small decoder step) and stop when the run returns: a worker still spinning after it holds a core that our
    # Python between steps, and the other session's run, need (docs/performance-journal.md, "Spinning")
    for key, value in SPINNING.items():
        so.add_session_config_entry(key, value)
    return so


def make_session(path: Path, device: str = "cpu", intra_op_threads: int = 0, custom_ops: Path | None = None
                 ) -> ort.InferenceSession:
    """An ONNX Runtime session on `device` of the graph file at `path` as it is (its weights from the bundle's
    weights file beside it, which ONNX Runtime maps), with the custom-op library `custom_ops` registered; asking for
    CUDA and silently getting CPU is an error."""
    if device not in PROVIDERS:
        raise ConfigError(f"device {device!r}: choose cpu or cuda")
    if device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        raise ConfigError("device 'cuda': this onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)")
    options = session_options(intra_op_threads)
    if custom_ops is not None:
        options.register_custom_ops_library(str(custom_ops))
    try:
        session = ort.InferenceSession(str(path), options,
                                       providers=PROVIDERS[device],
                                       disabled_optimizers=CPU_DISABLED_OPTIMIZERS if device == "cpu" else None)
    except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph types
        raise cannot_load(path, e) from None
    if session.get_providers()[0] != PROVIDERS[device][0]:
        raise ConfigError(f"{path}: asked for {device} but onnxruntime fell back to {session.get_providers()[0]}")
    return session


def cannot_load(path: Path, error: Exception) -> BundleError:
    return BundleError(f"{path}: onnxruntime cannot load it ({(str(error).splitlines() or [''])[0][:200]})")


def same_objects(bound: tuple | None, objects: tuple) -> bool:
    """Whether `bound` (weak references) refers to exactly these objects, all alive: the same objects are
    the same buffers, and a dead one's address may have been reused."""
    if bound is None:
        return False
    for ref, x in zip(bound, objects):  # a plain loop: asked at every step
        if ref() is not x:
            return False
    return True


def weak_refs(objects: tuple) -> tuple:
    """Weak references to a bound group: the binding does not keep a finished batch's tensors alive."""
    return tuple(weakref.ref(x) for x in objects)
