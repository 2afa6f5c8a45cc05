"""Token rules: the predicate over (b, h, q, k) that a layout's partial blocks defer to (`TokenRule`), with
the traced program that the kernels compile and analyse (`cusparseattn.analyses`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from . import analyses
from .analyses import KernelRule
from .program import Program

MAX_PARAMS, MAX_ARRAYS = 8, 4  # the P0..P7 and A0..A3 slots a rule's C expression may use


@dataclass(frozen=True, eq=False)
class TokenRule:
    """A token-level attention rule, vectorised: ``fn(b, h, q, k) -> bool array``.

    ``b, h, q, k`` are integer arrays that broadcast against each other (absolute batch, query-head, query and
    key indices). ``program`` is the rule traced (`cusparseattn.mods.mask_rule` makes such rules from a
    Python function): the kernels compile its C text, whose integer parameters (``params``) and captured
    int32 arrays (``arrays``) are run-time values, so new values never recompile. Its output ``"value"`` is
    the whole rule; an output ``"partial"``, where there is one, is what it decides inside the partial
    blocks of the layout it was traced for (`cusparseattn.program.Program.partial_output`), the only place
    the kernels evaluate it. A rule without a program reaches the kernels as a bit mask per partial tile.

    >>> from cusparseattn.mods import mask_rule
    >>> r = mask_rule(lambda b, h, q, k: k <= q, name="causal")
    >>> bool(r(0, 0, 5, 3)), r.c_expr, r.kernel.key_band
    (True, '(k <= q)', (None, 'q'))
    """

    name: str
    fn: Callable[..., np.ndarray]
    program: Program | None = None

    def __call__(self, b, h, q, k) -> np.ndarray:
        return np.asarray(self.fn(b, h, q, k), dtype=bool)

    @property
    def traced_from(self) -> Callable | None:
        """The user's function that the rule was traced from, or None."""
        return getattr(self.fn, "traced_from", None)

    @cached_property
    def whole(self) -> KernelRule | None:
        """The whole rule as the kernels compile it (block classification, dynamic layouts), or None."""
        return None if self.program is None else analyses.kernel_rule(self.program, "value")

    @cached_property
    def kernel(self) -> KernelRule | None:
        """What the attention kernels compile inside the partial blocks of the rule's layouts, or None."""
        if self.program is None:
            return None
        output = self._output(whole=False)
        return self.whole if output == "value" else analyses.kernel_rule(self.program, output)

    def _output(self, whole: bool) -> str:
        """The program's output that `whole` (True) or `kernel` (False) compiles."""
        return "value" if whole or "partial" not in self.program.outputs else "partial"

    @property
    def c_expr(self) -> str | None:
        """The whole rule's C expression (`whole`), or None."""
        return None if self.whole is None else self.whole.expr

    @property
    def kernel_expr(self) -> str | None:
        """The C expression that the attention kernels compile (`kernel`), or None."""
        return None if self.kernel is None else self.kernel.expr

    @property
    def params(self) -> tuple[int, ...]:
        return () if self.program is None else self.program.int_params

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        return () if self.program is None else self.program.arrays

    def narrow(self, positions: int, whole: bool = False) -> bool:
        """Whether the kernels may take `kernel` (or `whole`) in 32-bit integers for positions below
        `positions`: its text is narrowable and every integer it computes, bands included, stays below 2^31
        at the parameters' and arrays' present values (`cusparseattn.analyses.largest`)."""
        rule = self.whole if whole else self.kernel
        if rule is None or not rule.narrowable:
            return False
        node = self.program.outputs[self._output(whole)]
        bands = [x for var in "kq" for x in analyses.band(node, var) or ()]
        return analyses.largest(node, positions, tuple(bands)) < 2**31

    @property
    def structure(self) -> tuple:
        """What changes compiled code: the program's texts and counts, never its values."""
        return () if self.program is None else self.program.structure

    def __repr__(self) -> str:
        return f"TokenRule({self.name!r})"


def is_torch(x) -> bool:
    """Whether ``x`` is a torch object (checked without importing torch)."""
    return type(x).__module__.split(".")[0] == "torch"
