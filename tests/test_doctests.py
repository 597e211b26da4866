"""The docstring examples of ``lightning_fp8``'s public names run, as ``python -m doctest`` would run them.

One test per module that defines a name in ``lightning_fp8.__all__``. The modules are found from ``__all__``
itself, so a new export is covered without editing this file. A module whose source shows an example
(``>>>``) must have at least one found and run, so examples cannot silently drop out of doctest's reach. Every
module's examples take milliseconds on a CPU: none is left out. One whose examples are slow or need a GPU would be
left out here, with a comment saying why.
"""

from __future__ import annotations

import doctest
import importlib
import inspect

import pytest

import lightning_fp8


def _defining_modules() -> list[object]:
    modules: set[str] = set()
    unavailable: dict[str, str] = {}
    for name in lightning_fp8.__all__:
        try:
            obj = getattr(lightning_fp8, name)
        except ImportError as err:  # an integration whose framework is not installed
            unavailable[lightning_fp8._LAZY.get(name, name)] = str(err)
            continue
        module = getattr(obj, "__module__", None)
        # E4M3/E5M2 are torch dtypes (their __module__ is torch): lightning_fp8.formats is reached via fp8_max.
        if isinstance(module, str) and module.startswith("lightning_fp8"):
            modules.add(module)
    params: list[object] = [pytest.param(m, id=m) for m in sorted(modules)]
    params += [
        pytest.param(m, id=m, marks=pytest.mark.skip(reason=f"not importable here: {why}"))
        for m, why in sorted(unavailable.items())
    ]
    return params


_MODULES = _defining_modules()


def test_the_exported_modules_are_found():
    found = {p.values[0] for p in _MODULES}
    assert {"lightning_fp8.linear", "lightning_fp8.recipe", "lightning_fp8.stats", "lightning_fp8.health"} <= found


@pytest.mark.parametrize("module_name", _MODULES)
def test_docstring_examples_run(module_name: str):
    module = importlib.import_module(module_name)
    report: list[str] = []
    # ELLIPSIS as pytest's --doctest-modules; each docstring runs on a fresh copy of the module's globals.
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(module, module_name):
        runner.run(test, out=report.append)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} docstring example(s) of {module_name} failed:\n" + "".join(report)
    if ">>>" in inspect.getsource(module):
        assert results.attempted > 0, f"{module_name} shows examples (>>>) but doctest found none to run"
