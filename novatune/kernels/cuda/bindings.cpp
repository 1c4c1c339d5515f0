// PyBind11 bindings of novatune's CUDA kernels (built on first use by novatune/kernels/cuda/__init__.py).
//
// This is the only file that includes torch: it checks devices, dtypes and shapes, makes inputs contiguous and
// 16-byte aligned (a copy only when they are not), allocates outputs with the caching allocator (or checks the
// caller's preallocated ones: the tune validator passes NaN-poisoned buffers), and launches on the current stream,
// so the kernels work inside CUDA graphs and under torch.cuda.stream contexts. Every failure raises with the
// launcher's reason (RuntimeError in Python).
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "launchers.h"

namespace nc = novatune_cuda;

namespace {

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    default: TORCH_CHECK(false, "novatune_cuda: unsupported dtype ", t.scalar_type(), " (float32, float16, bfloat16)");
  }
  return -1;
}

bool aligned(const at::Tensor& t) { return (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0; }

// Contiguous and 16-byte aligned (a contiguous view at an odd storage offset is copied).
at::Tensor dense(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return aligned(c) ? c : c.clone(at::MemoryFormat::Contiguous);
}

at::Tensor out_or_new(const c10::optional<at::Tensor>& out, const at::Tensor& like, const char* name) {
  if (!out.has_value()) return at::empty_like(like, at::MemoryFormat::Contiguous);
  const at::Tensor& o = *out;
  TORCH_CHECK(o.sizes() == like.sizes() && o.scalar_type() == like.scalar_type() && o.device() == like.device() &&
                  o.is_contiguous() && aligned(o),
              "novatune_cuda: ", name, " must be contiguous, 16-byte aligned, shape ", like.sizes(), " dtype ",
              like.scalar_type());
  return o;
}

int num_sms(const at::Tensor& t) {
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, t.get_device()));
  return n;
}

void check(cudaError_t err, const char* why, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "novatune_cuda ", what, ": ", why != nullptr ? why : cudaGetErrorString(err));
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda() && a.device() == b.device(), "novatune_cuda ", what,
              ": tensors must be on the same CUDA device");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "novatune_cuda ", what, ": dtypes differ (", a.scalar_type(),
              " vs ", b.scalar_type(), ")");
}

nc::RowConfig row_config(int64_t items, int64_t unroll, int64_t block_threads, int64_t blocks_per_sm) {
  return nc::RowConfig{static_cast<int>(items), static_cast<int>(unroll), static_cast<int>(block_threads),
                       static_cast<int>(blocks_per_sm)};
}

}  // namespace

// (y, rstd): y like x, rstd fp32 of shape x.shape[:-1]
std::vector<at::Tensor> rms_norm_fwd(const at::Tensor& x_in, const at::Tensor& w_in, double eps,
                                     c10::optional<at::Tensor> out, c10::optional<at::Tensor> rstd_out,
                                     int64_t items, int64_t unroll, int64_t block_threads) {
  check_same(x_in, w_in, "rms_norm_fwd");
  const int64_t n = x_in.size(-1);
  TORCH_CHECK(w_in.dim() == 1 && w_in.size(0) == n, "novatune_cuda rms_norm_fwd: weight must have shape (", n, ",)");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = dense(x_in), w = dense(w_in);
  at::Tensor y = out_or_new(out, x, "out");
  const auto lead = x.sizes().slice(0, x.dim() - 1);
  at::Tensor rstd = rstd_out.has_value() ? *rstd_out : at::empty(lead, x.options().dtype(at::kFloat));
  TORCH_CHECK(rstd.sizes() == lead && rstd.scalar_type() == at::kFloat && rstd.is_contiguous(),
              "novatune_cuda rms_norm_fwd: rstd must be contiguous fp32 of shape ", lead);
  if (x.numel() == 0) return {y, rstd};
  const char* why = nullptr;
  check(nc::rms_norm_fwd(dtype_code(x), x.data_ptr(), w.data_ptr(), y.data_ptr(), rstd.data_ptr<float>(),
                         x.numel() / n, static_cast<int>(n), static_cast<float>(eps),
                         row_config(items, unroll, block_threads, 0), num_sms(x),
                         c10::cuda::getCurrentCUDAStream(x.get_device()).stream(), &why),
        why, "rms_norm_fwd");
  return {y, rstd};
}

