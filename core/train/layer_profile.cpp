// The layer profiler: see layer_profile.h.
#include "core/train/layer_profile.h"

#include <algorithm>
#include <atomic>
#include <chrono>

#include <c10/core/DeviceGuard.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

#include "core/base/device_spec.h"
#include "core/model/llama_model.h"
#include "core/model/lora.h"
#include "core/model/tensor_io.h"
#include "core/project/lora_target.h"

namespace lorapipe {

namespace {

using clock_type = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// A model of one layer per kind (full, then sliding-window attention where the family has both):
// random frozen weights in the compute dtype on `dev`, the embedding, final norm and LM head.
struct profile_model {
  llama_config cfg;             // num_layers = kinds; sliding_layers marks the sliding one
  std::vector<int64_t> kind_of;  // per layer of the real model: its index here
  llama_weights w;
};

profile_model make_profile_model(const llama_config& mc, at::ScalarType dtype, c10::Device dev) {
  profile_model m;
  m.cfg = mc;
  int64_t full = -1, sliding = -1;
  std::vector<bool> kinds;
  for (int64_t l = 0; l < mc.num_layers; ++l) {
    int64_t& k = mc.is_sliding(l) ? sliding : full;
    if (k < 0) {
      k = static_cast<int64_t>(kinds.size());
      kinds.push_back(mc.is_sliding(l));
    }
    m.kind_of.push_back(k);
  }
  m.cfg.num_layers = static_cast<int64_t>(kinds.size());
  m.cfg.sliding_layers = kinds;
  const auto opts = at::TensorOptions().dtype(dtype).device(dev);
  auto& w = m.w;
  w.cfg = m.cfg;
  w.dtype = dtype;
  w.embed = torch::randn({mc.vocab_size, mc.hidden_size}, opts) * 0.02;  // [V,D]
  for (size_t k = 0; k < kinds.size(); ++k) {
    layer_weights lw;
    for (const auto& spec : layer_tensor_specs(m.cfg))
      lw[spec.slot] = spec.shape.size() == 1 ? torch::ones(spec.shape, opts) : torch::randn(spec.shape, opts) * 0.02;
    w.layers.push_back(std::move(lw));
  }
  w.final_norm = torch::ones({mc.hidden_size}, opts);                        // [D]
  w.lm_head = torch::randn({mc.vocab_size, mc.hidden_size}, opts) * 0.02;   // [V,D]
  w.rope = make_rope_tables(m.cfg).to(dev);
  return m;
}

// The project's LoRA on the profile model, as the executor holds it on a device: A and B in the
// compute dtype, leaves that take gradients.
lora_adapters device_lora(const project_config& cfg, const llama_weights& w, at::ScalarType dtype, c10::Device dev) {
  lora_config lc;
  lc.r = cfg.lora.r;
  lc.alpha = cfg.lora.alpha;
  lc.dropout = cfg.lora.dropout;
  lc.targets.clear();
  for (const auto& name : fit_lora_targets(w.cfg, cfg.lora.targets))
    if (auto t = lora_target_from_name(name)) lc.targets.push_back(*t);
  // init_lora reads the projections' shapes only; they are the same on the host.
  lora_adapters a = init_lora(w, lc, static_cast<uint64_t>(cfg.run.seed));
  for (auto& layer : a.layers)
    for (auto& p : layer)
      if (p.a.defined()) {
        p.a = p.a.detach().to(dev, dtype).requires_grad_(true);
        p.b = (torch::randn(p.b.sizes(), at::TensorOptions().dtype(dtype).device(dev)) * 0.02).requires_grad_(true);
      }
  return a;
}

// Times `f` on `dev` (CUDA: between synchronisations).
template <class F>
double timed(c10::Device dev, F&& f) {
  if (dev.is_cuda()) torch::cuda::synchronize(dev.index());
  const auto t0 = clock_type::now();
  f();
  if (dev.is_cuda()) torch::cuda::synchronize(dev.index());
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// Bytes LibTorch's allocators hand out on this thread while installed (CPU and CUDA both report to a
// memory-profiling debug info, as torch.profiler's profile_memory does): what a forward leaves
// allocated is its output and the tensors its autograd graph saved.
// On CUDA the caching allocator reports its blocks (sizes rounded up): a little above the tensors.
struct allocation_meter final : c10::MemoryReportingInfoBase {
  std::atomic<int64_t> current{0};  // intra-op threads inherit the thread-local state
  bool memoryProfilingEnabled() const override { return true; }
  void reportMemoryUsage(void* /*ptr*/, int64_t alloc_size, size_t /*total_allocated*/, size_t /*total_reserved*/,
                         c10::Device /*device*/) override {
    current += alloc_size;
  }
};

// Bytes the autograd graph of `forward` (which returns its output) holds once it has run: what
// stays allocated, less the output. 0 (not measured) while a profiler holds the slot the meter uses.
template <class F>
double graph_bytes(F&& forward) {
  if (c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE) != nullptr) return 0;
  auto meter = std::make_shared<allocation_meter>();
  at::Tensor y;
  {
    c10::DebugInfoGuard metering(c10::DebugInfoKind::PROFILER_STATE, meter);
    y = forward();
  }
  return static_cast<double>(meter->current.load()) - static_cast<double>(y.numel() * y.element_size());
}

// The times of one micro-batch shape, a sample per kept round.
struct shape_samples {
  int64_t rows, seq_len;
  at::Tensor tokens;  // i64 [rows, seq_len]
  std::vector<std::vector<double>> fwd, fwd_nograd, bwd;  // per layer kind
  std::vector<double> embed, head_f, head_b;
  shape_samples(int64_t r, int64_t t, size_t kinds, int64_t vocab, c10::Device dev)
      : rows(r), seq_len(t), tokens(torch::randint(vocab, {r, t}, at::TensorOptions().dtype(at::kLong).device(dev))),
        fwd(kinds), fwd_nograd(kinds), bwd(kinds) {}
  // Medians per layer of the real model (`kind_of`: its kind).
  shape_times medians(const std::vector<int64_t>& kind_of) const {
    shape_times out;
    out.rows = rows;
    out.seq_len = seq_len;
    for (int64_t k : kind_of) {
      out.layer_forward_s.push_back(median(fwd[static_cast<size_t>(k)]));
      out.layer_forward_nograd_s.push_back(median(fwd_nograd[static_cast<size_t>(k)]));
      out.layer_backward_s.push_back(median(bwd[static_cast<size_t>(k)]));
    }
    out.embed_s = median(embed);
    out.head_forward_s = median(head_f);
    out.head_backward_s = median(head_b);
    return out;
  }
};

// One round on one shape: the embedding, each layer kind's forward with autograd, backward and
// forward without, the head's loss forward and backward; the samples are kept when `keep`.
void measure_round(const profile_model& m, const layer_context& ctx, const at::TensorOptions& opts, c10::Device dev, shape_samples& sh,
                   bool keep) {
  at::Tensor x;  // [B,T,D]
  const double te = timed(dev, [&] {
    torch::NoGradGuard ng;
    x = embed_with(m.cfg, m.w.embed, sh.tokens);
  });
  if (keep) sh.embed.push_back(te);
  for (size_t k = 0; k < m.w.layers.size(); ++k) {
    const auto l = static_cast<int64_t>(k);
    at::Tensor leaf = x.detach().requires_grad_(true), y;
    const double tf = timed(dev, [&] { y = decoder_layer(ctx, l, m.w.layers[k], leaf, 0, nullptr); });
    const at::Tensor g = torch::randn_like(y) * 1e-3;  // [B,T,D]
    const double tb = timed(dev, [&] { y.backward(g); });
    const double tn = timed(dev, [&] {
      torch::NoGradGuard ng;
      (void)decoder_layer(ctx, l, m.w.layers[k], x, 0, nullptr);
    });
    if (keep) sh.fwd[k].push_back(tf), sh.fwd_nograd[k].push_back(tn), sh.bwd[k].push_back(tb);
  }
  at::Tensor h = (torch::randn({sh.rows, sh.seq_len, m.cfg.hidden_size}, opts)).requires_grad_(true), loss;  // [B,T,D]
  const double thf = timed(dev, [&] { loss = head_loss_sum(m.cfg, m.w.final_norm, m.w.lm_head, h, sh.tokens); });
  const double thb = timed(dev, [&] { loss.backward(); });
  if (keep) sh.head_f.push_back(thf), sh.head_b.push_back(thb);
}

// Restores the thread count of LibTorch's intra-op pool.
struct thread_scope {
  int saved = at::get_num_threads();
  explicit thread_scope(int n) {
    if (n > 0) at::set_num_threads(n);
  }
  ~thread_scope() { at::set_num_threads(saved); }
  thread_scope(const thread_scope&) = delete;
  thread_scope& operator=(const thread_scope&) = delete;
};

}  // namespace

result<layer_profile> profile_layers(const project_config& cfg, const llama_config& mc, const profile_options& o) {
  try {
    LP_TRY_ASSIGN(dtype, parse_dtype_name(cfg.model.dtype));
    LP_TRY_ASSIGN(spec, parse_device_spec(cfg.parallel.devices));
    const c10::Device dev = spec.gpus.empty() ? c10::Device(c10::kCPU) : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(spec.gpus[0]));
    const bool pipelined = cfg.parallel.schedule != "single" && device_count(cfg.parallel.devices) > 1;
    const int64_t rows = std::max<int64_t>(1, cfg.run.batch_size / (pipelined ? std::max<int64_t>(1, cfg.parallel.micro_batches) : 1));
    const int64_t T = cfg.data.seq_len;
    const auto start = clock_type::now();
    thread_scope threads(dev.is_cpu() ? static_cast<int>(cfg.parallel.threads_per_device) : 0);
    const c10::DeviceGuard on_device(dev);  // cuBLAS and kernels on the profiled GPU, from any thread
    profile_model m = make_profile_model(mc, dtype, dev);
    lora_adapters lora = device_lora(cfg, m.w, dtype, dev);
    const layer_context ctx{m.cfg, m.w.rope, &lora, true, dropout_key(static_cast<uint64_t>(cfg.run.seed), 0, 0)};
    const auto opts = at::TensorOptions().dtype(dtype).device(dev);
    const size_t kinds = m.w.layers.size();
    std::vector<double> graph(kinds, 0.0);
    // The project's shape, and a second smaller one (half the rows, else half the sequence; none
    // for a single token): the cost model charges other shapes along the line through both.
    const int64_t rows2 = rows >= 2 ? rows / 2 : rows, T2 = rows >= 2 ? T : T / 2;
    std::vector<shape_samples> shapes;
    shapes.emplace_back(rows, T, kinds, mc.vocab_size, dev);
    if (T2 >= 1 && rows2 * T2 < rows * T) shapes.emplace_back(rows2, T2, kinds, mc.vocab_size, dev);
    // Warm-up: at least o.warmup rounds and o.warmup_seconds (allocator, caches, clocks settle).
    // Each round measures every shape, so a drift of the machine's speed hits both alike.
    double warm_s = 0, kept_s = 0;
    int warm = 0, round = 0;
    for (; round < warm + o.repeats || (kept_s < o.min_seconds && round < warm + o.max_repeats); ++round) {
      if (round == warm && (warm < o.warmup || warm_s < o.warmup_seconds)) ++warm;
      const bool keep = round >= warm;
      const auto round_start = clock_type::now();
      for (auto& sh : shapes) measure_round(m, ctx, opts, dev, sh, keep);
      if (round == warm) {  // once, warm: the graph one layer's forward keeps for its backward
        at::Tensor x;       // [B,T,D]
        {
          torch::NoGradGuard ng;
          x = embed_with(m.cfg, m.w.embed, shapes[0].tokens);
        }
        for (size_t k = 0; k < kinds; ++k) {
          at::Tensor again = x.detach().requires_grad_(true);
          graph[k] = graph_bytes([&] { return decoder_layer(ctx, static_cast<int64_t>(k), m.w.layers[k], again, 0, nullptr); });
        }
      }
      (keep ? kept_s : warm_s) += std::chrono::duration<double>(clock_type::now() - round_start).count();
    }
    layer_profile p;
    auto& c = p.compute;
    static_cast<shape_times&>(c) = shapes[0].medians(m.kind_of);
    if (shapes.size() > 1) c.second = shapes[1].medians(m.kind_of);
    p.device = dev.is_cpu() ? fmt::format("cpu ({} thread{})", at::get_num_threads(), at::get_num_threads() == 1 ? "" : "s")
                            : fmt::format("cuda:{}", dev.index());
    p.dtype = cfg.model.dtype;
    p.warmup = warm;
    p.repeats = round - warm;
    const size_t elem = compute_element_bytes(cfg);
    for (const auto& spec : layer_tensor_specs(mc)) {
      double n = 1;
      for (auto d : spec.shape) n *= static_cast<double>(d);
      p.weight_bytes_per_layer += n * static_cast<double>(elem);
    }
    p.graph_bytes_per_token_model = stash_bytes_per_layer(mc, 1, T, elem, graph_targets_of(cfg.lora.targets));
    double graph_sum = 0;
    for (int64_t l = 0; l < mc.num_layers; ++l) graph_sum += graph[static_cast<size_t>(m.kind_of[static_cast<size_t>(l)])];
    p.graph_bytes_per_token = graph_sum / static_cast<double>(mc.num_layers) / static_cast<double>(rows * T);
    p.seconds = std::chrono::duration<double>(clock_type::now() - start).count();
    return p;
  } catch (const std::exception& e) {
    return make_error("layer profile on {}: {}", cfg.parallel.devices, e.what());
  }
}

}  // namespace lorapipe
