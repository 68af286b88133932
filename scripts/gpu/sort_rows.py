"""MLX CUDA's sort kernels at 65,535 and 65,536 rows of 8 (mx.topk, mx.argpartition,
mx.argsort along the last axis; MLX 0.32.4 launches them with grid.y = rows), and whether the
process still evaluates afterwards. Usage on the GPU machine: python3 scripts/gpu/sort_rows.py;
prints lines."""
import mlx.core as mx

for rows in (65535, 65536):
    for name, fn in (("topk", lambda a: mx.topk(a, 2, axis=-1)),
                     ("argpartition", lambda a: mx.argpartition(a, kth=3, axis=-1)),
                     ("argsort", lambda a: mx.argsort(a, axis=-1))):
        try:
            mx.eval(fn(mx.random.uniform(shape=(rows, 8))))
            print(name, rows, "ok", flush=True)
        except Exception as e:  # noqa: BLE001 - the finding is the error
            print(name, rows, "FAILED", str(e)[:120], flush=True)
try:
    mx.eval(mx.ones(3) + 1)
    print("after: ok")
except Exception as e:  # noqa: BLE001
    print("after FAILED", str(e)[:100])
