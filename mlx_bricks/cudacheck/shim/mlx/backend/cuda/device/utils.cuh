// Stand-in for MLX's mlx/backend/cuda/device/utils.cuh, for compile checks only (nvcc on a
// machine without MLX's CUDA build). It declares exactly what mx.fast.cuda_kernel's generated
// signature and the mlx-bricks CUDA twins use from MLX: the Shape / Strides parameter types
// (cuda::std::array of MAX_NDIM = 10, as MLX 0.32 declares them) and the half/bfloat16 types.
// On the GPU machine MLX's own header is used; nothing here ships into a real build.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/cstdint>

#ifndef MAX_NDIM
#define MAX_NDIM 10
#endif

namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}  // namespace mlx::core::cu
