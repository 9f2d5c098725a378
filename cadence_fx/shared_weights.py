"""What the exported programs of one catalog share: the step's weights, buffers and constants.

A catalog is one streaming step exported once per signature class. Exported from one module in one
process, its programs already share every parameter and buffer. Saved and loaded again
(``torch.export.save``/``load``), each program comes back with its own copy: three programs, three
copies of the weights. :func:`share_catalog_tensors` folds equal copies back into one.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.export import ExportedProgram

from cadence_fx.determinism import bits_equal

__all__ = ["share_catalog_tensors"]


def share_catalog_tensors(eps: Sequence[ExportedProgram]) -> int:
    """Point every program's parameters, buffers and constants at the first program's tensor of the
    same name when the two are bitwise equal (same shape, dtype and device); returns the bytes freed.

    Values are unchanged, so outputs are unchanged; the programs' tensors are edited in place.
    Tensors that differ are left alone (they are genuinely per-class).
    """
    if len(eps) < 2:
        return 0
    first = eps[0]
    freed = 0
    for ep in eps[1:]:
        for table, ref in ((ep.state_dict, first.state_dict), (ep.constants, first.constants)):
            for name, t in list(table.items()):
                r = ref.get(name)
                if not _same(t, r):
                    continue
                if t.untyped_storage().data_ptr() != r.untyped_storage().data_ptr():
                    freed += t.untyped_storage().nbytes()
                table[name] = r
    return freed


def _same(a: object, b: object) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device or a.stride() != b.stride():
        return False
    if type(a) is not type(b) or a.requires_grad != b.requires_grad:
        return False
    if a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.storage_offset() == b.storage_offset():
        return True
    return bits_equal(a.detach(), b.detach())
