"""Step-by-step smoke check of the extension on a GPU machine; prints each step before running it so a
crash points at its step. `python -m ds4.engine.gpu.smoke`"""

import numpy as np

from ds4.engine import gpu


def step(msg: str) -> None:
    print(f"smoke: {msg}", flush=True)


def main() -> int:
    step(f"available={gpu.available()} reason={gpu.unavailable_reason()}")
    ext = gpu.load()
    step(f"device {ext.device_info()}")
    a = ext.Array.from_numpy(np.arange(8, dtype=np.float32))
    step(f"array round trip {a.numpy()}")
    rng = np.random.default_rng(0)
    w16 = (rng.standard_normal((64, 256)) * 0.1).astype(np.float16)
    step("upload F16 (memcpy only)")
    t = gpu.upload("smoke.f16", 1, (256, 64), w16.view(np.uint8))
    x = rng.standard_normal((1, 256)).astype(np.float32)
    step("matvec F16 (first kernel launch)")
    y = gpu.matvec_host(t, x)
    step(f"F16 rel err {np.linalg.norm(y[0] - w16.astype(np.float64) @ x[0]) / np.linalg.norm(w16.astype(np.float64) @ x[0]):.2e}")
    raw = np.zeros((64, 8, 34), np.uint8)
    raw[:, :, 2:] = rng.integers(-127, 128, (64, 8, 32)).astype(np.int8).view(np.uint8)
    raw[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    step("upload Q8_0 (repack kernel)")
    q = gpu.upload("smoke.q8", 8, (256, 64), raw)
    step("matvec Q8_0")
    yq = gpu.matvec_host(q, x)
    ref = (raw[:, :, 2:].view(np.int8).astype(np.float64).reshape(64, 256) * 0.01) @ x[0]
    step(f"Q8_0 rel err {np.linalg.norm(yq[0] - ref) / np.linalg.norm(ref):.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
