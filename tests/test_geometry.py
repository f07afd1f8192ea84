"""The geometry module against NATTEN's definition, and the kernels' copy of it."""

import itertools

import pytest
import torch

from na3d import configs, geometry


def natten_sees(q, k, length, kernel, dilation=1, causal=False):
    """Query q sees key k: a literal transcription of NATTEN's flex mask (stride 1)."""
    d = dilation
    qg, kg = q % d, k % d
    qd, kd = q // d, k // d
    group_len = length // d + (1 if qg < length % d else 0)
    if qg != kg:
        return False
    if causal:
        return qd - kd >= 0 and qd - kd < kernel
    left, right = kernel // 2, kernel // 2 + (kernel % 2 - 1)
    center = min(max(qd, left), group_len - 1 - right)
    return 0 <= center - kd <= left or 0 <= kd - center <= right


CASES = [(L, K, d, c) for L in (1, 2, 5, 8, 13) for K in range(1, L + 1) for d in (1, 2, 3)
         for c in (False, True) if K * d <= L]


@pytest.mark.parametrize("length,kernel,dilation,causal", CASES)
def test_mask_1d_equals_natten(length, kernel, dilation, causal):
    got = geometry.mask_1d(length, kernel, dilation, causal)
    want = torch.tensor([[natten_sees(q, k, length, kernel, dilation, causal) for k in range(length)]
                         for q in range(length)])
    assert torch.equal(got, want)


@pytest.mark.parametrize("length", [1, 4, 7, 16])
def test_every_query_sees_exactly_k_keys(length):
    for kernel in range(1, length + 1):
        assert (geometry.mask_1d(length, kernel).sum(1) == kernel).all()
        starts = [geometry.window_start(i, length, kernel) for i in range(length)]
        assert starts == sorted(starts), "window starts must not decrease"


def test_window_start_int_and_tensor_agree():
    for length, kernel in itertools.product(range(1, 12), range(1, 12)):
        if kernel > length:
            continue
        idx = torch.arange(length)
        assert geometry.window_start(idx, length, kernel).tolist() == [
            geometry.window_start(i, length, kernel) for i in range(length)]


def test_union_of_windows_is_the_union():
    for length, kernel in [(9, 3), (9, 9), (13, 5), (6, 1)]:
        m = geometry.mask_1d(length, kernel)
        for first in range(length):
            for last in range(first, length):
                keys = m[first:last + 1].any(0).nonzero().flatten()
                start, stop = geometry.union_of_windows(first, last, length, kernel)
                assert keys.tolist() == list(range(start, stop))


def test_queries_seeing_is_the_dual_of_the_windows():
    for length, kernel in [(9, 3), (9, 9), (13, 5), (6, 1), (20, 7), (5, 4), (8, 2)]:
        m = geometry.mask_1d(length, kernel)
        for a in range(length):
            for b in range(a, length):
                seers = m[:, a:b + 1].any(1).nonzero().flatten().tolist()
                first, stop = geometry.queries_seeing(a, b, length, kernel)
                assert seers == list(range(first, stop)), (length, kernel, a, b)


def test_neighborhood_mask_is_product_of_axes():
    shape, kernel = (3, 4, 5), (3, 3, 5)
    m = geometry.neighborhood_mask(shape, kernel)
    idx = list(itertools.product(*(range(s) for s in shape)))
    axes = [geometry.mask_1d(s, k) for s, k in zip(shape, kernel)]
    for a, qa in enumerate(idx):
        for b, kb in enumerate(idx):
            assert m[a, b] == all(ax[i, j] for ax, i, j in zip(axes, qa, kb))
    assert (m.sum(1) == 3 * 3 * 5).all()


