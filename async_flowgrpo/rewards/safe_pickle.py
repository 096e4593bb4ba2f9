"""A restricted unpickler for reward servers' answers: plain containers, numbers, strings, bytes
and numpy arrays / scalars of non-object dtypes; any other global named in the pickle is refused
with one line and never imported.

Pickle's own opcodes build lists, tuples, dicts, strings, numbers, bools and None without naming a
global; what remains are the few globals below, each mapped to an object held here (the module
path in the pickle is only compared, never imported). numpy writes `numpy.core...` under numpy 1
and `numpy._core...` under numpy 2; both are accepted. A dtype that holds Python objects is
refused too (its items would be pointers, not numbers).
"""

from __future__ import annotations

import codecs
import io
import pickle

import numpy as np


class ForbiddenPickleError(pickle.UnpicklingError):
    """The pickle names a global outside the allowed set (or an object dtype)."""


def _dtype(*args, **kwargs) -> np.dtype:
    dtype = np.dtype(*args, **kwargs)
    if dtype.hasobject:
        raise ForbiddenPickleError(f"pickle holds a numpy array of Python objects (dtype {dtype}); only numeric, bool and string dtypes are allowed")
    return dtype


def _latin1_bytes(text: str, encoding: str = "latin1") -> bytes:
    """Protocols 0-2 write bytes as _codecs.encode(str, 'latin1'); nothing else of codecs is allowed."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise ForbiddenPickleError(f"pickle calls _codecs.encode with encoding {encoding!r}; only latin1 (bytes in protocols 0-2) is allowed")
    return codecs.encode(text, "latin1")


def _allowed() -> dict[tuple[str, str], object]:
    from numpy._core import multiarray, numeric  # numpy >= 2; numpy 1 pickles name numpy.core.*

    table: dict[tuple[str, str], object] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): _dtype,
        ("_codecs", "encode"): _latin1_bytes,
    }
    for core in ("numpy.core", "numpy._core"):
        table[(f"{core}.multiarray", "_reconstruct")] = multiarray._reconstruct
        table[(f"{core}.multiarray", "scalar")] = multiarray.scalar
        table[(f"{core}.numeric", "_frombuffer")] = numeric._frombuffer
    for builtins in ("builtins", "__builtin__"):  # protocol < 3 names the module __builtin__
        for name, obj in (("set", set), ("frozenset", frozenset), ("complex", complex), ("bytearray", bytearray)):
            table[(builtins, name)] = obj
    return table


_ALLOWED = _allowed()


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise ForbiddenPickleError(
                f"pickle names {module}.{name}, which is not allowed (only containers, numbers, strings and numpy arrays); it was not imported"
            ) from None

    def persistent_load(self, pid):
        raise ForbiddenPickleError("pickle uses persistent ids, which are not allowed")


def restricted_loads(data: bytes):
    """pickle.loads, allowing only what the module docstring lists. Raises ForbiddenPickleError for a
    refused global and pickle.UnpicklingError (or EOFError, ValueError) for a truncated or broken pickle."""
    return _RestrictedUnpickler(io.BytesIO(data)).load()
