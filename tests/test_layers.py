"""The layers import only downward (docs/architecture.md, "Layers"): every import in every module, the lazy
ones inside functions too, read from the source."""

import ast
from pathlib import Path

import pytest

from tests.helpers import ROOT

# folder -> the modules (prefixes) nothing in it may import
NEVER = {
    "training": ("nmtserve.cli", "nmtserve.translate", "nmtserve.server", "nmtserve.loadtests"),
    "export/build": ("nmtserve.cli", "nmtserve.translate", "nmtserve.server", "nmtserve.loadtests"),
    "export/runtime": ("nmtserve.cli", "nmtserve.translate", "nmtserve.server", "nmtserve.loadtests",
                       "nmtserve.training", "nmtserve.export.build", "torch", "onnx"),
    "server": ("nmtserve.training", "nmtserve.export.build", "nmtserve.loadtests", "torch", "onnx"),
}
CORE = ("search.py", "sampling.py", "logits.py", "decoding.py", "errors.py", "tokenizer.py", "local.py", "console.py",
        "client.py", "glossary.py")
NEVER.update({f"nmtserve/{name}": ("nmtserve.cli", "nmtserve.translate", "nmtserve.server", "nmtserve.loadtests")
              for name in CORE})


def _private_imports(path: Path) -> set[str]:
    """Names starting with an underscore that the module imports from another nmtserve module."""
    return {f"{node.module}.{alias.name}" for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nmtserve")
            for alias in node.names if alias.name.startswith("_")}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("where", sorted(NEVER))
def test_no_module_imports_a_layer_above_it(where):
    files = [ROOT / where] if where.endswith(".py") else sorted((ROOT / where).rglob("*.py"))
    assert files
    wrong = {f"{path.relative_to(ROOT)} imports {name}" for path in files for name in _imports(path)
             for banned in NEVER[where] if name == banned or name.startswith(banned + ".")}
    assert not wrong, sorted(wrong)


def test_no_module_imports_another_modules_private_names():
    files = [path for folder in ("nmtserve", "training", "export", "server", "loadtests")
             for path in sorted((ROOT / folder).rglob("*.py")) if "v1" not in path.parts]
    wrong = {f"{path.relative_to(ROOT)} imports {name}" for path in files for name in _private_imports(path)}
    assert not wrong, sorted(wrong)
