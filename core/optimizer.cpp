// AdamW, LR schedule and clipping: see optimizer.h.
#include "core/optimizer.h"

#include <cmath>

#include <torch/torch.h>

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
  torch::NoGradGuard no_grad;
  ++t_;
  const double bc1 = 1.0 - std::pow(cfg_.beta1, static_cast<double>(t_));
  const double bc2 = 1.0 - std::pow(cfg_.beta2, static_cast<double>(t_));
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    if (!p.grad().defined()) continue;
    auto g = p.grad().to(torch::kFloat);
    if (cfg_.weight_decay != 0) p.mul_(1.0 - lr * cfg_.weight_decay);
    m_[i].mul_(cfg_.beta1).add_(g, 1.0 - cfg_.beta1);
    v_[i].mul_(cfg_.beta2).addcmul_(g, g, 1.0 - cfg_.beta2);
    auto denom = (v_[i].sqrt() / std::sqrt(bc2)).add_(cfg_.eps);  // as torch.optim.AdamW
    p.addcdiv_(m_[i], denom, -lr / bc1);
  }
}

void adamw::zero_grad() {
  for (auto& p : params_)
    if (p.grad().defined()) p.mutable_grad().zero_();
}

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  torch::NoGradGuard no_grad;
  double sq = 0;
  for (const auto& p : params)
    if (p.grad().defined()) sq += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
  const double norm = std::sqrt(sq);
  if (max_norm > 0 && norm > max_norm) {
    const double s = max_norm / (norm + 1e-6);
    for (const auto& p : params)
      if (p.grad().defined()) p.grad().mul_(s);
  }
  return norm;
}

}  // namespace lorapipe
