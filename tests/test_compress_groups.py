"""Which elements share a quantisation group (csrc/saved/store.cpp): a saved tensor's groups stay within the rows
of its memory, and a view with gaps (q, k or v sliced out of one qkv) shares no group with the elements it does
not see.

Before: a transposed save (the key of eager attention's QK^T) was grouped along its logical last dim, two
tokens to a group, so a padded token's zero row came back as its neighbour's rounding; a view compressed
through its base shared groups with the base's other values, so another head's large values set its scale
(relative error 42) and an inf there made it NaN.
"""
import pytest
import torch

from effmem.compress import compress_activations

SEEN = {}


class Save(torch.autograd.Function):
    """Saves t for backward and hands what backward restored to SEEN."""

    @staticmethod
    def forward(ctx, dummy, *ts):
        ctx.save_for_backward(*ts)
        return dummy.clone()

    @staticmethod
    def backward(ctx, g):
        SEEN["saved"] = [t.detach() for t in ctx.saved_tensors]   # as restored: their strides, their memory
        return (g,) + (None,) * len(ctx.saved_tensors)


def restored(*ts):
    """The tensors as backward reads them after a save under compress_activations, and the decisions."""
    dummy = torch.zeros(1, requires_grad=True)
    with compress_activations(min_numel=1, stochastic=False, record=True) as ctx:
        y = Save.apply(dummy, *ts)
    y.sum().backward()
    return SEEN.pop("saved"), [r["decision"] for r in ctx.records if r["decision"] != "parameter"]


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("other", ["large", "inf"])
def test_a_view_shares_no_group_with_what_it_does_not_see(other):
    torch.manual_seed(0)
    small = torch.randn(64, 128)
    inf = torch.tensor([float("inf"), -float("inf")])
    around = 1e4 * torch.randn(64, 32) if other == "large" else inf.repeat(64, 16)
    x = torch.cat([around, small], dim=1)   # [64, 160]: the view x[:, 32:] is `small`
    (got,), decisions = restored(x[:, 32:])
    (alone,), _ = restored(small.clone())
    assert decisions == ["compressed"]
    assert got.stride() == (160, 1)
    assert rel(got, small) < 2 * rel(alone, small) < 0.02   # as precise as the same values saved alone


def test_slices_of_one_qkv_not_aligned_to_the_group_size_are_compressed_once_within_their_heads():
    """q, k and v of width 64 out of one 192-wide row: groups of 64, one quantisation for all three."""
    torch.manual_seed(0)
    qkv = torch.randn(32, 192)
    qkv[:, 64:128] *= 1000.0   # k's values are far larger: they must not set q's or v's scale
    parts = qkv.split(64, dim=1)
    got, decisions = restored(*parts)
    assert decisions == ["compressed", "deduplicated", "deduplicated"]
    assert got[0].data_ptr() + 64 * 4 == got[1].data_ptr()   # one restored memory, as the originals shared one
    for g, p in zip(got, parts):
        assert rel(g, p) < 0.01


def test_a_transposed_save_is_grouped_by_the_rows_of_its_memory():
    """The key [tokens, 64] saved transposed ([64, tokens], stride (1, 64)): a padded token's zero row comes back
    exactly zero, as it does saved untransposed."""
    torch.manual_seed(0)
    k = 4 * torch.randn(128, 64)
    k[0] = 0.0
    (got,), decisions = restored(k.t())
    assert decisions == ["compressed"]
    assert got.stride() == (1, 64)
    assert torch.count_nonzero(got.t()[0]) == 0
    assert rel(got, k.t()) < 0.01


def test_a_view_without_runs_of_whole_groups_is_kept_exactly():
    """Every other element of each row: any group would mix it with the ones it skips, so it is kept."""
    x = torch.randn(64, 256)
    (got,), decisions = restored(x[:, ::2])
    assert decisions == ["strided_view"]
    assert torch.equal(got, x[:, ::2])


def test_a_second_view_that_the_first_ones_groups_straddle_takes_groups_of_its_own():
    """The first view (offset 64 in a 256-wide row) makes groups of 64; the second, at offset 32, would share
    them with values it does not see (1e6): it is quantised apart, in groups of 32."""
    x = torch.randn(64, 256)
    x[:, :32] = 1e6
    got, decisions = restored(x[:, 64:192], x[:, 32:96])
    assert decisions == ["compressed", "compressed"]
    assert rel(got[0], x[:, 64:192]) < 0.01 and rel(got[1], x[:, 32:96]) < 0.01


def test_a_memory_saved_through_an_alias_with_longer_rows_is_not_shared():
    """[32, 192] and [64, 96] views of one memory: the first one's groups (128 + 64 per 192-row) span two of the
    second's rows, so a small row took its large neighbour's scale (relative error 49). Each takes its own."""
    x = torch.randn(64, 96)
    x[1::2] *= 1e4
    got, decisions = restored(x.view(32, 192), x)
    assert decisions == ["compressed", "compressed"]
    assert rel(got[1][0::2], x[0::2]) < 0.01


@pytest.mark.parametrize("second", ["rows", "every_other_row"])
def test_an_entry_whose_groups_cover_several_rows_is_not_shared(second):
    """[32, 128] first (groups of 128), then [128, 32] rows or a view of every other one: each group of the
    first covers four of the second's rows, so a small row took its large neighbours' scale (relative error
    56, 48 for the view, which does not even see them). The second takes groups of its own rows."""
    x = torch.randn(128, 32)
    x[1::2] *= 1e4
    later = x if second == "rows" else x[0::2]
    got, decisions = restored(x.view(32, 128), later)
    assert decisions == ["compressed", "compressed"]
    assert rel(got[1][0::2] if second == "rows" else got[1], x[0::2]) < 0.01


def test_heads_of_a_fused_qkv_are_runs_of_heads_times_head_dim():
    """q of a qkv of head_dim 80 viewed as [tokens, heads, 80] (and transposed as SDPA takes it): its runs are
    heads x 80 long, so groups of 128 fit; taken as runs of 80 (gcd 16) it was kept uncompressed."""
    qkv = torch.randn(16, 3 * 32 * 80)
    q = qkv.view(16, 3, 32, 80)[:, 0]
    got, decisions = restored(q, q.transpose(0, 1))
    assert decisions == ["compressed", "deduplicated"]
    assert rel(got[0], q) < 0.01 and rel(got[1], q.transpose(0, 1)) < 0.01
