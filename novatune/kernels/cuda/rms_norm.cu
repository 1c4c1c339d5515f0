// RMSNorm forward and backward, HF rounding conventions (same math as novatune/kernels/rms_norm.py):
//
//   rstd_r = 1 / sqrt(mean_j x_rj^2 + eps)             fp32
//   y_rj   = round_T(w_j * round_T(x_rj * rstd_r))
//   dx_rj  = rstd_r * (g_rj - xhat_rj * c_r),  g = dy * w,  xhat = x * rstd,  c_r = mean_j g_rj * xhat_rj
//   dw_j   = sum_r dy_rj * round_T(xhat_rj)
//
// Layout of the work: a row is handled by a group of `tpr` threads, each owning `ITEMS` 16-byte vectors of the
// row (VEC = 16 / sizeof(T) elements each) at the same columns in every row it visits. So each thread keeps its
// slice of w in registers for the whole kernel and, in the backward, accumulates its columns' dw in fp32 registers
// across all its rows: no atomics, and the only cross-thread traffic per row is one fp32 group reduction (warp
// shuffles; plus shared memory when a row spans several warps). Each group keeps UNROLL rows in flight (all their
// loads issued before the reduction) so enough bytes are outstanding per SM to cover HBM latency.
//
// dweight, two stages: the backward's persistent blocks (blocks_per_sm * SMs of them) each write one fp32 row of a
// (G, N) partial buffer (sub-groups of a block are first summed in shared memory), then a second kernel sums the G
// rows per column in a fixed order and rounds once. Deterministic: the summation order depends only on the config.
#include "common.cuh"
#include "launchers.h"

namespace novatune_cuda {
namespace {

template <typename T, int ITEMS, int UNROLL>
__global__ void rms_fwd_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                               float* __restrict__ rstd_out, int64_t n_rows, int n_cols, float eps, int tpr) {
  constexpr int VEC = Vec<T>::N;
  __shared__ float red[UNROLL * 32];
  const int rpb = blockDim.x / tpr;  // row groups per block (1 when a row spans the block)
  const int sub = threadIdx.x / tpr, lane = threadIdx.x % tpr;
  float wf[ITEMS][VEC];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int c = (lane + i * tpr) * VEC;
    const Vec<T> wv = c < n_cols ? load_vec(w + c) : zero_vec<T>();
#pragma unroll
    for (int j = 0; j < VEC; ++j) wf[i][j] = Cvt<T>::f(wv.v[j]);
  }
  const float inv_n = 1.f / static_cast<float>(n_cols);
  const int64_t step = static_cast<int64_t>(gridDim.x) * rpb * UNROLL;
  // `base` is uniform across the block, so every thread runs the same iterations (the reductions need that);
  // rows past the end are loaded as zeros and not stored.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * rpb * UNROLL; base < n_rows; base += step) {
    Vec<T> xv[UNROLL][ITEMS];
    float ss[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t row = base + u * rpb + sub;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int c = (lane + i * tpr) * VEC;
        xv[u][i] = (row < n_rows && c < n_cols) ? load_vec(x + row * n_cols + c) : zero_vec<T>();
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      ss[u] = 0.f;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float v = Cvt<T>::f(xv[u][i].v[j]);
          ss[u] += v * v;
        }
    }
    group_sum<UNROLL>(ss, tpr, red);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t row = base + u * rpb + sub;
      if (row >= n_rows) continue;
      const float r = 1.f / sqrtf(ss[u] * inv_n + eps);  // IEEE div and sqrt (no fast-math), as torch's fp32
      if (lane == 0) rstd_out[row] = r;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int c = (lane + i * tpr) * VEC;
        if (c >= n_cols) continue;
        Vec<T> yv;
#pragma unroll
        for (int j = 0; j < VEC; ++j) yv.v[j] = Cvt<T>::t(wf[i][j] * round_to<T>(Cvt<T>::f(xv[u][i].v[j]) * r));
        store_vec(y + row * n_cols + c, yv);
      }
    }
  }
}

