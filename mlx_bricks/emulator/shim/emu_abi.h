// mlx_bricks MSL emulator: the interface between compiled kernels (metal_shim.h) and the
// fiber runtime (emu_runtime.cpp). Plain C layout; both sides include this file.
#pragma once
// Guard too: a PCH built from another checkout's copy has another path.
#ifndef MLX_BRICKS_EMU_ABI_H
#define MLX_BRICKS_EMU_ABI_H
#include <stdint.h>

#define EMU_SIMD_WIDTH 32
#define EMU_SLOT_BYTES 32

extern "C" {

// Per SIMD-group scratch used by collectives (simd_* functions, simdgroup_matrix ops).
// in[lane]:   what each lane contributes; written by the lane before it arrives.
// out[lane]:  what each lane gets back; written by the completing lane before release.
// ptr[lane]:  pointers a lane publishes (simdgroup_matrix operands).
// active:     lanes taking part in the collective being completed (set before completion).
struct EmuSimd {
  alignas(64) unsigned char in[EMU_SIMD_WIDTH][EMU_SLOT_BYTES];
  alignas(64) unsigned char out[EMU_SIMD_WIDTH][EMU_SLOT_BYTES];
  void* ptr[EMU_SIMD_WIDTH][4];
  uint32_t active;
  uint32_t nlanes;
};

// What one emulated GPU thread knows about itself: the values of every Metal attribute.
struct EmuLane {
  uint32_t thread_position_in_grid[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threads_per_threadgroup[3];
  uint32_t dispatch_threads_per_threadgroup[3];
  uint32_t threadgroups_per_grid[3];
  uint32_t threads_per_grid[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
  EmuSimd* simd;
};

// Runtime entry points used by the shim.
EmuLane* emu_cur(void);
// Arrive at a SIMD-group collective. Returns 1 to exactly one participating lane (the
// completer) once every participating lane has arrived; that lane computes the results into
// simd->out / the published pointers and then calls emu_simd_release. Returns 0 to the other
// lanes after the release.
int emu_simd_arrive(EmuLane* lane, uint32_t site);
void emu_simd_release(EmuLane* lane);
void emu_tg_barrier(EmuLane* lane, uint32_t site);
// Threadgroup memory: the same pointer for every thread of a threadgroup.
void* emu_tg_alloc(uint32_t slot, uint64_t bytes, uint64_t align, uint32_t elem_bytes);
// Report a fault from kernel code (unsupported feature at run time, ...). Does not return.
void emu_fault(const char* msg) __attribute__((noreturn));

// Host side (Python through ctypes).
struct EmuBuf {
  void* host;          // the caller's bytes (copied in before and, for outputs, out after)
  uint64_t nbytes;
  uint32_t elem_bytes;
  uint32_t is_output;
  const char* name;
};
struct EmuLaunchDesc {
  void (*entry)(void** bufs);   // emu_kernel_entry of the compiled kernel
  uint32_t nbufs;
  const struct EmuBuf* bufs;
  uint32_t grid[3];              // threads in the grid (dispatchThreads)
  uint32_t threadgroup[3];       // threads per threadgroup (already clipped to the grid)
  uint32_t schedule;             // 0: forward fiber order; 1: reverse order (race detection)
  uint32_t nthreads;             // OS threads running threadgroups in parallel
  uint32_t checks;               // 1: guarded copies of the buffers (bounds checks)
  uint32_t tg_poison;            // byte written over threadgroup memory before each threadgroup
  uint32_t perturb;              // perturbed mode's seed (0: off): FTZ/DAZ, fast:: errors, orders
  const char* kernel_name;
  uint32_t ntg_names;
  const char* const* tg_names;   // threadgroup declaration per slot, for messages
};
// Returns 0, or 1 with a fault description in err.
int emu_launch(const struct EmuLaunchDesc* desc, char* err, uint32_t errlen);

}  // extern "C"

#endif  // MLX_BRICKS_EMU_ABI_H
