"""``nanolab._C.linear_rows``: the products of one or two rows that `prepack_weights` sends to C++. Each output
is F.linear's up to float rounding, and the same float whatever the number of rows or threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanolab.model.prepacked import HAS_KERNEL

pytestmark = pytest.mark.skipif(not HAS_KERNEL, reason="the C++ kernels are not built")


def run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, threads: int) -> torch.Tensor:
    from nanolab import _ext

    return torch.from_numpy(
        _ext._C.linear_rows(x.numpy(), w.numpy(), None if b is None else b.numpy(), threads)
    )


def problem(rows: int, n_in: int, n_out: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, n_in, generator=g),
        torch.randn(n_out, n_in, generator=g),
        torch.randn(n_out, generator=g),
    )


# widths below, at and off the 8-float vectors; outputs below, at and off the 6 and 8 weight rows served at
# once, and enough (with 771 inputs) for the work to be shared between threads
@pytest.mark.parametrize("n_in", [1, 5, 8, 24, 771])
@pytest.mark.parametrize("n_out", [1, 7, 13, 64, 1000])
def test_it_computes_f_linear(n_in, n_out):
    for rows in (1, 2, 3, 5):
        x, w, b = problem(rows, n_in, n_out, seed=rows)
        for bias in (b, None):
            exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            # float32 rounding: a few ulps of the sum of the terms' sizes (a term left out or counted twice
            # is about a thousand times that)
            scale = F.linear(x.abs(), w.abs(), None if bias is None else bias.abs()).double()
            for got in (run(x, w, bias, 2), F.linear(x, w, bias)):
                assert ((got.double() - exact).abs() <= 1e-6 * scale + 1e-30).all(), (rows, bias is None)


# every remainder of the 8-float vectors, and (771 and more) enough work to be shared between threads
@pytest.mark.parametrize("n_in", [12, 13, 15, 768, 771, 775])
def test_an_output_is_the_same_float_whatever_the_rows_and_threads(n_in):
    x, w, b = problem(5, n_in, 1000)
    alone = torch.stack([run(x[i : i + 1], w, b, 1)[0] for i in range(5)])  # one row at a time, one thread
    assert run(x, w, b, 1).abs().sum() > 0
    for threads in (1, 2, 3, 8):
        for rows in (2, 3, 5):
            assert torch.equal(run(x[:rows], w, b, threads), alone[:rows]), (rows, threads)


def test_no_rows_make_an_empty_output():
    _, w, b = problem(1, 16, 8)
    assert run(torch.zeros(0, 16), w, b, 2).shape == (0, 8)


@pytest.mark.parametrize(
    ("x", "w", "b", "message"),
    [
        (torch.zeros(16), torch.zeros(8, 16), None, r"x must be \(rows, in\), got shape \(16,\)"),
        (
            torch.zeros(2, 16),
            torch.zeros(8, 16, 1),
            None,
            r"weight must be \(out, in\), got shape \(8, 16, 1\)",
        ),
        (
            torch.zeros(2, 15),
            torch.zeros(8, 16),
            None,
            r"x \(2, 15\) has 15 columns but weight \(8, 16\) has 16",
        ),
        (
            torch.zeros(2, 16),
            torch.zeros(8, 16),
            torch.zeros(7),
            r"bias \(7,\) needs one entry per row of weight",
        ),
    ],
)
def test_shapes_that_do_not_fit_are_refused(x, w, b, message):
    with pytest.raises(ValueError, match=message):
        run(x, w, b, 1)