template <typename T, int ITEMS, int UNROLL>
__global__ void rms_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                               const float* __restrict__ rstd, T* __restrict__ dx, float* __restrict__ partial,
                               int64_t n_rows, int n_cols, int tpr) {
  constexpr int VEC = Vec<T>::N;
  extern __shared__ float sub_partials[];  // (rpb, n_cols) when several row groups share a block
  __shared__ float red[UNROLL * 32];
  const int rpb = blockDim.x / tpr;
  const int sub = threadIdx.x / tpr, lane = threadIdx.x % tpr;
  float wf[ITEMS][VEC], acc[ITEMS][VEC];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int c = (lane + i * tpr) * VEC;
    const Vec<T> wv = c < n_cols ? load_vec(w + c) : zero_vec<T>();
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      wf[i][j] = Cvt<T>::f(wv.v[j]);
      acc[i][j] = 0.f;
    }
  }
  const float inv_n = 1.f / static_cast<float>(n_cols);
  const int64_t step = static_cast<int64_t>(gridDim.x) * rpb * UNROLL;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * rpb * UNROLL; base < n_rows; base += step) {
    Vec<T> xv[UNROLL][ITEMS], gv[UNROLL][ITEMS];
    float rs[UNROLL], dot[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t row = base + u * rpb + sub;
      rs[u] = row < n_rows ? rstd[row] : 0.f;  // padded rows: dx = 0, and they add 0 to dw
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int c = (lane + i * tpr) * VEC;
        const bool ok = row < n_rows && c < n_cols;
        xv[u][i] = ok ? load_vec(x + row * n_cols + c) : zero_vec<T>();
        gv[u][i] = ok ? load_vec(dy + row * n_cols + c) : zero_vec<T>();
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      dot[u] = 0.f;  // sum_j dy * w * x; c_r = rstd * dot / N
#pragma unroll
      for (int i = 0; i < ITEMS; ++i)
#pragma unroll
        for (int j = 0; j < VEC; ++j) dot[u] += Cvt<T>::f(gv[u][i].v[j]) * wf[i][j] * Cvt<T>::f(xv[u][i].v[j]);
    }
    group_sum<UNROLL>(dot, tpr, red);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t row = base + u * rpb + sub;
      const float r = rs[u];
      const float c_r = dot[u] * r * inv_n;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int c = (lane + i * tpr) * VEC;
        Vec<T> dxv;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float dyf = Cvt<T>::f(gv[u][i].v[j]);
          const float xhat = Cvt<T>::f(xv[u][i].v[j]) * r;
          dxv.v[j] = Cvt<T>::t((dyf * wf[i][j] - xhat * c_r) * r);
          acc[i][j] += dyf * round_to<T>(xhat);  // dw uses the rounded normalised value, as the forward did
        }
        if (row < n_rows && c < n_cols) store_vec(dx + row * n_cols + c, dxv);
      }
    }
  }
  // first stage of the dweight reduction: one fp32 row of `partial` per block
  float* out = partial + static_cast<int64_t>(blockIdx.x) * n_cols;
  if (rpb == 1) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c = (lane + i * tpr) * VEC;
      if (c >= n_cols) continue;
#pragma unroll
      for (int j = 0; j < VEC; j += 4)
        *reinterpret_cast<float4*>(out + c + j) = make_float4(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int c = (lane + i * tpr) * VEC;
    if (c >= n_cols) continue;
#pragma unroll
    for (int j = 0; j < VEC; ++j) sub_partials[sub * n_cols + c + j] = acc[i][j];
  }
  __syncthreads();
  for (int col = threadIdx.x; col < n_cols; col += blockDim.x) {
    float s = 0.f;
    for (int k = 0; k < rpb; ++k) s += sub_partials[k * n_cols + col];
    out[col] = s;
  }
}

// Second stage: dw[col] = sum over the G partial rows, a 32-column strip per block, 32 lanes over the rows.
template <typename T>
__global__ void rms_sum_partials_kernel(const float* __restrict__ partial, T* __restrict__ dw, int64_t G,
                                        int n_cols) {
  __shared__ float s[32][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  float a = 0.f;
  if (col < n_cols)
    for (int64_t g = threadIdx.y; g < G; g += 32) a += partial[g * n_cols + col];
  s[threadIdx.y][threadIdx.x] = a;
  __syncthreads();
  if (threadIdx.y == 0 && col < n_cols) {
    float t = 0.f;
#pragma unroll
    for (int k = 0; k < 32; ++k) t += s[k][threadIdx.x];
    dw[col] = Cvt<T>::t(t);
  }
}

// Threads per row group and block shape for (N, config); false (with `why`) for a layout the kernels cannot run.
struct Plan {
  int tpr, threads, rpb;
};

template <typename T>
bool plan_rows(int n_cols, const RowConfig& cfg, Plan* p, const char** why) {
  constexpr int VEC = Vec<T>::N;
  if (cfg.items != 1 && cfg.items != 2 && cfg.items != 4) { if (why) *why = "items must be 1, 2 or 4"; return false; }
  if (cfg.unroll != 1 && cfg.unroll != 2 && cfg.unroll != 4) { if (why) *why = "unroll must be 1, 2 or 4"; return false; }
  if (n_cols <= 0 || n_cols % VEC != 0) { if (why) *why = "N must be a multiple of 16 bytes of elements"; return false; }
  const int need = (n_cols / VEC + cfg.items - 1) / cfg.items;  // threads a row needs
  if (need <= 32) {
    p->tpr = next_pow2(need);
    if (cfg.block_threads < 32 || cfg.block_threads > 1024 || cfg.block_threads % 32 != 0) {
      if (why) *why = "block_threads must be a multiple of 32 in [32, 1024]";
      return false;
    }
    p->threads = cfg.block_threads;
  } else {
    p->tpr = (need + 31) / 32 * 32;
    if (p->tpr > 1024) { if (why) *why = "a row needs more than 1024 threads: raise items"; return false; }
    p->threads = p->tpr;
  }
  p->rpb = p->threads / p->tpr;
  return true;
}

template <typename K>
bool fits(K kernel, int threads, const char** why) {
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) { if (why) *why = "cudaFuncGetAttributes failed"; return false; }
  if (threads > attr.maxThreadsPerBlock) {
    if (why) *why = "too many registers per thread for this block size (kernel's maxThreadsPerBlock is smaller)";
    return false;
  }
  return true;
}

