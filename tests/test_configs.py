"""Launch configurations: the per-arch tables, their buckets and alternatives, register caps."""

import pytest
import torch


def test_register_caps_in_configs():
    # A cap is None or a multiple of 8 the compiler accepts; unset, no keyword is
    # passed (AMD's backend rejects it); table entries carry it into the configs.
    from na3d import configs

    with pytest.raises(ValueError, match="maxnreg"):
        configs.ForwardConfig((1, 4, 4), (1, 4, 4), 4, 2, maxnreg=100)
    with pytest.raises(ValueError, match="dkdv_maxnreg"):
        configs.BackwardConfig((1, 4, 4), (1, 4, 4), (1, 4, 4), (1, 4, 4), 4, 1, dkdv_maxnreg=512)
    assert configs.maxnreg_option(None) == {}
    assert configs.maxnreg_option(128) == {"maxnreg": 128}
    entry = {"dq": [[2, 4, 8], [4, 4, 4]], "dkdv": [[2, 4, 8], [4, 4, 4]], "num_warps": 4, "num_stages": 1,
             "dq_maxnreg": 128, "dkdv_maxnreg": 168}
    bwd = configs.fit_backward(entry, (8, 16, 16), (3, 5, 5))
    assert (bwd.dq_maxnreg, bwd.dkdv_maxnreg) == (128, 168)
    for arch in ("sm90", "default"):
        for bucket_kernel in ((3, 5, 5), (11, 11, 11), (3, 5, 27)):
            configs.forward_config(arch, (16, 32, 32), bucket_kernel, 64, torch.bfloat16)
            configs.backward_config(arch, (16, 32, 32), bucket_kernel, 64, torch.bfloat16)


def test_register_cap_narrowed_by_its_condition():
    # sm90's medium_window forward caps registers at 128 for head dims up to 64 (four
    # programs of four warps per SM), and not at 128, where the cap would spill.
    from na3d import configs

    def cap(head_dim):
        return configs.forward_config("sm90", (4, 8, 128), (3, 5, 27), head_dim, torch.bfloat16).maxnreg

    assert (cap(32), cap(64), cap(128)) == (128, 128, None)
    option = {"maxnreg": 168, "maxnreg_when": {"kernel_volume_min": 1000}}
    assert configs._register_cap(option, 64, (11, 11, 11), torch.float16) == 168
    assert configs._register_cap(option, 64, (3, 5, 5), torch.float16) is None
    assert configs._register_cap({"maxnreg": 168}, 64, (3, 5, 5), torch.float16) == 168
    with pytest.raises(ValueError, match="unknown condition"):
        configs._register_cap({"maxnreg": 168, "maxnreg_when": {"heads": 8}}, 64, (3, 5, 5), torch.float16)


def test_a_backward_entry_narrowed_by_its_own_condition(monkeypatch):
    # sm90: the short window's entry holds for head dims up to 64, and the small
    # window's backward too; at 128 both kernels take the small window's forward and
    # the medium window's backward (NOTES v45). Head dim 64 keeps its buckets.
    from na3d import configs

    def buckets(kernel, head_dim):
        return tuple(f("sm90", (24, 48, 64), kernel, head_dim, torch.bfloat16).bucket
                     for f in (configs.forward_config, configs.backward_config))

    assert buckets((3, 5, 5), 64) == ("short_window", "short_window")
    assert buckets((3, 7, 7), 64) == ("small_window", "small_window")
    assert buckets((3, 5, 5), 128) == buckets((3, 7, 7), 128) == ("small_window", "medium_window")
    bwd = configs.backward_config("sm90", (24, 48, 64), (3, 7, 7), 128, torch.bfloat16)
    medium = next(e for e in configs.load_table("sm90")["forward"] if e["bucket"] == "medium_window")
    assert bwd == configs.fit_backward(medium["backward"], (24, 48, 64), (3, 7, 7), "medium_window")
    # No later bucket whose backward holds: an error naming the call, not a guess.
    table = {"forward": [{"bucket": "only", "q_tile": [1, 4, 4], "kv_tile": [1, 4, 4], "num_warps": 4,
                          "num_stages": 1, "backward": {"when": {"head_dim_max": 64}, "dq": [[1, 4, 4], [1, 4, 4]],
                                                        "dkdv": [[1, 4, 4], [1, 4, 4]], "num_warps": 4,
                                                        "num_stages": 1}}]}
    monkeypatch.setattr(configs, "load_table", lambda arch: table)
    configs.forward_config.cache_clear(), configs.backward_config.cache_clear()
    try:
        assert configs.backward_config("test", (8, 8, 8), (3, 3, 3), 64, torch.float16).bucket == "only"
        with pytest.raises(ValueError, match="no later bucket's backward"):
            configs.backward_config("test", (8, 8, 8), (3, 3, 3), 128, torch.float16)
    finally:
        configs.forward_config.cache_clear(), configs.backward_config.cache_clear()


