"""`core.wide_rows`: argmax and top-k over vocabulary-wide rows through block maxima, against torch's own."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.logits import wide_rows


def _rows(kind: str, m: int, width: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(m, width, generator=generator) * 3
    if kind == "peaked":
        rows[:, torch.randint(0, width, (m,), generator=generator)] += 40
    elif kind == "ties":
        rows = rows.round()  # the maximum and the k-th repeated across many columns
    elif kind == "bfloat16":
        rows = rows.bfloat16()
    elif kind == "banned":
        rows[:, : width - 300] = -float("inf")
    elif kind == "all_banned":
        rows[:] = -float("inf")
    elif kind == "max_in_tail":
        rows[:, -1] = 99.0
        rows[:, -3] = 99.0
    elif kind == "overlap":  # the maximum twice: at the end of the last whole block (the tail's overlaps it), later
        rows[:, -wide_rows.BLOCK + 1] = 99.0
        rows[:, -1] = 99.0
    elif kind == "nan":
        rows[0, 7] = float("nan")
    elif kind == "nan_tail":  # NaN beats +inf in torch's argmax, wherever it sits
        rows[:, 5] = float("inf")
        rows[0, -1] = float("nan")
    elif kind == "offset":  # a view that does not start at its storage's first element
        rows = torch.randn(m + 1, width, generator=generator)[1:]
    return rows


KINDS = ["random", "peaked", "ties", "bfloat16", "banned", "all_banned", "max_in_tail", "overlap", "nan", "nan_tail",
         "offset"]


@pytest.mark.parametrize("width", [151_936, 50_257, 32_000, 300])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 5])
def test_row_argmax_is_torch_argmax(width, kind, m):
    """The same column as torch.argmax: the first maximal one (ties), NaN rows and narrow rows included."""
    rows = _rows(kind, m, width, seed=width + m)
    assert torch.equal(wide_rows.row_argmax(rows), rows.argmax(dim=-1))


@pytest.mark.parametrize("width", [151_936, 50_257, 300])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 8, 58])
def test_row_topk_values_are_torch_topk(width, kind, k):
    """The same values as torch.topk, descending; the columns hold those values, once each."""
    rows = _rows(kind, 4, width, seed=width + k)
    values, columns = wide_rows.row_topk(rows, k)
    expected = rows.topk(k, dim=-1).values
    nan = kind.startswith("nan")
    assert torch.equal(values, expected) or (nan and torch.equal(values[1:], expected[1:]))
    assert torch.equal(rows.gather(1, columns), values) or nan
    assert all(len(set(row)) == k for row in columns.tolist())


def test_the_block_path_is_taken_on_wide_rows(monkeypatch):
    """On a wide CPU row the slow operations run on a few blocks only: torch.topk never sees the whole row."""
    rows = _rows("peaked", 3, 151_936, seed=1)
    seen = []
    real = torch.Tensor.topk

    def counting(self, *args, **kwargs):
        seen.append(self.shape[-1])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "topk", counting)
    wide_rows.row_topk(rows, 8)
    assert seen and max(seen) < 151_936 // 4
