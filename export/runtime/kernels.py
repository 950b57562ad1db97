"""nmtserve's kernel library for ONNX Runtime's CPU provider (kernels.cc): its build, and whether it can run here.

The library holds the custom ops of the bundle's `*_kernels` graphs (export/build/kernel_graphs.py says what
each does) and the native decoding loops (native.py). It is built on the machine that runs it, by `python -m
nmtserve.export.runtime.kernels` (`make kernels`; `make test` runs it), with a C++ compiler and ONNX Runtime's
C API headers: the system's (/usr/include/onnxruntime) or else those of Debian's libonnxruntime-dev, downloaded
once from the Debian archive (the onnxruntime wheel ships no header).

`unavailable()` says why the library cannot serve in this process (not built, cannot be opened, or built for a
newer ONNX Runtime API than the one running), or None; the translator then loads the bundle's portable graphs
and says so (export/runtime/translator.py). Never edits a graph."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import lzma
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from nmtserve.errors import ConfigError

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "kernels.cc"
# built files go to a folder that is not a package: Python would take a .so beside the modules for one
LIBRARY = HERE / "native" / "libnmtserve_kernels.so"
HEADERS = HERE / "native" / "onnxruntime-headers"  # the downloaded package's headers, when the system has none
SYSTEM_HEADERS = Path("/usr/include/onnxruntime")
DEBIAN = "https://deb.debian.org/debian"
DEBIAN_SUITE = "trixie"  # the first Debian release with onnxruntime (1.21); headers work with any newer runtime
HEADER_PACKAGE = "libonnxruntime-dev"
# warnings off: the lite custom-op header's own unused parameters; no -ffast-math: in a shared library
# it would set flush-to-zero for the whole process; 512-bit vectors in the AVX-512 clones (kernels.cc, CLONED),
# which GCC's generic tuning would keep at 256
FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-mprefer-vector-width=512", "-w"]


def header_dir() -> Path:
    """ONNX Runtime's C/C++ API headers: the system's, else the Debian package's (downloaded once)."""
    for directory in (SYSTEM_HEADERS, HEADERS):
        if (directory / "onnxruntime_lite_custom_op.h").exists():
            return directory
    _download_headers(HEADERS)
    return HEADERS


def _download_headers(dest: Path) -> None:
    """The headers of Debian's libonnxruntime-dev, found in the archive's package index and checked against
    its SHA-256 there, unpacked into dest (nothing is installed)."""
    index_url = f"{DEBIAN}/dists/{DEBIAN_SUITE}/main/binary-amd64/Packages.xz"
    with urllib.request.urlopen(index_url, timeout=120) as response:
        index = lzma.decompress(response.read()).decode()
    stanza = next((s for s in index.split("\n\n") if s.startswith(f"Package: {HEADER_PACKAGE}\n")), None)
    if stanza is None:
        raise ConfigError(f"{index_url}: no package {HEADER_PACKAGE}")
    fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line.startswith(" "))
    with urllib.request.urlopen(f"{DEBIAN}/{fields['Filename']}", timeout=300) as response:
        package = response.read()
    if hashlib.sha256(package).hexdigest() != fields["SHA256"]:
        raise ConfigError(f"{DEBIAN}/{fields['Filename']}: SHA-256 differs from the archive's index")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as unpacked:
        deb = Path(unpacked) / "package.deb"
        deb.write_bytes(package)
        subprocess.run(["dpkg-deb", "-x", str(deb), unpacked], check=True)
        shutil.move(Path(unpacked) / "usr/include/onnxruntime", dest)


def build(compiler: str = "g++") -> Path:
    """Compile kernels.cc into LIBRARY (replaced atomically) and return its path."""
    _unavailable.cache_clear()
    headers = header_dir()
    LIBRARY.parent.mkdir(exist_ok=True)
    partial = LIBRARY.with_suffix(".so.partial")
    result = subprocess.run([compiler, *FLAGS, f"-I{headers}", str(SOURCE), "-o", str(partial)],
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
        print(f"nmtserve: built {build()}")
    except (ConfigError, OSError) as e:
        sys.exit(f"nmtserve: the attention kernel was not built: {e}")