def test_backward_alternatives_chosen_by_each_kernels_products():
    # A backward entry's dQ and dK/dV pairs: the first, or a later one that issues at
    # least 5 % fewer of that kernel's products on the call's grid (NOTES v49). sm90's head-dim-128
    # large window: dit-wan's grid takes 4x8x4/2x8x4 (2.73 products per useful one
    # against 3.10), dit-hunyuan's keeps 4x4x8/2x4x8 (1.67; the other issues 1.72).
    # The medium window: edge-wide takes 1x8x8/2x8x4, dit-small-window 2x8x4/2x2x16.
    from na3d import configs, geometry

    def dkdv(shape, kernel, head_dim):
        bwd = configs.backward_config("sm90", shape, kernel, head_dim, torch.bfloat16)
        return bwd.dkdv_k_tile, bwd.dkdv_q_tile

    assert dkdv((21, 30, 52), (9, 15, 15), 128) == ((4, 8, 4), (2, 8, 4))
    assert dkdv((30, 48, 80), (18, 24, 24), 128) == ((4, 4, 8), (2, 4, 8))
    assert dkdv((4, 8, 128), (3, 5, 27), 64) == ((1, 8, 8), (2, 8, 4))
    assert dkdv((30, 48, 80), (5, 11, 11), 128) == ((2, 8, 4), (2, 2, 16))
    entry = {"dq": [[2, 4, 8], [4, 4, 4]], "dkdv": [[1, 4, 16], [2, 2, 16]], "num_warps": 4, "num_stages": 1,
             "dkdv_alternatives": [[[2, 8, 4], [2, 2, 16]], [[1, 8, 8], [2, 8, 4]]],
             "dq_alternatives": [[[2, 8, 4], [1, 2, 16]], [[4, 4, 4], [1, 8, 8]]]}
    for shape, kernel in (((24, 48, 64), (5, 11, 11)), ((4, 8, 128), (3, 5, 27)), ((7, 9, 40), (3, 5, 27))):
        bwd = configs.fit_backward(entry, shape, kernel)
        want, best = None, None
        for k_box, q_box in [entry["dkdv"], *entry["dkdv_alternatives"]]:
            k_box = configs.fit_tile(k_box, shape)
            q_box = configs.fit_tile(q_box, [min(L, b + 2 * (K - 1)) for L, b, K in zip(shape, k_box, kernel)])
            ratio = geometry.issued_flops_ratio(shape, kernel, k_box, q_box, own="keys")
            if best is None or ratio < configs.ALTERNATIVE_MARGIN * best:
                want, best = (k_box, q_box), ratio
        assert (bwd.dkdv_k_tile, bwd.dkdv_q_tile) == want, shape
        want, best = None, None
        for q_box, k_box in [entry["dq"], *entry["dq_alternatives"]]:
            q_box, k_box = configs.fitted_tiles(q_box, k_box, shape, kernel)
            ratio = geometry.issued_flops_ratio(shape, kernel, q_box, k_box)
            if best is None or ratio < configs.ALTERNATIVE_MARGIN * best:
                want, best = (q_box, k_box), ratio
        assert (bwd.dq_q_tile, bwd.dq_kv_tile) == want, shape


