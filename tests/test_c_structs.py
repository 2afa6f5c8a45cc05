"""The NumPy mirrors of the kernels' parameter structs: read from their C definitions, laid out as C does."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from cusparseattn import build, c_structs, env

# Every struct the launches pass by value, in its file, and the builder's mirror of it.
STRUCTS = {
    "Params": ("params.cuh", build.PARAMS),
    "MaskParams": ("block_mask.cu", build.MASK_PARAMS),
    "TablesParams": ("dynamic_tables.cu", build.TABLES_PARAMS),
    "SelectParams": ("moba_select.cu", build.SELECT_PARAMS),
}


def test_declarations_of_every_form_give_their_fields():
    text = """
    struct Other { int x; };
    struct P {
        const float* a, *b;        // two pointers, one statement
        unsigned char* bytes;
        long long strides[3], n;  // an array beside a scalar
        const void* tables[2];
        int  k;
        unsigned long long mask;
        float scale;
    };"""
    dtype = c_structs.parse(text, "P")
    assert dtype.names == ("a", "b", "bytes", "strides", "n", "tables", "k", "mask", "scale")
    assert dtype.fields["strides"][0] == np.dtype((np.int64, (3,)))
    assert dtype.fields["tables"][0] == np.dtype((np.uint64, (2,)))
    assert [dtype.fields[n][0] for n in ("k", "mask", "scale")] == [np.int32, np.uint64, np.float32]
    assert dtype.fields["mask"][1] == 80 and dtype.itemsize == 96  # k (at 72) padded to mask's 8 bytes


def test_an_unknown_type_or_unreadable_declarator_is_refused_by_name():
    with pytest.raises(ValueError, match="struct P: field h has type 'half', which has no mirror"):
        c_structs.parse("struct P { half h; };", "P")
    with pytest.raises(ValueError, match="struct P: cannot read the declarator '3'"):
        c_structs.parse("struct P { int a, 3; };", "P")


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not on PATH")
def test_each_fields_offset_is_the_host_compilers(tmp_path):
    """The C compiler is the oracle of the layout: each struct, its device types declared as their host
    equivalents, compiled with g++, prints every field's offset and the struct's size."""
    prelude = """#include <cstddef>
#include <cstdio>
struct int2 { int x, y; };
struct ulonglong2 { unsigned long long x, y; };
typedef unsigned short elem_t, Element;
"""
    body = []
    for struct, (filename, dtype) in STRUCTS.items():
        prelude += c_structs.definition((env.kernels_dir() / filename).read_text(), struct) + "\n"
        body += [
            f'std::printf("{struct} {name} %zu\\n", offsetof({struct}, {name}));' for name in dtype.names
        ]
        body.append(f'std::printf("{struct} sizeof %zu\\n", sizeof({struct}));')
    source = tmp_path / "offsets.cpp"
    source.write_text(prelude + "int main() {\n" + "\n".join(body) + "\n}\n")
    subprocess.run(["g++", "-std=c++17", "-o", str(tmp_path / "offsets"), str(source)], check=True)
    printed = subprocess.run([str(tmp_path / "offsets")], capture_output=True, text=True, check=True).stdout
    for line in printed.splitlines():
        struct, name, offset = line.split()
        dtype = STRUCTS[struct][1]
        want = dtype.itemsize if name == "sizeof" else dtype.fields[name][1]
        assert int(offset) == want, (struct, name)
    assert len(printed.splitlines()) == sum(len(d.names) + 1 for _, d in STRUCTS.values())
