// AdamW, LR schedule and clipping: see optimizer.h.
#include "core/model/optimizer.h"

#include <cmath>

#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

namespace lorapipe {

double lr_schedule::at(int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps) return peak_lr * static_cast<double>(step + 1) / warmup_steps;
  const int64_t decay = std::max<int64_t>(1, total_steps - warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / decay);
  const double min_lr = peak_lr * min_lr_ratio;
  return min_lr + 0.5 * (peak_lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

adamw::adamw(std::vector<at::Tensor> params, adamw_config cfg) : params_(std::move(params)), cfg_(cfg) {
  for (const auto& p : params_) {
    m_.push_back(torch::zeros_like(p, torch::kFloat));
    v_.push_back(torch::zeros_like(p, torch::kFloat));
  }
}

void adamw::step(double lr) {
  // Multi-tensor form of torch.optim.AdamW (same arithmetic, few kernel launches per step).
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> p, g, m, v;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].grad().defined()) continue;
    p.push_back(params_[i]);
    g.push_back(params_[i].grad());
    m.push_back(m_[i]);
    v.push_back(v_[i]);
  }
  if (p.empty()) return;
  ++t_;
  const double bc1 = 1.0 - std::pow(cfg_.beta1, static_cast<double>(t_));
  const double bc2 = 1.0 - std::pow(cfg_.beta2, static_cast<double>(t_));
  if (cfg_.weight_decay != 0) at::_foreach_mul_(p, 1.0 - lr * cfg_.weight_decay);
  at::_foreach_lerp_(m, g, 1.0 - cfg_.beta1);
  at::_foreach_mul_(v, cfg_.beta2);
  at::_foreach_addcmul_(v, g, g, 1.0 - cfg_.beta2);
  auto denom = at::_foreach_sqrt(v);
  at::_foreach_div_(denom, std::sqrt(bc2));
  at::_foreach_add_(denom, cfg_.eps);
  at::_foreach_addcdiv_(p, m, denom, -lr / bc1);
}

void adamw::zero_grad() {
  for (auto& p : params_)
    if (p.grad().defined()) p.mutable_grad().zero_();
}

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return 0.0;
  auto norms = at::_foreach_norm(grads, 2);                              // f32 scalar per tensor
  const double norm = torch::stack(norms).to(torch::kDouble).norm().item<double>();
  if (max_norm > 0 && norm > max_norm) at::_foreach_mul_(grads, max_norm / (norm + 1e-6));
  return norm;
}

}  // namespace lorapipe