// (dx, dw): dx like x, dw like w
std::vector<at::Tensor> rms_norm_bwd(const at::Tensor& dy_in, const at::Tensor& x_in, const at::Tensor& w_in,
                                     const at::Tensor& rstd_in, c10::optional<at::Tensor> dx_out,
                                     c10::optional<at::Tensor> dw_out, int64_t items, int64_t unroll,
                                     int64_t block_threads, int64_t blocks_per_sm) {
  check_same(x_in, w_in, "rms_norm_bwd");
  check_same(dy_in, x_in, "rms_norm_bwd");
  TORCH_CHECK(dy_in.sizes() == x_in.sizes(), "novatune_cuda rms_norm_bwd: dy and x shapes differ");
  const int64_t n = x_in.size(-1);
  TORCH_CHECK(w_in.dim() == 1 && w_in.size(0) == n, "novatune_cuda rms_norm_bwd: weight must have shape (", n, ",)");
  TORCH_CHECK(rstd_in.scalar_type() == at::kFloat && rstd_in.numel() * n == x_in.numel(),
              "novatune_cuda rms_norm_bwd: rstd must be fp32 with one value per row");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor dy = dense(dy_in), x = dense(x_in), w = dense(w_in), rstd = rstd_in.contiguous();
  at::Tensor dx = out_or_new(dx_out, x, "dx");
  at::Tensor dw = out_or_new(dw_out, w, "dw");
  const int64_t rows = n > 0 ? x.numel() / n : 0;
  const nc::RowConfig cfg = row_config(items, unroll, block_threads, blocks_per_sm);
  const int code = dtype_code(x), sms = num_sms(x);
  const int64_t g = nc::rms_norm_bwd_partial_rows(code, rows, static_cast<int>(n), cfg, sms);
  TORCH_CHECK(g > 0, "novatune_cuda rms_norm_bwd: this configuration cannot run N=", n, " (items ", items,
              ", unroll ", unroll, ", block_threads ", block_threads, ")");
  at::Tensor partial = at::empty({g, n}, x.options().dtype(at::kFloat));  // (G, N) fp32 dw partials
  const char* why = nullptr;
  check(nc::rms_norm_bwd(code, dy.data_ptr(), x.data_ptr(), w.data_ptr(), rstd.data_ptr<float>(), dx.data_ptr(),
                         dw.data_ptr(), partial.data_ptr<float>(), g, rows, static_cast<int>(n), cfg, sms,
                         c10::cuda::getCurrentCUDAStream(x.get_device()).stream(), &why),
        why, "rms_norm_bwd");
  return {dx, dw};
}

at::Tensor swiglu_fwd(const at::Tensor& g_in, const at::Tensor& u_in, c10::optional<at::Tensor> out,
                      int64_t threads, int64_t vecs) {
  check_same(g_in, u_in, "swiglu_fwd");
  TORCH_CHECK(g_in.sizes() == u_in.sizes(), "novatune_cuda swiglu_fwd: gate and up shapes differ");
  const c10::cuda::CUDAGuard guard(g_in.device());
  const at::Tensor g = dense(g_in), u = dense(u_in);
  at::Tensor y = out_or_new(out, g, "out");
  const char* why = nullptr;
  check(nc::swiglu_fwd(dtype_code(g), g.data_ptr(), u.data_ptr(), y.data_ptr(), g.numel(), static_cast<int>(threads),
                       static_cast<int>(vecs), num_sms(g), c10::cuda::getCurrentCUDAStream(g.get_device()).stream(),
                       &why),
        why, "swiglu_fwd");
  return y;
}

std::vector<at::Tensor> swiglu_bwd(const at::Tensor& dy_in, const at::Tensor& g_in, const at::Tensor& u_in,
                                   c10::optional<at::Tensor> dg_out, c10::optional<at::Tensor> du_out,
                                   int64_t threads, int64_t vecs) {
  check_same(g_in, u_in, "swiglu_bwd");
  check_same(dy_in, g_in, "swiglu_bwd");
  TORCH_CHECK(g_in.sizes() == u_in.sizes() && dy_in.sizes() == g_in.sizes(),
              "novatune_cuda swiglu_bwd: dy, gate and up shapes differ");
  const c10::cuda::CUDAGuard guard(g_in.device());
  const at::Tensor dy = dense(dy_in), g = dense(g_in), u = dense(u_in);
  at::Tensor dg = out_or_new(dg_out, g, "dgate");
  at::Tensor du = out_or_new(du_out, u, "dup");
  const char* why = nullptr;
  check(nc::swiglu_bwd(dtype_code(g), dy.data_ptr(), g.data_ptr(), u.data_ptr(), dg.data_ptr(), du.data_ptr(),
                       g.numel(), static_cast<int>(threads), static_cast<int>(vecs), num_sms(g),
                       c10::cuda::getCurrentCUDAStream(g.get_device()).stream(), &why),
        why, "swiglu_bwd");
  return {dg, du};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "novatune CUDA kernels: RMSNorm and SwiGLU forward/backward (16-byte vector I/O, fp32 math)";
  m.def("rms_norm_fwd", &rms_norm_fwd, "RMSNorm forward -> (y, rstd)", py::arg("x"), py::arg("weight"),
        py::arg("eps"), py::arg("out") = py::none(), py::arg("rstd") = py::none(), py::arg("items") = 1,
        py::arg("unroll") = 1, py::arg("block_threads") = 256);
  m.def("rms_norm_bwd", &rms_norm_bwd, "RMSNorm backward -> (dx, dw)", py::arg("dy"), py::arg("x"),
        py::arg("weight"), py::arg("rstd"), py::arg("dx") = py::none(), py::arg("dw") = py::none(),
        py::arg("items") = 1, py::arg("unroll") = 1, py::arg("block_threads") = 256, py::arg("blocks_per_sm") = 0);
  m.def("swiglu_fwd", &swiglu_fwd, "silu(gate) * up", py::arg("gate"), py::arg("up"), py::arg("out") = py::none(),
        py::arg("threads") = 256, py::arg("vecs") = 2);
  m.def("swiglu_bwd", &swiglu_bwd, "SwiGLU backward -> (dgate, dup)", py::arg("dy"), py::arg("gate"),
        py::arg("up"), py::arg("dgate") = py::none(), py::arg("dup") = py::none(), py::arg("threads") = 256,
        py::arg("vecs") = 2);
}
