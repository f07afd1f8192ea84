"""The decoder benchmark's logic (``na3d.tools.bench_decoder``) on a tiny decoder, on the CPU."""

import pytest
import torch

pytest.importorskip("diffusers")

from na3d.tools.bench_decoder import decoder_row  # noqa: E402
from helpers import TINY_CONFIG  # noqa: E402

# Tiny grids throughout (stage 5: 1 x 16 x 16), so na3d's interpreted kernel is quick.
BENCH_CONFIG = dict(TINY_CONFIG, decoder_stage_kernels=((3, 1, 1), (3, 3, 3), (3, 3, 3), (3, 3, 3)),
                    decoder_stage5_kernel=(1, 3, 3))


@pytest.mark.slow  # (about 10 s of interpreted kernels: CI's slow run)
def test_decoder_row_on_cpu():
    row = decoder_row("cpu", latent_shape=(1, 8, 1, 2, 2), dtype=torch.float32, warmup=0, repeats=1,
                      tiling=False, config=BENCH_CONFIG, log=lambda msg: None)
    assert row["name"] == "ltx-decoder" and row["pass"] == "e2e" and row["shape"] == [1, 8, 1, 2, 2]
    assert row["errors"] == {}, row["errors"]
    assert set(row["ms"]) == {"na3d", "noattn", "sdpa_exact", "flex"}
    assert row["peak_gib"] == {}  # CUDA only
    assert row["output_shape"] == [1, 3, 1, 32, 32]
    assert row["attn_share"] == pytest.approx((row["ms"]["na3d"] - row["ms"]["noattn"]) / row["ms"]["na3d"], abs=1e-3)
    for method in ("na3d", "flex"):
        assert row["max_abs_diff_vs_sdpa_exact"][method] < 1e-4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_decoder_benchmark_without_gpu_says_so(capsys):
    from na3d.tools.bench_decoder import main

    assert main([]) == 0
    assert "No GPU found" in capsys.readouterr().out


def test_decoder_row_rejects_wrong_arguments():
    with pytest.raises(ValueError, match="methods"):
        decoder_row("cpu", methods=["natten"])
    with pytest.raises(ValueError, match="repeats"):
        decoder_row("cpu", repeats=0)
    with pytest.raises(ValueError, match="latent_shape"):
        decoder_row("cpu", latent_shape=(1, 128, 16, 16))
