// SwiGLU y = silu(g) * u and its backward, elementwise, fp32 math, one rounding per output:
//
//   sig = 1 / (1 + exp(-g)),  y = g * sig * u,  du = dy * g * sig,  dg = dy * u * (sig + g * sig * (1 - sig))
//
// Pure streaming (forward 3 elements moved per element, backward 5), so the design only serves HBM bandwidth:
// the tensors are one flat array of 16-byte vectors; each thread keeps VECS vectors of every input in flight per
// iteration (all loads before any math), blocks stride over the array. expf (not __expf): the exact exponential
// costs nothing in a memory-bound kernel and keeps fp32 results at the reference's accuracy. A tail of
// n % VEC elements is done with scalar accesses by the first threads.
#include "common.cuh"
#include "launchers.h"

namespace novatune_cuda {
namespace {

__device__ __forceinline__ float sigmoidf_(float g) { return 1.f / (1.f + expf(-g)); }

template <typename T, int VECS>
__global__ void swiglu_fwd_kernel(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ y,
                                  int64_t n_vec, int64_t n) {
  constexpr int VEC = Vec<T>::N;
  const int64_t chunk = static_cast<int64_t>(blockDim.x) * VECS;
  for (int64_t start = static_cast<int64_t>(blockIdx.x) * chunk; start < n_vec; start += chunk * gridDim.x) {
    Vec<T> gv[VECS], uv[VECS];
#pragma unroll
    for (int k = 0; k < VECS; ++k) {
      const int64_t v = start + k * blockDim.x + threadIdx.x;
      if (v < n_vec) {
        gv[k] = load_vec(g + v * VEC);
        uv[k] = load_vec(u + v * VEC);
      }
    }
#pragma unroll
    for (int k = 0; k < VECS; ++k) {
      const int64_t v = start + k * blockDim.x + threadIdx.x;
      if (v >= n_vec) continue;
      Vec<T> yv;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float gf = Cvt<T>::f(gv[k].v[j]);
        yv.v[j] = Cvt<T>::t(gf * sigmoidf_(gf) * Cvt<T>::f(uv[k].v[j]));
      }
      store_vec(y + v * VEC, yv);
    }
  }
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t e = n_vec * VEC + t;
  if (e < n) {
    const float gf = Cvt<T>::f(g[e]);
    y[e] = Cvt<T>::t(gf * sigmoidf_(gf) * Cvt<T>::f(u[e]));
  }
}

template <typename T, int VECS>
// No __restrict__ on g/u/dg/du: novatune's MLP backward may write dgate/dup over gate/up (in-place backward).
// That is safe here because every thread loads all of its elements before it stores any of them.
__global__ void swiglu_bwd_kernel(const T* __restrict__ dy, const T* g, const T* u, T* dg, T* du, int64_t n_vec,
                                  int64_t n) {
  constexpr int VEC = Vec<T>::N;
  const int64_t chunk = static_cast<int64_t>(blockDim.x) * VECS;
  for (int64_t start = static_cast<int64_t>(blockIdx.x) * chunk; start < n_vec; start += chunk * gridDim.x) {
    Vec<T> dv[VECS], gv[VECS], uv[VECS];
#pragma unroll
    for (int k = 0; k < VECS; ++k) {
      const int64_t v = start + k * blockDim.x + threadIdx.x;
      if (v < n_vec) {
        dv[k] = load_vec(dy + v * VEC);
        gv[k] = load_vec(g + v * VEC);
        uv[k] = load_vec(u + v * VEC);
      }
    }
#pragma unroll
    for (int k = 0; k < VECS; ++k) {
      const int64_t v = start + k * blockDim.x + threadIdx.x;
      if (v >= n_vec) continue;
      Vec<T> dgv, duv;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = Cvt<T>::f(dv[k].v[j]), gf = Cvt<T>::f(gv[k].v[j]), uf = Cvt<T>::f(uv[k].v[j]);
        const float sig = sigmoidf_(gf), silu = gf * sig;
        duv.v[j] = Cvt<T>::t(d * silu);
        dgv.v[j] = Cvt<T>::t(d * uf * (sig + silu * (1.f - sig)));
      }
      store_vec(du + v * VEC, duv);
      store_vec(dg + v * VEC, dgv);
    }
  }
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t e = n_vec * VEC + t;
  if (e < n) {
    const float d = Cvt<T>::f(dy[e]), gf = Cvt<T>::f(g[e]), uf = Cvt<T>::f(u[e]);
    const float sig = sigmoidf_(gf), silu = gf * sig;
    du[e] = Cvt<T>::t(d * silu);
    dg[e] = Cvt<T>::t(d * uf * (sig + silu * (1.f - sig)));
  }
}