def test_bucket_alternatives_chosen_by_issued_products():
    # The 11x11x11 bucket's alternatives replace the option before them only where
    # the T borders make them issue at least 5 % fewer products: boxes 8 frames deep
    # on clips of 13-15 frames, boxes spanning a whole 16-frame clip on
    # ltx-stage5-small (head dims up to 64: their register cap), never on the long
    # clips the cubic boxes were tuned on; the choice carries the alternative's own
    # backward tiles, and comes from geometry alone.
    from na3d import configs, geometry

    kernel = (11, 11, 11)
    small = configs.forward_config("sm90", (16, 80, 32), kernel, 64, torch.bfloat16)
    assert small.bucket == "large_window/whole_clip"
    assert (small.q_tile, small.kv_tile, small.maxnreg) == ((16, 2, 2), (16, 4, 2), 168)
    bwd = configs.backward_config("sm90", (16, 80, 32), kernel, 64, torch.bfloat16)
    assert (bwd.dq_q_tile, bwd.dq_kv_tile, bwd.dkdv_k_tile) == ((16, 2, 2), (16, 4, 1), (16, 2, 2))
    assert (bwd.dq_maxnreg, bwd.dkdv_maxnreg, bwd.dkdv_stages) == (128, 168, 3)
    # Head dims above 64 have a bucket of their own (the video-DiT regime), with the
    # deep boxes too, and a backward without register caps, dK/dV in one stage.
    wide = configs.forward_config("sm90", (16, 80, 32), kernel, 128, torch.bfloat16)
    assert (wide.bucket, wide.q_tile, wide.kv_tile, wide.maxnreg) == ("dit_large_window/deep_boxes", (8, 4, 2),
                                                                       (1, 16, 4), None)
    bwd = configs.backward_config("sm90", (16, 80, 32), kernel, 128, torch.bfloat16)
    assert (bwd.bucket, bwd.dq_maxnreg, bwd.dkdv_maxnreg, bwd.dkdv_stages) == ("dit_large_window/deep_boxes", None,
                                                                                None, 1)
    assert configs.forward_config("sm90", (30, 48, 80), (18, 24, 24), 128, torch.bfloat16).bucket == "dit_large_window"
    assert configs.forward_config("sm90", (14, 64, 64), kernel, 64, torch.bfloat16).bucket == "large_window/deep_boxes"
    for shape in ((79, 192, 192), (66, 128, 192), (79, 128, 192), (24, 80, 32), (12, 64, 64)):
        cfg = configs.forward_config("sm90", shape, kernel, 64, torch.bfloat16)
        assert cfg.bucket == "large_window", shape
        assert configs.backward_config("sm90", shape, kernel, 64, torch.bfloat16).dq_q_tile == (4, 4, 4)
    bucket = next(e for e in configs.load_table("sm90")["forward"] if e["bucket"] == "large_window")
    for shape in ((13, 40, 40), (15, 80, 32), (16, 80, 32), (16, 128, 128), (22, 96, 64), (30, 48, 48), (79, 192, 192)):
        cfg = configs.forward_config("sm90", shape, kernel, 64, torch.bfloat16)
        want, best = None, None
        for name, opt in configs.bucket_options(bucket):
            ratio = geometry.issued_flops_ratio(shape, kernel, *configs.fitted_tiles(opt["q_tile"], opt["kv_tile"], shape, kernel))
            if best is None or ratio < configs.ALTERNATIVE_MARGIN * best:
                want, best = name, ratio
        assert cfg.bucket == want, (shape, want)
