// Host-side launchers of novatune's CUDA kernels: plain pointers, sizes and a stream, no torch headers.
//
// Why this split: rms_norm.cu and swiglu.cu only need the CUDA toolkit, so nvcc compiles them in seconds and a
// machine without a CUDA build of torch can still compile-check them; bindings.cpp (the one file that includes
// torch) turns tensors into these calls, checks shapes/dtypes/alignment and owns all allocation.
//
// dtype codes: 0 = float32, 1 = float16, 2 = bfloat16. Every launcher returns a cudaError_t (cudaSuccess, or
// cudaErrorInvalidValue for a configuration it cannot run, or the launch error); `why` (if non-null) receives a
// short explanation for the invalid-value cases.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace novatune_cuda {

// Launch configuration of the row-wise kernels, chosen by the caller (the tune engine sweeps it).
struct RowConfig {
  int items;           // 16-byte vectors per thread per row: 1, 2 or 4 (a row of N elements needs N / (VEC*items) threads)
  int unroll;          // rows each thread group has in flight per iteration: 1, 2 or 4
  int block_threads;   // threads per block when a row needs <= 32 threads (several rows per block); ignored otherwise
  int blocks_per_sm;   // backward only: persistent grid = blocks_per_sm * SMs (<= 0: as many as fit, from the
                       // occupancy calculator), never more blocks than row groups
};

// y = round_T(w * round_T(x * rstd)), rstd = 1/sqrt(mean(x^2) + eps) (fp32); x, w, y contiguous, 16-byte aligned,
// n_cols % (16 / sizeof(T)) == 0.
cudaError_t rms_norm_fwd(int dtype, const void* x, const void* w, void* y, float* rstd, int64_t n_rows, int n_cols,
                         float eps, RowConfig cfg, int num_sms, cudaStream_t stream, const char** why);

// dx (T), dw (T) from dy, x, w (T) and the forward's rstd; `partial` is caller-provided fp32 scratch of
// partial_rows x n_cols elements, partial_rows = rms_norm_bwd_partial_rows(...) (the persistent grid: the
// two-stage dweight reduction's first stage writes one row per block).
cudaError_t rms_norm_bwd(int dtype, const void* dy, const void* x, const void* w, const float* rstd, void* dx,
                         void* dw, float* partial, int64_t partial_rows, int64_t n_rows, int n_cols, RowConfig cfg,
                         int num_sms, cudaStream_t stream, const char** why);

// Rows of the fp32 partial buffer rms_norm_bwd needs for this configuration (its persistent grid size); -1 for a
// configuration the kernels cannot run.
int64_t rms_norm_bwd_partial_rows(int dtype, int64_t n_rows, int n_cols, RowConfig cfg, int num_sms);

// y = silu(g) * u and its backward, elementwise over n elements (contiguous, 16-byte aligned); `vecs` 16-byte
// vectors per thread per iteration, `threads` per block.
cudaError_t swiglu_fwd(int dtype, const void* g, const void* u, void* y, int64_t n, int threads, int vecs,
                       int num_sms, cudaStream_t stream, const char** why);
cudaError_t swiglu_bwd(int dtype, const void* dy, const void* g, const void* u, void* dg, void* du, int64_t n,
                       int threads, int vecs, int num_sms, cudaStream_t stream, const char** why);

}  // namespace novatune_cuda
