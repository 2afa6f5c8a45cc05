"""The NumPy mirrors of the kernels' parameter structs, read from the structs' C definitions in kernels/: each
struct is written once, in C, and `mirror` gives the structured dtype (C's field order, sizes and alignment)
that the launches fill and pass by value.

>>> mirror("block_mask.cu", "MaskParams").names[:4]
('any', 'all', 'seq_q', 'seq_k')
"""

from __future__ import annotations

import re

import numpy as np

from . import env

#: The C types of the structs' fields that are not pointers; any pointer is a 64-bit address.
_SCALARS = {
    "int": np.int32,
    "unsigned": np.uint32,
    "float": np.float32,
    "long long": np.int64,
    "unsigned long long": np.uint64,
}

# A declarator: its stars, its name and an array size.
_DECLARATOR = re.compile(r"\s*(\**)\s*([A-Za-z_]\w*)\s*(?:\[(\d+)\])?\s*$")


def definition(text: str, struct: str) -> str:
    """The C definition of struct ``struct`` in ``text``, from ``struct Name {`` to its ``};``."""
    start = text.index(f"struct {struct} {{")
    return text[start : text.index("};", start) + 2]


def parse(text: str, struct: str) -> np.dtype:
    """The aligned structured dtype of C struct ``struct`` defined in ``text``: fields of `_SCALARS` types,
    pointers, and fixed-size arrays of them, declared one or several a statement.

    >>> parse("struct P { const float* x; long long n[2], m; int k; };", "P").descr
    [('x', '<u8'), ('n', '<i8', (2,)), ('m', '<i8'), ('k', '<i4'), ('', '|V4')]
    """
    whole = definition(text, struct)
    body = re.sub(r"//[^\n]*", "", whole[whole.index("{") + 1 : -2])
    fields = []
    for statement in filter(str.strip, body.split(";")):
        first, *others = statement.split(",")
        match = re.match(r"\s*(.*?[\s*])([A-Za-z_]\w*\s*(?:\[\d+\])?\s*)$", first, re.DOTALL)
        if match is None:
            raise ValueError(f"struct {struct}: cannot read the declaration {statement.strip()!r}")
        type_text, declarators = match.group(1), [match.group(2), *others]
        base = " ".join(type_text.replace("*", " ").replace("const", " ").split())
        for declarator in declarators:
            match = _DECLARATOR.match(declarator)
            if match is None:
                raise ValueError(f"struct {struct}: cannot read the declarator {declarator.strip()!r}")
            stars, name, size = match.groups()
            if "*" in type_text or stars:
                kind = np.uint64
            elif base in _SCALARS:
                kind = _SCALARS[base]
            else:
                raise ValueError(f"struct {struct}: field {name} has type {base!r}, which has no mirror")
            fields.append((name, kind, (int(size),)) if size else (name, kind))
    return np.dtype(fields, align=True)


def mirror(filename: str, struct: str) -> np.dtype:
    """The dtype of C struct ``struct`` of ``kernels/filename`` (`parse`)."""
    return parse((env.kernels_dir() / filename).read_text(), struct)
