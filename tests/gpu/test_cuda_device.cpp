// CUDA device pieces on a real GPU: pinned/device buffers, streams, events, the bf16 cast kernel,
// and OOM mapping to out_of_memory_error. The gpu_tests binary (with test_cuda_pipeline.cpp) exits
// 77 (skipped) when no GPU is present.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cstring>
#include <vector>

#include "offload/cuda/cuda_check.h"
#include "offload/cuda/cuda_resources.h"

using namespace lorapipe;

TEST(CudaDevice, Bf16CastThroughPinnedMemoryAndStreams) {
  cuda::stream up(0), compute(0);
  const size_t n = 1 << 20;
  cuda::pinned_buffer host(n * 2), back(n * 4);
  EXPECT_EQ(host.size(), n * 2);  // exact, no rounding
  auto* h = static_cast<uint16_t*>(host.data());
  for (size_t i = 0; i < n; ++i) h[i] = static_cast<uint16_t>(0x3f80 + (i % 64));  // 1.0 .. slightly above
  cuda::device_buffer src(0, n * 2), dst(0, n * 4);
  LP_CUDA_CHECK(cudaMemcpyAsync(src.data(), host.data(), n * 2, cudaMemcpyHostToDevice, up.get()));
  cuda::event uploaded;
  uploaded.record(up);
  uploaded.wait_on(compute);
  cuda::bf16_to_f32(static_cast<uint16_t*>(src.data()), static_cast<float*>(dst.data()), n, compute);
  LP_CUDA_CHECK(cudaMemcpyAsync(back.data(), dst.data(), n * 4, cudaMemcpyDeviceToHost, compute.get()));
  compute.synchronize();
  const auto* f = static_cast<const float*>(back.data());
  for (size_t i = 0; i < n; i += 4097) {
    uint32_t bits = static_cast<uint32_t>(h[i]) << 16;
    float want;
    std::memcpy(&want, &bits, 4);
    ASSERT_EQ(f[i], want) << i;
  }
}

TEST(CudaDevice, OutOfMemoryIsATypedError) {
  EXPECT_THROW(cuda::device_buffer(0, size_t{1} << 50), out_of_memory_error);
  // The error is not left behind for the next CUDA call (LibTorch's would report it as its own).
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
}

int main(int argc, char** argv) {
  if (cuda::device_count() == 0) {
    std::fprintf(stderr, "no CUDA device: skipping GPU tests\n");
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
