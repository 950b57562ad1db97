"""nmtserve's kernel library for ONNX Runtime's CPU provider (kernels.cc): its build, and whether it can run here.

The library holds the custom ops of the bundle's `*_kernels` graphs (export/build/kernel_graphs.py says what
each does) and the native decoding loops (native.py). It is built on the machine that runs it, by `python -m
nmtserve.export.runtime.kernels` (`make kernels`; `make test` runs it), with a C++ compiler and ONNX Runtime's
C API headers of a pinned version (Debian's libonnxruntime-dev, downloaded once and checked against the SHA-256
here), into `kernels_dir()`: a folder of the user's, never the installed package, under a name keyed by the
source, flags and headers, so that a stale library is never loaded.

`unavailable()` says why the library cannot serve in this process (not built, cannot be opened, or built for a
newer ONNX Runtime API than the one running), or None; the translator then loads the bundle's portable graphs
and says so (export/runtime/decoder.py). Never edits a graph."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from nmtserve.errors import ConfigError

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "kernels.cc"
INTERFACE = HERE / "kernels.h"  # the functions Python calls (native.py declares them to cffi from it)
# ONNX Runtime's C/C++ API headers, pinned: Debian's libonnxruntime-dev (the onnxruntime wheel ships none), whose
# ORT_API_VERSION is the oldest onnxruntime the library runs with (pyproject.toml's lower bound says the same)
DEBIAN = "https://deb.debian.org/debian"
HEADER_PACKAGE = "pool/main/o/onnxruntime/libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb"
HEADER_SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
# warnings off: the lite custom-op header's own unused parameters; no -ffast-math: in a shared library
# it would set flush-to-zero for the whole process; 512-bit vectors in the AVX-512 clones (kernels.cc, CLONED),
# which GCC's generic tuning would keep at 256
FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-mprefer-vector-width=512", "-w"]


def kernels_dir() -> Path:
    """Where the library and the headers it is built with live: $NMTSERVE_KERNELS_DIR, else the user's cache
    ($XDG_CACHE_HOME or ~/.cache, then nmtserve/kernels); never inside the installed package."""
    if os.environ.get("NMTSERVE_KERNELS_DIR"):
        return Path(os.environ["NMTSERVE_KERNELS_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nmtserve" / "kernels"


def library_path() -> Path:
    """The library built from this kernels.cc and kernels.h, these flags and the pinned headers: a name of its own
    for each, so that a library built from other sources is never loaded (it is "not built" until `make kernels`)."""
    sources = SOURCE.read_bytes() + INTERFACE.read_bytes()
    key = hashlib.sha256(sources + " ".join(FLAGS).encode() + HEADER_SHA256.encode()).hexdigest()[:16]
    return kernels_dir() / f"libnmtserve_kernels-{key}.so"


LIBRARY = library_path()
HEADERS = kernels_dir() / f"onnxruntime-headers-{HEADER_SHA256[:12]}"


def header_dir() -> Path:
    """The pinned headers, downloaded and checked against HEADER_SHA256 once."""
    if not (HEADERS / "onnxruntime_lite_custom_op.h").exists():
        _download_headers(HEADERS)
    return HEADERS


def _download_headers(dest: Path) -> None:
    """The pinned package, checked against its SHA-256, its usr/include/onnxruntime unpacked into dest (the .deb
    is an ar archive holding data.tar.*; nothing is installed). Its modules are imported here, not by every
    process that only loads the library (urllib brings TLS, HTTP and email with it, resident for good)."""
    import io
    import shutil
    import tarfile
    import tempfile
    import urllib.request

    url = f"{DEBIAN}/{HEADER_PACKAGE}"
    with urllib.request.urlopen(url, timeout=300) as response:
        package = response.read()
    if hashlib.sha256(package).hexdigest() != HEADER_SHA256:
        raise ConfigError(f"{url}: SHA-256 {hashlib.sha256(package).hexdigest()[:12]}…, pinned {HEADER_SHA256[:12]}…")
    data = _ar_member(package, "data.tar")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as unpacked, tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(unpacked, members=[m for m in tar.getmembers() if m.name.startswith("./usr/include/onnxruntime/")],
                       filter="data")
        shutil.move(Path(unpacked) / "usr/include/onnxruntime", dest)


def _ar_member(archive: bytes, prefix: str) -> bytes:
    """The first member of an ar archive (a .deb) whose name starts with `prefix`."""
    if not archive.startswith(b"!<arch>\n"):
        raise ConfigError(f"{HEADER_PACKAGE}: not a Debian package")
    offset = 8
    while offset + 60 <= len(archive):
        name, size = archive[offset:offset + 16].decode().strip(), int(archive[offset + 48:offset + 58])
        if name.startswith(prefix):
            return archive[offset + 60:offset + 60 + size]
        offset += 60 + size + size % 2
    raise ConfigError(f"{HEADER_PACKAGE}: no {prefix}* member")


def build(compiler: str = "g++") -> Path:
    """Compile kernels.cc into LIBRARY (replaced atomically) and return its path; nothing to do when it is there."""
    _unavailable.cache_clear()
    if LIBRARY.exists():
        return LIBRARY
    headers = header_dir()
    LIBRARY.parent.mkdir(parents=True, exist_ok=True)
    partial = LIBRARY.with_suffix(f".{os.getpid()}.partial")
    result = subprocess.run([compiler, *FLAGS, f"-I{headers}", f"-I{HERE}", str(SOURCE), "-o", str(partial)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise ConfigError(f"{SOURCE}: {compiler} failed ({result.returncode}): {result.stderr.strip()[:2000]}")
    partial.replace(LIBRARY)
    return LIBRARY


def available() -> bool:
    return unavailable() is None


def unavailable(library: Path | None = None) -> str | None:
    """Why the kernel library cannot serve in this process, in one line that names the fix; None when it can."""
    return _unavailable(library or LIBRARY)


@functools.cache
def _unavailable(library: Path) -> str | None:
    import onnxruntime as ort

    if not library.exists():
        return f"{library} is not built (make kernels)"
    try:
        built_for = ctypes.CDLL(str(library)).nmt_ort_api_version()
    except (OSError, AttributeError) as e:  # not a library for this machine, or one without the version's symbol
        return f"{library} cannot be opened here ({str(e)[:200]}): build it again (make kernels)"
    running = int(ort.__version__.split(".")[1])  # ONNX Runtime 1.N serves C API versions 1 to N
    if built_for > running:
        return (f"{library} was built for ONNX Runtime's API {built_for}, this onnxruntime {ort.__version__} "
                f"serves up to {running}: upgrade onnxruntime, or build the library again (make kernels)")
    return None


if __name__ == "__main__":
    try:
        print(f"nmtserve: kernel library {build()}")
    except (ConfigError, OSError) as e:
        sys.exit(f"nmtserve: the kernel library was not built: {e}")