// Persistent grid of the backward: blocks_per_sm * SMs, or (blocks_per_sm <= 0) as many blocks as the occupancy
// calculator says fit at once; never more than there are row groups.
template <typename K>
int64_t bwd_grid(K kernel, int64_t n_rows, const Plan& p, const RowConfig& cfg, int num_sms, size_t smem) {
  const int64_t groups = (n_rows + static_cast<int64_t>(p.rpb) * cfg.unroll - 1) / (static_cast<int64_t>(p.rpb) * cfg.unroll);
  int per_sm = cfg.blocks_per_sm;
  if (per_sm <= 0 && cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, p.threads, smem) != cudaSuccess)
    per_sm = 1;
  const int64_t cap = static_cast<int64_t>(per_sm > 0 ? per_sm : 1) * num_sms;
  return groups < cap ? (groups > 0 ? groups : 1) : cap;
}

#define NOVATUNE_DISPATCH_ITEMS_UNROLL(items, unroll, FN)                                     \
  switch (items * 10 + unroll) {                                                              \
    case 11: FN(1, 1); break; case 12: FN(1, 2); break; case 14: FN(1, 4); break;             \
    case 21: FN(2, 1); break; case 22: FN(2, 2); break; case 24: FN(2, 4); break;             \
    case 41: FN(4, 1); break; case 42: FN(4, 2); break; case 44: FN(4, 4); break;             \
    default: if (why) *why = "items/unroll out of range"; return cudaErrorInvalidValue;       \
  }

template <typename T>
cudaError_t fwd_typed(const void* x, const void* w, void* y, float* rstd, int64_t n_rows, int n_cols, float eps,
                      const RowConfig& cfg, cudaStream_t stream, const char** why) {
  Plan p;
  if (!plan_rows<T>(n_cols, cfg, &p, why)) return cudaErrorInvalidValue;
  const int64_t per_block = static_cast<int64_t>(p.rpb) * cfg.unroll;
  const int64_t want = (n_rows + per_block - 1) / per_block;
  const unsigned grid = static_cast<unsigned>(want < 2147483647LL ? want : 2147483647LL);
#define NT_FWD(I, U)                                                                                  \
  {                                                                                                   \
    auto k = rms_fwd_kernel<T, I, U>;                                                                 \
    if (!fits(k, p.threads, why)) return cudaErrorInvalidValue;                                       \
    k<<<grid, p.threads, 0, stream>>>(static_cast<const T*>(x), static_cast<const T*>(w),             \
                                      static_cast<T*>(y), rstd, n_rows, n_cols, eps, p.tpr);          \
  }
  NOVATUNE_DISPATCH_ITEMS_UNROLL(cfg.items, cfg.unroll, NT_FWD)
#undef NT_FWD
  return cudaGetLastError();
}

