"""The decode attention twin on the GPU (marker ``gpu``; skipped without a CUDA GPU).

What scripts/gpu/decode_cuda_check.py checked, as a test on tests/test_decode_attention.py's
own sweep and check: a fixed hash-chosen eighth of the full sweep (head_dim, dtype, Q8_0,
Lk, GQA, splits, Lq; the default suite already runs its covering cases and a 1-in-60 sample on
``cuda``) against float64 with the dtype-scaled rule. The timing half of the script is
``mlx_bricks.bench.gpu.decode_cases`` (``python -m mlx_bricks.bench --only cuda_decode``).
"""
from __future__ import annotations

import pytest

from tests.gpu_support import gpu
from tests.support import sampled
from tests.test_decode_attention import FULL_GROUPS, SAMPLE_ONE_IN, case_id, check_case, full_cases

CASES = [c for g in FULL_GROUPS for c in full_cases(*g)
         if sampled(case_id(c) + "/gpu", 8) and not sampled(case_id(c), SAMPLE_ONE_IN)]


@gpu
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gpu_decode_sweep_sample(case):
    check_case("cuda", case)
