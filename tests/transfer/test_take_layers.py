"""take_layers gathers the pages of every layer of a layer view, as index_select would,
on views whose layers are not adjacent and on ones whose page bytes are not whole words."""

import torch

from kvtier.transfer.pools import take_layers


def _interleaved(layers: int, pages: int, page_bytes: int, stride: int) -> torch.Tensor:
    base = torch.randint(0, 256, (layers * stride,), dtype=torch.uint8)
    return base.as_strided((layers, pages, page_bytes), (stride, page_bytes, 1))


def test_take_layers_on_an_interleaved_view_equals_index_select() -> None:
    view = _interleaved(3, 10, 64, 10 * 64 * 2)  # another component's pages between layers
    index = torch.tensor([7, 0, 7, 3], dtype=torch.int64)
    got = take_layers(view, index)
    assert got.dtype == torch.uint8 and got.shape == (3, 4, 64)
    assert torch.equal(got, view.index_select(1, index))
    assert torch.equal(got[2, 0], view[2, 7])


def test_take_layers_gathers_bytes_when_pages_are_not_whole_words() -> None:
    view = _interleaved(2, 5, 12, 5 * 12 + 4)
    index = torch.tensor([4, 1], dtype=torch.int64)
    got = take_layers(view, index)
    assert got.shape == (2, 2, 12)
    assert torch.equal(got, view.index_select(1, index))


def test_take_layers_returns_a_copy() -> None:
    view = _interleaved(2, 4, 64, 4 * 64)
    got = take_layers(view, torch.tensor([1], dtype=torch.int64))
    before = got.clone()
    view.zero_()
    assert torch.equal(got, before) and bool(before.any())
