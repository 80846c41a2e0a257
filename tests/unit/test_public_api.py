"""The public API (``unbubble.__all__``, docs/architecture.md "Public API"): every name resolves, each is
the object its home module defines, and ``import unbubble`` stays free of torch."""

import importlib
import subprocess
import sys
import types

import unbubble


def test_every_public_name_resolves_to_its_home_modules_object():
    assert len(unbubble.__all__) == len(set(unbubble.__all__)) and set(unbubble.__all__) == set(unbubble._HOMES)
    for name in unbubble.__all__:
        home = importlib.import_module(unbubble._HOMES[name])
        value = getattr(unbubble, name)
        if isinstance(value, types.ModuleType):  # unbubble.export: the module, whose functions are public
            assert value is home and value.__name__ == f"unbubble.{name}"
            assert all(callable(getattr(value, f)) for f in value.__all__)
        else:
            assert value is getattr(home, name), name
            assert value.__module__ == home.__name__, f"{name} is defined in {value.__module__}, not {home.__name__}"
        assert (value.__doc__ or "").strip(), f"{name} has no docstring"
    assert "train_model" in dir(unbubble)


def test_an_unknown_name_is_an_attribute_error():
    try:
        unbubble.no_such_name
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("unbubble.no_such_name resolved")


def test_import_unbubble_does_not_import_torch():
    code = ("import sys, unbubble; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert len(unbubble.__all__) > 0 and 'train_model' in dir(unbubble); "
            "assert 'torch' not in sys.modules, 'dir() imported torch'; "
            "unbubble.get_schedule; assert 'torch' not in sys.modules, 'get_schedule imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)
