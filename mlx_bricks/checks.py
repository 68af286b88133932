"""Argument checks shared by the ops: errors name the argument and say what was expected."""
from __future__ import annotations

import mlx.core as mx

FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def dtype_name(dtype) -> str:
    """``mx.float16`` -> ``"float16"`` (for error messages)."""
    return str(dtype).replace("mlx.core.", "")


def check_array(name: str, value, *, ndim: int | None = None, min_ndim: int | None = None):
    """Raise TypeError unless ``value`` is an ``mx.array`` (with the given rank)."""
    if not isinstance(value, mx.array):
        raise TypeError(f"{name} must be an mx.array, got {type(value).__name__}")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    if min_ndim is not None and value.ndim < min_ndim:
        raise ValueError(
            f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(value.shape)}"
        )
    return value


def check_float_dtype(name: str, value: mx.array) -> None:
    """Raise TypeError unless ``value`` is float16, bfloat16 or float32."""
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float16, bfloat16 or float32, got {dtype_name(value.dtype)}"
        )


def check_same_dtype(reference_name: str, reference: mx.array, **others) -> None:
    """Raise TypeError if any array in ``others`` (name=array, None skipped) has another dtype."""
    for name, value in others.items():
        if value is not None and value.dtype != reference.dtype:
            raise TypeError(
                f"{name} has dtype {dtype_name(value.dtype)} but {reference_name} has "
                f"{dtype_name(reference.dtype)}; mixed dtypes are not supported"
            )


def check_k(x: mx.array) -> int:
    """K = ``x.shape[-1]``; ValueError if it is 0 (a GEMM needs K >= 1)."""
    K = x.shape[-1]
    if K < 1:
        raise ValueError(f"x must have a non-empty last dimension (K), got shape {tuple(x.shape)}")
    return K


def check_linear_weight(name: str, weight: mx.array, K: int, rows: str = "N") -> None:
    """ValueError unless ``weight`` (2-D) is ``(rows, K)``, the ``nn.Linear`` layout."""
    if weight.shape[1] != K:
        raise ValueError(
            f"{name} must have shape ({rows}, K={K}) as nn.Linear stores it, "
            f"got {tuple(weight.shape)}"
        )


def check_optional(name: str, value, shape: tuple, dtype=None) -> None:
    """Nothing for None; else raise unless ``value`` is an ``mx.array`` of ``shape`` (ValueError)
    and of ``dtype``, or of a float dtype when ``dtype`` is None (TypeError)."""
    if value is None:
        return
    check_array(name, value)
    if dtype is None:
        check_float_dtype(name, value)
    elif value.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype_name(dtype)}, got "
                        f"{dtype_name(value.dtype)}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(value.shape)}")
