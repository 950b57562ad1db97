"""Loaded by every Python process started with tests/mutants on PYTHONPATH (tests/mutants/run.py does so): when
NMTSERVE_MUTANT names one of mutants.MUTANTS, its patch is applied to its module as soon as that module is imported,
in the test process and in every server or command it starts. Without NMTSERVE_MUTANT it does nothing."""

import importlib.abc
import os
import sys

_name = os.environ.get("NMTSERVE_MUTANT")
if _name:
    from mutants import MUTANTS

    _module, _patch = MUTANTS[_name]["module"], MUTANTS[_name]["patch"]

    class _PatchAfterImport(importlib.abc.MetaPathFinder):
        """Finds nothing itself: asks the other finders, then wraps the module's loader so the patch follows its code."""

        def find_spec(self, fullname, path, target=None):
            if fullname != _module:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(fullname)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                _patch(module)
            spec.loader.exec_module = exec_module
            return spec

    import importlib.util

    sys.meta_path.insert(0, _PatchAfterImport())