bool check_cfg(int threads, int vecs, const char** why) {
  if (threads < 32 || threads > 1024 || threads % 32 != 0) { if (why) *why = "threads must be a multiple of 32 in [32, 1024]"; return false; }
  if (vecs != 1 && vecs != 2 && vecs != 4) { if (why) *why = "vecs must be 1, 2 or 4"; return false; }
  return true;
}

// Enough blocks to cover the array once, at most 64 per SM (the grid-stride loop takes the rest), and at least
// one so that the scalar tail of a tiny tensor is written.
unsigned grid_for(int64_t n_vec, int threads, int vecs, int num_sms) {
  const int64_t chunk = static_cast<int64_t>(threads) * vecs;
  int64_t want = (n_vec + chunk - 1) / chunk;
  const int64_t cap = static_cast<int64_t>(num_sms > 0 ? num_sms : 1) * 64;
  if (want > cap) want = cap;
  return static_cast<unsigned>(want > 0 ? want : 1);
}

#define NOVATUNE_DISPATCH_VECS(vecs, FN) \
  switch (vecs) { case 1: FN(1); break; case 2: FN(2); break; case 4: FN(4); break; default: return cudaErrorInvalidValue; }

template <typename T>
cudaError_t fwd_typed(const void* g, const void* u, void* y, int64_t n, int threads, int vecs, int num_sms,
                      cudaStream_t stream) {
  const int64_t n_vec = n / Vec<T>::N;
  const unsigned grid = grid_for(n_vec, threads, vecs, num_sms);
#define NT_FWD(V) swiglu_fwd_kernel<T, V><<<grid, threads, 0, stream>>>(static_cast<const T*>(g), \
      static_cast<const T*>(u), static_cast<T*>(y), n_vec, n)
  NOVATUNE_DISPATCH_VECS(vecs, NT_FWD)
#undef NT_FWD
  return cudaGetLastError();
}

template <typename T>
cudaError_t bwd_typed(const void* dy, const void* g, const void* u, void* dg, void* du, int64_t n, int threads,
                      int vecs, int num_sms, cudaStream_t stream) {
  const int64_t n_vec = n / Vec<T>::N;
  const unsigned grid = grid_for(n_vec, threads, vecs, num_sms);
#define NT_BWD(V) swiglu_bwd_kernel<T, V><<<grid, threads, 0, stream>>>(static_cast<const T*>(dy), \
      static_cast<const T*>(g), static_cast<const T*>(u), static_cast<T*>(dg), static_cast<T*>(du), n_vec, n)
  NOVATUNE_DISPATCH_VECS(vecs, NT_BWD)
#undef NT_BWD
  return cudaGetLastError();
}

}  // namespace

cudaError_t swiglu_fwd(int dtype, const void* g, const void* u, void* y, int64_t n, int threads, int vecs,
                       int num_sms, cudaStream_t stream, const char** why) {
  if (!check_cfg(threads, vecs, why)) return cudaErrorInvalidValue;
  if (!aligned16(g) || !aligned16(u) || !aligned16(y)) { if (why) *why = "g, u and y must be 16-byte aligned"; return cudaErrorInvalidValue; }
  if (n == 0) return cudaSuccess;
  NOVATUNE_DISPATCH_DTYPE(dtype, return fwd_typed<T>(g, u, y, n, threads, vecs, num_sms, stream))
  return cudaErrorInvalidValue;
}

cudaError_t swiglu_bwd(int dtype, const void* dy, const void* g, const void* u, void* dg, void* du, int64_t n,
                       int threads, int vecs, int num_sms, cudaStream_t stream, const char** why) {
  if (!check_cfg(threads, vecs, why)) return cudaErrorInvalidValue;
  if (!aligned16(dy) || !aligned16(g) || !aligned16(u) || !aligned16(dg) || !aligned16(du)) {
    if (why) *why = "dy, g, u, dg and du must be 16-byte aligned";
    return cudaErrorInvalidValue;
  }
  if (n == 0) return cudaSuccess;
  NOVATUNE_DISPATCH_DTYPE(dtype, return bwd_typed<T>(dy, g, u, dg, du, n, threads, vecs, num_sms, stream))
  return cudaErrorInvalidValue;
}

}  // namespace novatune_cuda