def test_issued_flops_ratio_counts_padded_work():
    # Kernel equal to the grid and one tile over everything: nothing wasted.
    assert geometry.issued_flops_ratio((4, 4, 4), (4, 4, 4), (4, 4, 4), (4, 4, 4)) == 1.0
    # Brute-force count for a small case.
    shape, kernel, qt, kt = (5, 6, 7), (3, 3, 5), (2, 4, 4), (1, 2, 4)
    issued = 1
    for L, K, a, b in zip(shape, kernel, qt, kt):
        total = 0
        for first in range(0, L, a):
            s, e = geometry.union_of_windows(first, min(first + a, L) - 1, L, K)
            total += a * b * -(-(e - s) // b)
        issued *= total
    useful = 5 * 6 * 7 * 3 * 3 * 5
    assert geometry.issued_flops_ratio(shape, kernel, qt, kt) == pytest.approx(issued / useful)


def test_issued_flops_ratio_of_key_boxes_counts_their_scans():
    """dK/dV: key boxes on a fixed grid, each scanning, from the first query that sees
    it, in query boxes (brute force over every query-key pair), which is not the
    forward's count with the two boxes swapped."""
    shape, kernel, kt, qt = (5, 6, 7), (3, 3, 5), (2, 4, 4), (1, 2, 4)
    issued = 1
    for L, K, a, b in zip(shape, kernel, kt, qt):
        total = 0
        for first in range(0, L, a):
            keys = range(first, min(first + a, L))
            seeing = [i for i in range(L) if any(j in keys for j in range(*geometry.window_bounds(i, L, K)))]
            total += a * b * -(-(seeing[-1] + 1 - seeing[0]) // b)
        issued *= total
    useful = 5 * 6 * 7 * 3 * 3 * 5
    assert geometry.issued_flops_ratio(shape, kernel, kt, qt, own="keys") == pytest.approx(issued / useful)
    # The dit-wan grid with the table's dK/dV boxes (4x4x8 keys, 2x4x8 queries): the forward's count
    # with the boxes swapped says 2.79, the kernel issues 3.10.
    assert geometry.issued_flops_ratio((21, 30, 52), (9, 15, 15), (2, 4, 8), (4, 4, 8)) == pytest.approx(2.79, abs=0.01)
    assert geometry.issued_flops_ratio((21, 30, 52), (9, 15, 15), (4, 4, 8), (2, 4, 8), own="keys") == \
        pytest.approx(3.10, abs=0.01)
    with pytest.raises(ValueError, match="own"):
        geometry.issued_flops_ratio(shape, kernel, kt, qt, own="values")


def test_causal_scans_cover_no_more_than_centered_ones():
    """A causal axis' union of windows is as wide as a centered one (``box - 1 + K``)
    and narrower at the start, so a kernel tiled for centered windows issues no
    more products on it: per axis, for every table configuration and the feature
    base shapes. The useful count is the clipped windows'."""
    for grid in ((24, 48, 64), (36, 64, 96), (7, 9, 13)):
        for bucket in configs.load_table("sm90")["forward"]:
            for _, entry in configs.bucket_options(bucket):
                for L, K, a, b in zip(grid, (3, 5, 5), entry["q_tile"], entry["kv_tile"]):
                    assert (geometry.issued_pairs_1d(L, K, a, b, is_causal=True)
                            <= geometry.issued_pairs_1d(L, K, a, b))
    assert geometry.useful_pairs_1d(5, 3, is_causal=True) == 1 + 2 + 3 + 3 + 3
    mask = geometry.mask_1d(5, 3, is_causal=True)
    assert mask.sum().item() == geometry.useful_pairs_1d(5, 3, is_causal=True)


try:
    import triton
    import triton.language as tl

    from na3d.kernels.windows import queries_seeing as device_queries_seeing
    from na3d.kernels.windows import seeing_all as device_seeing_all
    from na3d.kernels.windows import seen_by_all as device_seen_by_all
    from na3d.kernels.windows import window_bounds as device_window_bounds
    from na3d.kernels.windows import window_start as device_window_start

    @triton.jit
    def _window_probe(Start, Bounds, L, K, S, CAUSAL: tl.constexpr, STRIDED: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(Start + i, device_window_start(i, L, K), mask=i < L)
        first, stop = device_window_bounds(i, L, K, S, CAUSAL, STRIDED)
        tl.store(Bounds + 2 * i, first, mask=i < L)
        tl.store(Bounds + 2 * i + 1, stop, mask=i < L)

    @triton.jit
    def _queries_seeing_probe(Out, a, b, L, K, S, CAUSAL: tl.constexpr, STRIDED: tl.constexpr):
        first, stop = device_queries_seeing(a, b, L, K, S, CAUSAL, STRIDED)
        tl.store(Out, first)
        tl.store(Out + 1, stop)
        start, stop = device_seen_by_all(a, b, L, K, S, CAUSAL, STRIDED)
        tl.store(Out + 2, start)
        tl.store(Out + 3, stop)
        first, stop = device_seeing_all(a, b, L, K, S, CAUSAL, STRIDED)
        tl.store(Out + 4, first)
        tl.store(Out + 5, stop)
except ImportError:  # pragma: no cover - Triton is a test dependency
    triton = None


@pytest.mark.parametrize("stride", [1, 2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_device_geometry_matches_python(causal, stride):
    """The kernels' window functions (interpreter or GPU) equal the Python ones."""
    from na3d.launch import kernels_interpreted

    if triton is None:
        pytest.skip("Triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not kernels_interpreted():
        pytest.skip("no GPU and the Triton interpreter is not active")
    for length, kernel in [(1, 1), (7, 1), (7, 3), (7, 7), (16, 4), (16, 5), (33, 11), (64, 27)]:
        if stride > kernel:
            continue
        start = torch.full((64,), -1, dtype=torch.int32, device=device)
        bounds = torch.full((64, 2), -1, dtype=torch.int32, device=device)
        _window_probe[(1,)](start, bounds, length, kernel, stride, CAUSAL=causal, STRIDED=stride > 1, BLOCK=64)
        assert start[:length].tolist() == [geometry.window_start(i, length, kernel) for i in range(length)]
        want = [list(geometry.window_bounds(i, length, kernel, 1, causal, stride)) for i in range(length)]
        assert bounds[:length].tolist() == want
    for length, kernel in [(7, 3), (13, 5), (16, 1), (9, 9), (10, 4)]:
        if stride > kernel:
            continue
        for a in range(0, length, 2):
            for b in range(a, length, 3):
                out = torch.zeros(6, dtype=torch.int32, device=device)
                _queries_seeing_probe[(1,)](out, a, b, length, kernel, stride, CAUSAL=causal, STRIDED=stride > 1)
                assert tuple(out.tolist()) == (*geometry.queries_seeing(a, b, length, kernel, causal, stride),
                                               *geometry.keys_seen_by_all(a, b, length, kernel, causal, stride),
                                               *geometry.queries_seeing_all(a, b, length, kernel, causal, stride))


@pytest.mark.parametrize("stride", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_union_and_queries_seeing_per_causal_flag(causal, stride):
    for length, kernel in [(7, 3), (10, 4), (9, 9), (12, 1), (11, 6), (13, 5)]:
        if stride > kernel:
            continue
        sees = geometry.mask_1d(length, kernel, is_causal=causal, stride=stride)
        for a in range(length):
            for b in range(a, length):
                rows = sees[:, a:b + 1].any(1).nonzero().flatten().tolist()
                assert rows == list(range(rows[0], rows[-1] + 1)), "queries seeing a run are contiguous"
                assert geometry.queries_seeing(a, b, length, kernel, causal, stride) == (rows[0], rows[-1] + 1)
                lo, hi = geometry.union_of_windows(a, b, length, kernel, causal, stride)
                cols = sees[a:b + 1].any(0).nonzero().flatten().tolist()
                assert (lo, hi) == (cols[0], cols[-1] + 1)


@pytest.mark.parametrize("stride", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_full_ranges_are_the_intersections(causal, stride):
    """The keys every query of a run sees, and the queries that see every key of a run
    (the kernels' full boxes, ``tiles.full_boxes``): exactly those of the mask."""
    for length, kernel in [(7, 3), (10, 4), (9, 9), (12, 1), (11, 6), (13, 5), (16, 8)]:
        if stride > kernel:
            continue
        sees = geometry.mask_1d(length, kernel, is_causal=causal, stride=stride)
        for a in range(length):
            for b in range(a, length):
                lo, hi = geometry.keys_seen_by_all(a, b, length, kernel, causal, stride)
                assert sees[a:b + 1].all(0).nonzero().flatten().tolist() == list(range(lo, hi)), (a, b)
                lo, hi = geometry.queries_seeing_all(a, b, length, kernel, causal, stride)
                assert sees[:, a:b + 1].all(1).nonzero().flatten().tolist() == list(range(lo, hi)), (a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_union_width_bound_holds_for_every_length_and_box(causal):
    """The kernels scan a fixed axis once per program only if this bound is right."""
    for kernel, stride, box in itertools.product([1, 2, 3, 5, 6, 11], [1, 2, 3, 4], [1, 2, 3, 4, 8]):
        if stride > kernel:
            continue
        bound = geometry.union_width_bound(box, kernel, causal, stride)
        widest = 0
        for length in range(kernel, kernel + 3 * box + 2 * stride + 4):
            for first in range(length):  # every run, not only box-aligned ones
                start, stop = geometry.union_of_windows(first, min(first + box, length) - 1, length, kernel,
                                                        causal, stride)
                widest = max(widest, stop - start)
        assert widest <= bound, (kernel, stride, box, widest, bound)
        if stride == 1:
            assert widest == bound, "the stride-1 bound is reached on long enough axes"


@pytest.mark.parametrize("own", ["queries", "keys"])
@pytest.mark.parametrize("causal", [False, True])
def test_full_box_pairs_agree_with_the_mask(own, causal):
    # A pair is full when every query of one box sees every key of the other and the
    # scanned box stays inside the scanned range: checked here from mask_1d itself,
    # over lengths, kernels, strides and box sizes, including borders and short groups.
    for length in (1, 5, 8, 12):
        for kernel in range(1, length + 1, 2):
            for stride in {1, 2, 3, kernel}:
                if stride > kernel:
                    continue
                mask = geometry.mask_1d(length, kernel, is_causal=causal, stride=stride)
                for box, scanned in ((1, 1), (2, 2), (2, 4), (4, 2), (4, 4)):
                    scans = geometry.key_scans_1d if own == "queries" else geometry.query_scans_1d
                    pairs = list(geometry.full_box_pairs_1d(length, kernel, box, scanned, causal, stride, own))
                    expected = []
                    for positions, steps in scans(length, kernel, box, scanned, causal, stride):
                        for lo, hi in steps:
                            others = list(range(lo, hi))
                            inside = hi <= length and all(0 <= j < length for j in others)
                            queries, keys = (positions, others) if own == "queries" else (others, positions)
                            seen = inside and bool(mask[list(queries)][:, list(keys)].all())
                            # (and no position of the scanned box outside the scanned range)
                            if own == "queries":
                                start, stop = geometry.union_of_windows(positions[0], positions[-1], length, kernel,
                                                                        causal, stride)
                            else:
                                start, stop = geometry.queries_seeing(positions[0], positions[-1], length, kernel,
                                                                      causal, stride)
                            expected.append((seen and hi <= stop, box * scanned))
                    assert pairs == expected, (length, kernel, stride, box, scanned)
                    assert geometry.block_sparse_axis([length], kernel, box, scanned, causal, stride, own) == all(
                        full for full, _ in expected)


def test_full_products_share_on_a_perfectly_block_sparse_stride():
    # NATTEN's showcase: 2x8x8 boxes in 2x8x8 stride groups, windows tiled by 2x8x8 key boxes.
    grid, kernel, stride = (30, 48, 80), (18, 24, 24), (2, 8, 8)
    assert geometry.full_products_share(grid, kernel, (2, 8, 8), (2, 8, 8), stride=stride) == 1.0
    assert geometry.issued_flops_ratio(grid, kernel, (2, 8, 8), (2, 8, 8), stride=stride) == 1.0
    # The stride-1 boxes issue more and hold masked pairs.
    assert geometry.full_products_share(grid, kernel, (4, 4, 4), (2, 2, 16), stride=stride) < 1.0
