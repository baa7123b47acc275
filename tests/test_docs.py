"""Every docstring example in jaxmem runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import jaxmem

MODULES = sorted(m.name for m in pkgutil.walk_packages(jaxmem.__path__, "jaxmem."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert failures == 0
