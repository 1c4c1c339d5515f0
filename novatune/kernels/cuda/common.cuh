// Shared device helpers: dtype conversion, 16-byte vectors, fp32 group reductions, dtype dispatch.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace novatune_cuda {

template <typename T> struct Cvt;
template <> struct Cvt<float> {
  static __device__ __forceinline__ float f(float v) { return v; }
  static __device__ __forceinline__ float t(float v) { return v; }
};
template <> struct Cvt<__half> {
  static __device__ __forceinline__ float f(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half t(float v) { return __float2half_rn(v); }
};
template <> struct Cvt<__nv_bfloat16> {
  static __device__ __forceinline__ float f(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 t(float v) { return __float2bfloat16_rn(v); }
};

// fp32 -> T -> fp32: the rounding HF applies to the normalised value before the weight multiply.
template <typename T> __device__ __forceinline__ float round_to(float v) { return Cvt<T>::f(Cvt<T>::t(v)); }

// 16 bytes of T, loaded and stored as one 128-bit access (the pointer must be 16-byte aligned; launchers check).
template <typename T> struct alignas(16) Vec {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};
template <typename T> __device__ __forceinline__ Vec<T> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T>*>(p);
}
template <typename T> __device__ __forceinline__ void store_vec(T* p, const Vec<T>& v) {
  *reinterpret_cast<Vec<T>*>(p) = v;
}
template <typename T> __device__ __forceinline__ Vec<T> zero_vec() {
  Vec<T> z;
#pragma unroll
  for (int j = 0; j < Vec<T>::N; ++j) z.v[j] = Cvt<T>::t(0.f);
  return z;
}

// Sums R values over each group of `tpr` threads that shares a row, in fp32, in a fixed order (deterministic).
// tpr <= 32 (a power of two): the group is tpr adjacent lanes of one warp, reduced with xor shuffles.
// tpr > 32: the group is the whole block (blockDim.x == tpr, a multiple of 32): warp shuffles, then the per-warp
// sums through shared memory `red` (R * 32 floats), which every warp reduces again, so every thread ends with
// the total. All threads of the block must call this (no early exit before it), with the same tpr.
template <int R>
__device__ __forceinline__ void group_sum(float (&v)[R], int tpr, float* red) {
  if (tpr <= 32) {
#pragma unroll
    for (int r = 0; r < R; ++r)
      for (int o = tpr >> 1; o > 0; o >>= 1) v[r] += __shfl_xor_sync(0xffffffffu, v[r], o);
    return;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v[r] += __shfl_xor_sync(0xffffffffu, v[r], o);
    if (lane == 0) red[r * 32 + warp] = v[r];
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float t = lane < nwarps ? red[r * 32 + lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    v[r] = t;
  }
  __syncthreads();  // `red` is reused by the next call
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

inline int next_pow2(int v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

// dtype code (launchers.h) -> a call with the matching C++ type bound to T.
#define NOVATUNE_DISPATCH_DTYPE(code, ...)                        \
  switch (code) {                                                 \
    case 0: { using T = float; __VA_ARGS__; break; }              \
    case 1: { using T = __half; __VA_ARGS__; break; }             \
    case 2: { using T = __nv_bfloat16; __VA_ARGS__; break; }      \
    default: if (why) *why = "unsupported dtype"; return cudaErrorInvalidValue; \
  }

}  // namespace novatune_cuda
