// RAII owners for CUDA handles used by the CUDA device: streams, events, pinned host buffers
// (exact sizes) and device buffers; plus the device-side cast kernel used when streamed weights are
// stored in one dtype and computed in another.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace lorapipe::cuda {

int device_count();  // 0 when no driver/GPU (never throws)
// CUDART_VERSION compiled against, the runtime loaded and the driver's CUDA version (0 = none).
void versions(int* compiled, int* runtime, int* driver);

class stream {
 public:
  explicit stream(int device);
  ~stream();
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  cudaStream_t get() const { return s_; }
  void synchronize() const;

 private:
  cudaStream_t s_ = nullptr;
};

class event {
 public:
  event();
  ~event();
  event(const event&) = delete;
  event& operator=(const event&) = delete;
  void record(const stream& s);
  void wait_on(const stream& s) const;  // make `s` wait for this event
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

class pinned_buffer {
 public:
  explicit pinned_buffer(size_t bytes);  // exactly `bytes`, page-locked, no rounding
  ~pinned_buffer();
  pinned_buffer(const pinned_buffer&) = delete;
  pinned_buffer& operator=(const pinned_buffer&) = delete;
  void* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

class device_buffer {
 public:
  device_buffer(int device, size_t bytes);
  ~device_buffer();
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  void* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

// dst[i] = float(src[i]) for bf16 bit patterns, on `s`.
void bf16_to_f32(const uint16_t* src, float* dst, size_t n, const stream& s);

}  // namespace lorapipe::cuda
