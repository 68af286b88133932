"""What the patch keeps between calls: a quantized layer's weight view (``formats.layers.
weight_of``) and a mixer's linear stages (``bricks.gemm.piece.stage_names``) are reused while the
layers and arrays they came from are the same objects, rebuilt when a layer or array is
replaced (``Module.update``, a swapped layer), and dropped by ``unpatch_model``.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.tuner.lora import LoRALinear

from mlx_bricks.bricks.gemm.piece import STAGES_MEMO, stage_names
from mlx_bricks.formats.affine import QuantizedWeight
from mlx_bricks.formats.layers import WEIGHT_MEMO, weight_of
from mlx_bricks.patch import patch_model, unpatch_model
from mlx_bricks.patch.core import MEMOS
from tests.models import build_model, tokens


def _quantized(seed=0, bits=4, group_size=64):
    lin = nn.Linear(128, 64, bias=False)
    lin.weight = mx.random.normal((64, 128), key=mx.random.key(seed))
    return nn.QuantizedLinear.from_linear(lin, group_size=group_size, bits=bits)


def test_weight_view_follows_the_layers_arrays():
    q = _quantized()
    w = weight_of(q)
    assert isinstance(w, QuantizedWeight) and weight_of(q) is w
    assert (w.w is q.weight, w.scales is q.scales, w.biases is q.biases) == (True, True, True)
    assert (w.bits, w.group_size) == (4, 64)
    # new arrays (as load_weights / update give): a new view of them, never the old one
    other = _quantized(seed=1)
    q.update({"weight": other.weight, "scales": other.scales, "biases": other.biases})
    w2 = weight_of(q)
    assert w2 is not w
    assert w2.w is q.weight and w2.scales is q.scales and w2.biases is q.biases
    np.testing.assert_array_equal(np.array(w2.dequantize()), np.array(mx.dequantize(
        other.weight, other.scales, other.biases, group_size=64, bits=4)))
    # a different format on the same arrays (bits changed in place) is a new view too
    q8 = _quantized(bits=8)
    v8 = weight_of(q8)
    q8.bits = 4
    assert weight_of(q8) is not v8 and weight_of(q8).bits == 4


def test_float_weight_is_the_array():
    lin = nn.Linear(8, 4)
    assert weight_of(lin) is lin.weight and WEIGHT_MEMO not in lin.__dict__


class _Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(16, 48, bias=False)
        self.out_proj = _quantized()


def test_stage_names_follow_the_layers():
    m = _Mixer()
    m.out_proj = nn.Linear(128, 16, bias=False)
    names = ("in_proj", "out_proj")
    assert stage_names(m, names, mx.float32) == names
    assert stage_names(m, names, mx.float32) == names and STAGES_MEMO in m.__dict__
    # a layer whose weight is not the activations' dtype is not a stage (after an update)
    m.update({"in_proj": {"weight": m.in_proj.weight.astype(mx.float16)}})
    assert stage_names(m, names, mx.float32) == ("out_proj",)
    assert stage_names(m, names, mx.float16) == ("in_proj",)
    # a swapped layer: a LoRA adapter keeps the stock path
    m.in_proj = LoRALinear.from_base(nn.Linear(16, 48, bias=False), r=4)
    assert stage_names(m, names, mx.float32) == ("out_proj",)
    m.in_proj = nn.Linear(16, 48, bias=False)
    assert stage_names(m, names, mx.float32) == names


def test_unpatch_drops_what_the_patch_kept():
    model = build_model("llama")
    nn.quantize(model, group_size=64, bits=4,
                class_predicate=lambda p, mod: isinstance(mod, nn.Linear) and "layers" in p)
    patch_model(model, backend="emulator", tune="off")
    mx.eval(model(tokens(12)))
    kept = [k for mod in model.modules() for k in MEMOS if k in mod.__dict__]
    assert kept, "the forward kept no weight view or stage list"
    unpatch_model(model)
    assert not [k for mod in model.modules() for k in MEMOS if k in mod.__dict__]
