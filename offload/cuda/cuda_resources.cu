// CUDA RAII handles and the bf16 -> f32 cast kernel: see cuda_resources.h.
#include <algorithm>
#include <string>

#include "offload/cuda/cuda_check.h"
#include "offload/cuda/cuda_resources.h"

namespace lorapipe::cuda {

void throw_cuda_error(cudaError_t e, const char* what, const char* file, int line) {
  // Clear the thread's last error: a failure that leaves the context usable (an allocation that did
  // not fit, say) must not resurface as the error of LibTorch's next, unrelated CUDA call.
  (void)cudaGetLastError();
  std::string msg = std::string("CUDA error ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ") in " + what +
                    " at " + file + ":" + std::to_string(line);
  if (e == cudaErrorMemoryAllocation) throw out_of_memory_error(msg);
  throw device_error(msg);
}

void versions(int* compiled, int* runtime, int* driver) {
  *compiled = CUDART_VERSION;
  if (cudaRuntimeGetVersion(runtime) != cudaSuccess) *runtime = 0;
  if (cudaDriverGetVersion(driver) != cudaSuccess) *driver = 0;
  (void)cudaGetLastError();
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

stream::stream(int device) {
  LP_CUDA_CHECK(cudaSetDevice(device));
  LP_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
}
stream::~stream() {
  if (s_ != nullptr) cudaStreamDestroy(s_);
}
void stream::synchronize() const { LP_CUDA_CHECK(cudaStreamSynchronize(s_)); }

event::event() { LP_CUDA_CHECK(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming)); }
event::~event() {
  if (e_ != nullptr) cudaEventDestroy(e_);
}
void event::record(const stream& s) { LP_CUDA_CHECK(cudaEventRecord(e_, s.get())); }
void event::wait_on(const stream& s) const { LP_CUDA_CHECK(cudaStreamWaitEvent(s.get(), e_, 0)); }

pinned_buffer::pinned_buffer(size_t bytes) : n_(bytes) { LP_CUDA_CHECK(cudaHostAlloc(&p_, bytes, cudaHostAllocPortable)); }
pinned_buffer::~pinned_buffer() {
  if (p_ != nullptr) cudaFreeHost(p_);
}

device_buffer::device_buffer(int device, size_t bytes) : n_(bytes) {
  LP_CUDA_CHECK(cudaSetDevice(device));
  LP_CUDA_CHECK(cudaMalloc(&p_, bytes));
}
device_buffer::~device_buffer() {
  if (p_ != nullptr) cudaFree(p_);
}

namespace {
__global__ void bf16_to_f32_kernel(const uint16_t* __restrict__ src, float* __restrict__ dst, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = __uint_as_float(static_cast<uint32_t>(src[i]) << 16);
}
}  // namespace

void bf16_to_f32(const uint16_t* src, float* dst, size_t n, const stream& s) {
  if (n == 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<size_t>((n + threads - 1) / threads, 4096));
  bf16_to_f32_kernel<<<blocks, threads, 0, s.get()>>>(src, dst, n);
  LP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace lorapipe::cuda
