"""Serve or translate a Hugging Face model folder directly: its bundle is made once (import, then export) into a
cache keyed by the sha256 of the folder's files, and reused by every later start; a changed file makes a new one.

    nmtserve serve ~/models/opus-mt-en-de          # first start: import + export (the train extra); later: the cache

The cache is $NMTSERVE_CACHE, else ~/.cache/nmtserve; each bundle sits in bundles/<key>-schema<N> with the folder it
came from named in its manifest, N the bundle schema it was exported at: an nmtserve that reads another schema makes
its own instead of refusing the one an older release left. Making one needs torch (the train extra); serving it afterwards does not.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from nmtserve.errors import NmtserveError
from nmtserve.export.runtime.bundle import MANIFEST, SCHEMA_VERSION, sha256_of


def is_model_folder(path: str | Path) -> bool:
    """A Hugging Face model folder (config.json, no bundle manifest)."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / MANIFEST).is_file()


def cache_dir() -> Path:
    return Path(os.environ.get("NMTSERVE_CACHE") or Path.home() / ".cache" / "nmtserve")


def folder_key(folder: Path) -> str:
    """sha256 over the folder's files (names and contents; hidden files and subfolders aside)."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")):
        h.update(f"{path.name}\0{sha256_of(path)}\n".encode())
    return h.hexdigest()


def bundle_for(path: str | Path, log=print) -> str:
    """`path` itself unless it is a Hugging Face model folder; then its cached bundle, made first if missing."""
    folder = Path(path)
    if not is_model_folder(folder):
        return str(path)
    target = cache_dir() / "bundles" / f"{folder_key(folder)[:32]}-schema{SCHEMA_VERSION}"
    if (target / MANIFEST).is_file():
        log(f"{folder}: the bundle made from it before, {target}")
        return str(target)
    try:
        from nmtserve.export.build.exporter import ExportConfig, export_bundle
        from nmtserve.training.hf_import import import_model
    except ImportError as e:
        raise NmtserveError(f"{folder}: a Hugging Face model folder is imported and exported once, which needs the "
                            f"train extra (pip install 'nmtserve[train]'): {e}") from None
    log(f"{folder}: importing and exporting it once into {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".making-") as tmp:
        import_model(folder, Path(tmp) / "model.pt")
        export_bundle(ExportConfig(str(Path(tmp) / "model.pt"), str(Path(tmp) / "bundle")))
        try:
            os.rename(Path(tmp) / "bundle", target)  # whole or not at all; a concurrent start may have won
        except OSError:
            if not (target / MANIFEST).is_file():
                raise
    return str(target)
