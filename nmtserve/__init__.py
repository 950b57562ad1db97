"""nmtserve: train, export and serve an encoder-decoder Transformer for translation.

One import package. Its subpackages live in the repository's top-level folders:
nmtserve.training (training/, torch), nmtserve.export (export/: runtime/ is torch-free, build/ needs
torch), nmtserve.server (server/, torch-free), nmtserve.loadtests (loadtests/).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("nmtserve")
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"
