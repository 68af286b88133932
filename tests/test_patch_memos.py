"""What the patch keeps between calls to save host time: a mixer's linear stages
(``bricks.gemm.piece.stage_names``) and the CUDA tile table's answers (``bricks.gemm.cuda.
tile_names``) are reused while what they depend on is unchanged, recomputed when a layer, an
array, an array's dtype (in place), the device or a tile changes, keep nothing alive, and the
stage lists are dropped by ``unpatch_model``.
"""
from __future__ import annotations

import copy
import gc
import weakref

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tuner.lora import LoRALinear

from mlx_bricks.bricks.gemm import cuda as gemm_cuda
from mlx_bricks.bricks.gemm.piece import STAGES_MEMO, stage_names
from mlx_bricks.patch import patch_model, unpatch_model
from mlx_bricks.patch.core import MEMOS
from tests.models import build_model, tokens

NAMES = ("in_proj", "out_proj")


def _quantized(seed=0, bits=4):
    lin = nn.Linear(128, 64, bias=False)
    lin.weight = mx.random.normal((64, 128), key=mx.random.key(seed))
    return nn.QuantizedLinear.from_linear(lin, group_size=64, bits=bits)


class _Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(16, 48)
        self.out_proj = nn.Linear(48, 16, bias=False)


def test_stage_names_follow_the_layers():
    m = _Mixer()
    assert stage_names(m, NAMES, mx.float32) == NAMES
    assert stage_names(m, NAMES, mx.float32) == NAMES and STAGES_MEMO in m.__dict__
    # a new array of another dtype (update): not a stage at float32, a stage at float16
    m.update({"in_proj": {"weight": m.in_proj.weight.astype(mx.float16),
                          "bias": m.in_proj.bias.astype(mx.float16)}})
    assert stage_names(m, NAMES, mx.float32) == ("out_proj",)
    assert stage_names(m, NAMES, mx.float16) == ("in_proj",)
    # the same array object changed to another dtype in place (bf16 += float32 promotes)
    m.in_proj = nn.Linear(16, 48)
    m.in_proj.set_dtype(mx.bfloat16)
    m.out_proj.set_dtype(mx.bfloat16)
    assert stage_names(m, NAMES, mx.bfloat16) == NAMES
    b = m.in_proj.bias
    b += mx.ones((48,), mx.float32)
    assert m.in_proj.bias is b and b.dtype == mx.float32
    assert stage_names(m, NAMES, mx.bfloat16) == ("out_proj",)
    m.out_proj.set_dtype(mx.float32)
    # a swapped layer: a LoRA adapter keeps the stock path; a quantized one with bad arrays too
    m.in_proj = LoRALinear.from_base(nn.Linear(16, 48, bias=False), r=4)
    assert stage_names(m, NAMES, mx.float32) == ("out_proj",)
    q = _quantized()
    m.out_proj = q
    assert stage_names(m, NAMES, mx.float32) == ("out_proj",)
    q.scales = q.scales.astype(mx.float16)  # scales must be the activations' dtype
    assert stage_names(m, NAMES, mx.float32) == ()
    q.bits = 8  # a format change on the same arrays: re-checked (8-bit rows do not match K)
    m.out_proj.scales = m.out_proj.scales.astype(mx.float32)
    assert stage_names(m, NAMES, mx.float32) == ()
    q.bits = 4
    assert stage_names(m, NAMES, mx.float32) == ("out_proj",)


def test_stage_names_keep_nothing_alive_and_copy():
    m = _Mixer()
    stage_names(m, NAMES, mx.float32)
    old = weakref.ref(m.in_proj.weight)
    m.update({"in_proj": {"weight": mx.zeros((48, 16))}})
    gc.collect()
    assert old() is None, "the kept stage list holds a replaced weight alive"
    c = copy.deepcopy(m)  # a module carrying the list can be copied, the copy decides afresh
    assert stage_names(c, NAMES, mx.float16) == ()
    assert stage_names(c, NAMES, mx.float32) == NAMES


def test_tile_names_follow_the_table(monkeypatch):
    table = dict(gemm_cuda.TILES)
    first = gemm_cuda.tile_names(table, cc=(9, 0))
    assert first == gemm_cuda.tile_names(table, cc=(9, 0)) and "wg128x256" in first
    assert "wg128x256" not in gemm_cuda.tile_names(table, cc=(8, 0))
    table["wg128x256"] = gemm_cuda.CudaTile(64, 64, 2, 2, 4)  # replaced in place: mma.sync
    assert gemm_cuda.tile_names(table, cc=(8, 0)).count("wg128x256") == 1
    monkeypatch.setitem(gemm_cuda.SHARED_MEMORY_BY_CAPABILITY, (9, 0), 1024)
    assert gemm_cuda.tile_names(table, cc=(9, 0)) == ()


def test_unpatch_drops_what_the_patch_kept():
    model = build_model("qwen3_next")
    patch_model(model, backend="emulator", tune="off")
    mx.eval(model(tokens(12)))
    kept = [k for mod in model.modules() for k in MEMOS if k in mod.__dict__]
    assert kept, "the forward kept no stage list"
    unpatch_model(model)
    assert not [k for mod in model.modules() for k in MEMOS if k in mod.__dict__]
