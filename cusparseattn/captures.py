"""What a trace depends on beyond its code: the values a function captures (closures, defaults, globals),
described cheaply so that an unchanged function with unchanged captures finds its traced result again
(`EnvironmentCache`); arrays by identity and version, numbers by value.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import numpy as np

from .graph import global_names, holds_functions, traced_from
from .recent import Recent
from .traced import LIBRARIES, CapturedArray, is_array, is_number, type_root


# ---- the environment a trace depends on ------------------------------------------------------------------
class Unversioned(Exception):
    """A value a function reaches whose changes cannot be seen without tracing again (a dict, an object, a
    large writable NumPy array, a CuPy array): such a function is traced on every call."""


# Writable NumPy arrays up to this size are compared by content; larger ones are not worth the copy.
_COMPARED_BYTES = 4096


def environment(fn) -> tuple[tuple, list]:
    """``(key, held)``: a key that changes whenever anything `Graph.capture` reads from ``fn`` (closure cells,
    default arguments, user-module globals, recursively) changes, and the objects the key names by identity,
    which the caller holds so that their ids are not reused. Numbers and strings count by value, code by
    identity, arrays by identity and version (PyTorch's in-place counter; content for small writable NumPy
    arrays; JAX arrays and read-only NumPy arrays cannot change). Raises `Unversioned` otherwise."""
    held: list = []
    return _environment(fn, held, {}), held


def _environment(value, held: list, memo: dict):
    if id(value) in memo:
        return ("seen", memo[id(value)])
    memo[id(value)] = len(memo)
    if value is None or isinstance(value, (bool, np.bool_, str, bytes, types.ModuleType)):
        return ("value", value)
    if is_number(value):
        return ("number", type(value).__name__, value)
    if isinstance(value, CapturedArray):  # a snapshot taken when it was made
        held.append(value)
        return ("captured", id(value))
    if is_array(value):
        held.append(value)
        return ("array", id(value), *_array_version(value))
    origin = traced_from(value)
    if origin is not None:
        return _environment(origin, held, memo)
    if type(value) in (tuple, list):
        return (type(value).__name__, *(_environment(v, held, memo) for v in value))
    if isinstance(value, types.FunctionType):
        package = (getattr(value, "__module__", None) or "").split(".")[0]
        if package in LIBRARIES:  # its own values are fixed; the functions it combines are the user's
            held.append(value)
            cells = (c for c in value.__closure__ or () if holds_functions(c))
            return ("library", id(value), *(_environment(c.cell_contents, held, memo) for c in cells))
        cells = []
        for cell in value.__closure__ or ():
            try:
                cells.append(_environment(cell.cell_contents, held, memo))
            except ValueError:  # an empty cell
                cells.append(("empty",))
        namespace = value.__globals__
        names = sorted(global_names(value.__code__)) if package != __package__ else []
        held.append(value.__code__)
        return (
            "function",
            id(value.__code__),
            tuple(cells),
            _environment(value.__defaults__, held, memo),
            tuple((n, _environment(v, held, memo)) for n, v in sorted((value.__kwdefaults__ or {}).items())),
            tuple((n, _environment(namespace[n], held, memo)) for n in names if n in namespace),
        )
    raise Unversioned(f"{type(value).__name__} values are not tracked between calls")


class EnvironmentCache:
    """The last ``size`` values made from functions, each reused while its function's `environment` is
    unchanged: no new trace, and the same object for the caches keyed by identity (the kernels' tables). A
    value holds its function (a ScoreMod, a Pattern), so the cache is bounded rather than weak."""

    def __init__(self, size: int = 16):
        self.size = size
        self._entries = Recent(size)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key, fn, make: Callable, *, watch_all: bool):
        """``make()``'s value for ``key`` (a hashable tuple naming ``fn`` and what else ``make`` depends on).
        With ``watch_all``, a function reaching values whose changes cannot be seen (`Unversioned`) is made
        anew each call; without, those values count as unchanged."""
        try:
            env, held = environment(fn)
        except Unversioned:
            if watch_all:
                return make()
            env, held = None, []
        try:
            cached = self._entries.get(key)
        except TypeError:  # an unhashable callable
            return make()
        if cached is not None and cached[0] == env:
            return cached[2]
        value = make()
        self._entries.put(key, (env, held, value))  # held: what env names by identity, so no id is reused
        return value


def _array_version(array) -> tuple:
    root = type_root(array)
    if root == "torch":
        return ("torch", array._version)
    if root in ("jax", "jaxlib"):
        return ("jax",)
    if isinstance(array, np.ndarray):
        if not array.flags.writeable:
            return ("numpy",)
        if array.nbytes <= _COMPARED_BYTES:
            return ("numpy", array.dtype.str, array.shape, array.tobytes())
    raise Unversioned(f"a {type(array).__name__} of {getattr(array, 'nbytes', '?')} bytes is not tracked")
