"""Why a DeepSeek-V3-shaped 4-layer prefill fails on the GPU machine at T tokens: stock's and the
patched forward's errors, and each tuner decision's variant errors. Usage:
python3 scripts/gpu/ds_diag.py T [stock] [brick]; prints lines. DS_TUNE: the patch's tune mode
(default auto; "off" runs the bricks unmeasured, so stock's MoE never runs in the process)."""
import os
import sys

import mlx.core as mx

from mlx_bricks.bench import e2e
from mlx_bricks.bench.mla import DEEPSEEK_V3_4LAYER
from mlx_bricks.patch import patch_model

T = int(sys.argv[1])
stock, patched = e2e._models(DEEPSEEK_V3_4LAYER, "bf16")
report = patch_model(patched, tune=os.environ.get("DS_TUNE", "auto"))
tokens = mx.random.randint(0, DEEPSEEK_V3_4LAYER.vocab, (1, T), key=mx.random.key(T))
for name in sys.argv[2:]:
    model = stock if name == "stock" else patched
    try:
        mx.eval(model(tokens)[:, -1, :])
        print(name, "ok", flush=True)
    except Exception as e:  # noqa: BLE001 - a diagnostic: say what failed
        print(name, "FAILED", str(e)[:300], flush=True)
for key, d in report.dispatch.decisions.items():
    errors = {n: v.get("error") for n, v in d.variants.items() if isinstance(v, dict)}
    print(key, d.winner, d.reason[:120], errors, flush=True)
