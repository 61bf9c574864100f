"""The two ceilings of METHOD.md on the GPU at hand: a large bf16 matrix product (TFLOP/s) and a large
device-to-device copy (GB/s, bytes read plus written). Prints one line each.
    python scripts/ceilings.py"""
import torch
import triton


def main():
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = triton.testing.do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    print(f"{torch.cuda.get_device_name()}: bf16 matmul 8192^3: {2 * 8192 ** 3 / ms / 1e9:.0f} TFLOP/s ({ms:.3f} ms)")
    x = torch.empty(2 ** 30, device="cuda", dtype=torch.float32)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=100, rep=500, return_mode="median")
    print(f"device copy 4 GiB: {2 * x.numel() * 4 / ms / 1e6:.0f} GB/s ({ms:.3f} ms)")


if __name__ == "__main__":
    main()
