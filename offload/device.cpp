// Shared part of the device interface: the weight arena (placement, accounting, release) and the
// staging statistics. See device.h.
#include "offload/device.h"

#include <cmath>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "core/base/errors.h"

namespace lorapipe {

// The preallocated memory of a weight arena and its best-fit bookkeeping. Shared by the device and
// every block placed in it, so a tensor outliving its executor still releases into a live arena.
struct weight_region {
  memory_arena arena;
  std::shared_ptr<void> memory;
  memory_arena* charged = nullptr;  // the device arena the region's bytes are charged to
  size_t charge = 0;                // its block there
  std::mutex mu;
  compute_device* owner = nullptr;  // null once the device is gone
  weight_region(std::string name, size_t bytes) : arena(std::move(name), bytes, weight_alignment, /*contiguous=*/true) {}
  void released() {
    std::lock_guard lock(mu);
    if (owner != nullptr) owner->weights_released();
  }
  void detach() {
    std::lock_guard lock(mu);
    owner = nullptr;
    if (charged != nullptr) charged->release(charge);
    charged = nullptr;
  }
};

compute_device::compute_device() = default;
compute_device::~compute_device() = default;

void compute_device::detach_weight_arena() {
  if (region_) region_->detach();
  region_.reset();
}

status compute_device::reserve_weight_arena(size_t bytes) {
  if (region_ && region_->arena.capacity() >= bytes) return ok_status();
  if (region_ && region_->arena.used() > 0)
    return make_error("{}: the weight arena is in use and cannot grow from {} to {} bytes", name(), region_->arena.capacity(), bytes);
  detach_weight_arena();
  if (bytes == 0) return ok_status();
  auto charge = arena().allocate(bytes);
  if (!charge) return make_error("{} (weight arena of {} bytes)", charge.message(), bytes);
  auto r = std::make_shared<weight_region>(name() + "/weights", bytes);
  try {
    r->memory = allocate_region(bytes);
  } catch (...) {
    arena().release(*charge);
    throw;
  }
  r->charged = &arena();
  r->charge = *charge;
  r->owner = this;
  region_ = std::move(r);
  return ok_status();
}

memory_arena* compute_device::weight_arena() const { return region_ ? &region_->arena : nullptr; }

result<weight_placement> compute_device::place_weights(const std::vector<at::Tensor>& host, size_t slot_bytes) {
  if (!region_) return make_error("{}: no weight arena reserved", name());
  std::vector<size_t> sizes;
  for (const auto& t : host) sizes.push_back(t.defined() ? t.numel() * t.element_size() : 0);
  const block_layout layout = layout_block(sizes, weight_alignment);
  auto off = region_->arena.allocate(std::max(layout.bytes, slot_bytes));
  if (!off) return make_error("{}", off.message());
  weight_placement p;
  p.base = static_cast<char*>(region_->memory.get()) + *off;
  p.offsets = layout.offsets;
  p.bytes = layout.bytes;
  // The block's release: first the device's fence (later uploads into this range wait for the
  // compute that read it), then the range becomes free for the next placement.
  p.block = std::shared_ptr<void>(p.base, [r = region_, o = *off](void*) {
    r->released();
    r->arena.release(o);
  });
  return p;
}

std::vector<at::Tensor> compute_device::upload_weights(const weight_placement& p, const std::vector<at::Tensor>& host) {
  std::vector<at::Tensor> out;
  out.reserve(host.size());
  weight_upload_begin();
  for (size_t i = 0; i < host.size(); ++i) {
    if (!host[i].defined()) {
      out.emplace_back();
      continue;
    }
    const at::Tensor src = host[i].contiguous();
    char* dst = p.base + p.offsets[i];
    copy_weights_to(dst, src);
    out.push_back(at::from_blob(dst, src.sizes(), [keep = p.block](void*) {}, src.options().device(torch_device())));
  }
  weight_upload_end();
  return out;
}

void compute_device::nccl_send(int, const at::Tensor&) {
  throw device_error(fmt::format("{}: the nccl transport needs CUDA devices with NCCL enabled", name()));
}
at::Tensor compute_device::nccl_recv(int, at::IntArrayRef, at::ScalarType) {
  throw device_error(fmt::format("{}: the nccl transport needs CUDA devices with NCCL enabled", name()));
}

staging_stats compute_device::staging() const { return staging_ ? staging_->stats() : staging_stats{}; }

std::vector<std::string> memory_plan_warnings(const std::vector<compute_device*>& devices) {
  std::map<int, size_t> planned, measured;
  for (auto* d : devices) {
    const auto peak = d->measured_gpu_peak_bytes();
    if (!peak) continue;
    const auto ws = d->library_workspaces();
    planned[d->gpu()] += d->arena().peak() + ws.bytes * static_cast<size_t>(ws.count);
    measured[d->gpu()] = std::max(measured[d->gpu()], *peak);
  }
  for (auto* d : devices)
    if (d->measured_gpu_peak_bytes() && d->weight_arena() != nullptr) measured[d->gpu()] += d->weight_arena()->capacity();
  std::vector<std::string> out;
  for (const auto& [gpu, p] : planned)
    if (auto w = plan_drift_warning(fmt::format("cuda:{}", gpu), p, measured[gpu])) out.push_back(*w);
  for (auto* d : devices) d->reset_measured_peak();
  return out;
}

std::optional<std::string> plan_drift_warning(const std::string& gpu, size_t planned_bytes, size_t measured_bytes) {
  const double p = static_cast<double>(planned_bytes), m = static_cast<double>(measured_bytes);
  if (p <= 0 || std::abs(m - p) <= 0.05 * p) return std::nullopt;
  return fmt::format("{}: the memory plan charged {:.1f} MiB at the peak of the first step but the GPU held {:.1f} MiB ({:+.0f}%): "
                     "memory the plan does not see (logits, LoRA copies, workspaces) or a plan too generous; "
                     "offload.device_memory_mb may need adjusting",
                     gpu, p / 1048576.0, m / 1048576.0, 100.0 * (m - p) / p);
}

}  // namespace lorapipe