template <typename T>
cudaError_t bwd_typed(const void* dy, const void* x, const void* w, const float* rstd, void* dx, void* dw,
                      float* partial, int64_t partial_rows, int64_t n_rows, int n_cols, const RowConfig& cfg, int num_sms,
                      cudaStream_t stream, const char** why) {
  Plan p;
  if (!plan_rows<T>(n_cols, cfg, &p, why)) return cudaErrorInvalidValue;
  int64_t G = 0;
  const size_t smem = p.rpb > 1 ? static_cast<size_t>(p.rpb) * n_cols * sizeof(float) : 0;
#define NT_BWD(I, U)                                                                                  \
  {                                                                                                   \
    auto k = rms_bwd_kernel<T, I, U>;                                                                 \
    if (!fits(k, p.threads, why)) return cudaErrorInvalidValue;                                       \
    if (smem > 48 * 1024 &&                                                                           \
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess) { \
      if (why) *why = "row groups' dw partials exceed the shared memory: lower block_threads";        \
      return cudaErrorInvalidValue;                                                                   \
    }                                                                                                 \
    G = bwd_grid(k, n_rows, p, cfg, num_sms, smem);                                                   \
    if (G > partial_rows) { if (why) *why = "partial buffer smaller than the grid"; return cudaErrorInvalidValue; } \
    k<<<static_cast<unsigned>(G), p.threads, smem, stream>>>(                                         \
        static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(w), rstd,          \
        static_cast<T*>(dx), partial, n_rows, n_cols, p.tpr);                                         \
  }
  NOVATUNE_DISPATCH_ITEMS_UNROLL(cfg.items, cfg.unroll, NT_BWD)
#undef NT_BWD
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  rms_sum_partials_kernel<T><<<(n_cols + 31) / 32, dim3(32, 32), 0, stream>>>(partial, static_cast<T*>(dw), G,
                                                                                 n_cols);
  return cudaGetLastError();
}

}  // namespace

cudaError_t rms_norm_fwd(int dtype, const void* x, const void* w, void* y, float* rstd, int64_t n_rows, int n_cols,
                         float eps, RowConfig cfg, int /*num_sms*/, cudaStream_t stream, const char** why) {
  if (!aligned16(x) || !aligned16(w) || !aligned16(y)) { if (why) *why = "x, w and y must be 16-byte aligned"; return cudaErrorInvalidValue; }
  if (n_rows == 0) return cudaSuccess;
  NOVATUNE_DISPATCH_DTYPE(dtype, return fwd_typed<T>(x, w, y, rstd, n_rows, n_cols, eps, cfg, stream, why))
  return cudaErrorInvalidValue;
}

template <typename T>
int64_t partial_rows_typed(int64_t n_rows, int n_cols, const RowConfig& cfg, int num_sms) {
  Plan p;
  const char* why = nullptr;
  if (!plan_rows<T>(n_cols, cfg, &p, &why)) return -1;
  const size_t smem = p.rpb > 1 ? static_cast<size_t>(p.rpb) * n_cols * sizeof(float) : 0;
  int64_t G = -1;
#define NT_G(I, U) G = bwd_grid(rms_bwd_kernel<T, I, U>, n_rows, p, cfg, num_sms, smem)
  switch (cfg.items * 10 + cfg.unroll) {
    case 11: NT_G(1, 1); break; case 12: NT_G(1, 2); break; case 14: NT_G(1, 4); break;
    case 21: NT_G(2, 1); break; case 22: NT_G(2, 2); break; case 24: NT_G(2, 4); break;
    case 41: NT_G(4, 1); break; case 42: NT_G(4, 2); break; case 44: NT_G(4, 4); break;
    default: break;
  }
#undef NT_G
  return G;
}

int64_t rms_norm_bwd_partial_rows(int dtype, int64_t n_rows, int n_cols, RowConfig cfg, int num_sms) {
  switch (dtype) {
    case 0: return partial_rows_typed<float>(n_rows, n_cols, cfg, num_sms);
    case 1: return partial_rows_typed<__half>(n_rows, n_cols, cfg, num_sms);
    case 2: return partial_rows_typed<__nv_bfloat16>(n_rows, n_cols, cfg, num_sms);
    default: return -1;
  }
}

cudaError_t rms_norm_bwd(int dtype, const void* dy, const void* x, const void* w, const float* rstd, void* dx,
                         void* dw, float* partial, int64_t partial_rows, int64_t n_rows, int n_cols, RowConfig cfg,
                         int num_sms, cudaStream_t stream, const char** why) {
  if (!aligned16(dy) || !aligned16(x) || !aligned16(w) || !aligned16(dx) || !aligned16(partial)) {
    if (why) *why = "dy, x, w, dx and the partial buffer must be 16-byte aligned";
    return cudaErrorInvalidValue;
  }
  NOVATUNE_DISPATCH_DTYPE(dtype, return bwd_typed<T>(dy, x, w, rstd, dx, dw, partial, partial_rows, n_rows, n_cols,
                                                     cfg, num_sms, stream, why))
  return cudaErrorInvalidValue;
}

}  // namespace novatune_cuda
