"""Launch helpers that need no GPU: the argument table of a kernel taking one struct by value."""

from __future__ import annotations

import ctypes

from cusparseattn.launches import struct_arguments


def test_struct_arguments_point_at_a_copy_of_the_params():
    params = bytearray(range(40))
    table, values = struct_arguments(params)
    params[0] = 99  # the table holds a copy: the caller may reuse its buffer
    assert len(table) == 1 and table[0] == ctypes.addressof(values)
    assert ctypes.string_at(table[0], 40) == bytes(range(40))
