// AdamW over the LoRA parameters (decoupled weight decay), warmup + cosine learning-rate schedule,
// and global-norm gradient clipping. State is plain tensors so it can be checkpointed and sharded.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace lorapipe {

struct adamw_config {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

struct lr_schedule {
  double peak_lr = 1e-3;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double min_lr_ratio = 0.1;  // cosine decays to peak_lr * min_lr_ratio
  double at(int64_t step) const;  // step counts from 0
};

class adamw {
 public:
  adamw(std::vector<at::Tensor> params, adamw_config cfg);
  void step(double lr);  // uses each parameter's .grad()
  void zero_grad();
  int64_t steps_taken() const { return t_; }
  std::vector<at::Tensor>& exp_avg() { return m_; }
  std::vector<at::Tensor>& exp_avg_sq() { return v_; }
  void set_steps_taken(int64_t t) { t_ = t; }
  const std::vector<at::Tensor>& params() const { return params_; }

 private:
  std::vector<at::Tensor> params_, m_, v_;
  adamw_config cfg_;
  int64_t t_ = 0;
};

// Scales gradients so their global L2 norm is at most max_norm (if > 0); returns the norm before.
double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm);

}  // namespace lorapipe
