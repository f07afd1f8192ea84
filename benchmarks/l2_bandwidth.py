"""Read bandwidth from L2 into the SMs (and from HBM, for scale), on a CUDA GPU.

    python benchmarks/l2_bandwidth.py

A box-tiled attention kernel loads, per query box, the keys and values of the union
of its queries' windows; neighbouring boxes load mostly the same keys, so the
loads hit L2 and their rate is bounded by L2's bandwidth into the SMs, not HBM's.
``target_bounds.py`` prints the rate each box size would need; this measures the
ceiling. Every program reads ``ROUNDS`` consecutive 8 KiB chunks of a buffer (its
own start, wrapping around), so a chunk is read again only by other programs,
mostly on other SMs (L2 hits, not L1 hits) once the buffer fits in L2. Median of
CUDA-event timings; bytes read / time.
"""
import statistics
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def read_rounds(x_ptr, out_ptr, n_chunks, ROUNDS: tl.constexpr, CHUNK: tl.constexpr):
    p = tl.program_id(0)
    acc = tl.zeros([CHUNK], tl.float32)
    for r in tl.range(ROUNDS, num_stages=4):
        c = (p * ROUNDS + r) % n_chunks
        offs = c.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
        acc += tl.load(x_ptr + offs).to(tl.float32)
    tl.store(out_ptr + p, tl.sum(acc, axis=0))


def measure(buffer_bytes: int, programs_per_sm: int = 16, rounds: int = 64, chunk: int = 4096, runs: int = 50):
    n_chunks = buffer_bytes // (chunk * 2)
    x = torch.randn(n_chunks * chunk, dtype=torch.bfloat16, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = (sms * programs_per_sm,)
    out = torch.empty(grid[0], dtype=torch.float32, device="cuda")
    read_rounds[grid](x, out, n_chunks, ROUNDS=rounds, CHUNK=chunk, num_warps=4)
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        read_rounds[grid](x, out, n_chunks, ROUNDS=rounds, CHUNK=chunk, num_warps=4)
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in times)
    return grid[0] * rounds * chunk * 2 / (ms * 1e-3) / 1e12, ms


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    print(torch.cuda.get_device_name(0))
    for mib in (4, 8, 16, 24, 32, 48, 4096):
        for per_sm, rounds in ((16, 64), (32, 64), (16, 256)):
            tbs, ms = measure(mib << 20, per_sm, rounds)
            print(f"buffer {mib:5d} MiB, {per_sm} programs/SM, {rounds} rounds: {tbs:6.2f} TB/s ({ms:.3f} ms)",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
