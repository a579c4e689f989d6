// Event printing for lorapipe-cli: see cli_printer.h.
#include "app/cli_printer.h"

#include "core/engine/event_json.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace lorapipe {
using json = nlohmann::json;

namespace {
std::string hms(double s) {
  if (s < 0 || s > 1e7) return "--:--";
  auto t = static_cast<long>(s + 0.5);
  return t >= 3600 ? fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60) : fmt::format("{}:{:02}", t / 60, t % 60);
}
template <class... A>
void err(fmt::format_string<A...> f, A&&... a) {
  std::fputs(fmt::format(f, std::forward<A>(a)...).c_str(), stderr);
}
}  // namespace

void cli_printer::end_bar() {
  if (bar_open_) std::fputc('\n', stderr);
  bar_open_ = false;
}

void cli_printer::on_event(const engine_event& ev) {
  if (json_) {
    const auto j = event_to_json(ev);
    err("{}\n", j.dump());
    std::fflush(stderr);
    return;
  }
  std::visit(
      [&](const auto& e) {
        using T = std::decay_t<decltype(e)>;
        if constexpr (std::is_same_v<T, run_started_event>) {
          err("model {} ({:.2f}M params), LoRA {} trainable params\n", e.model, e.parameters / 1e6, e.lora_parameters);
          err("data: {} train / {} validation sequences; {} steps x {} tokens; {} threads\n", e.train_sequences,
              e.val_sequences, e.total_steps, e.tokens_per_step, e.threads);
        } else if constexpr (std::is_same_v<T, step_event>) {
          loss_ema_ = loss_ema_ < 0 ? e.loss : 0.9 * loss_ema_ + 0.1 * e.loss;
          const double eta = e.elapsed_s / static_cast<double>(std::max<int64_t>(1, e.step - e.start_step)) *
                             static_cast<double>(e.total_steps - e.step);
          if (tty_) {
            if (e.elapsed_s - last_print_s_ < 0.1 && e.step != e.total_steps) return;
            last_print_s_ = e.elapsed_s;
            const int width = 30;
            const int fill = static_cast<int>(width * e.step / std::max<int64_t>(1, e.total_steps));
            err("\r[{}{}] {}/{} loss {:.4f} lr {:.2e} | {:.0f} tok/s | ETA {}  ", std::string(fill, '#'),
                std::string(width - fill, '.'), e.step, e.total_steps, loss_ema_, e.lr, e.tokens_per_s, hms(eta));
            bar_open_ = true;
          } else if (e.step == 1 || e.step % 10 == 0 || e.step == e.total_steps) {
            err("step {}/{} loss {:.4f} lr {:.2e} grad_norm {:.3f} | {:.0f} tok/s | {} elapsed, ETA {}\n", e.step,
                e.total_steps, e.loss, e.lr, e.grad_norm, e.tokens_per_s, hms(e.elapsed_s), hms(eta));
          }
        } else if constexpr (std::is_same_v<T, eval_event>) {
          end_bar();
          err("step {}: validation loss {:.4f}\n", e.step, e.val_loss);
        } else if constexpr (std::is_same_v<T, checkpoint_event>) {
          if (!tty_) err("step {}: checkpoint {} ({:.1f} KiB)\n", e.step, e.path, static_cast<double>(e.bytes) / 1024.0);
        } else if constexpr (std::is_same_v<T, sample_event>) {
          end_bar();
          err("sample {} training: \"{}\" ->{}\n", e.when, e.prompt, e.text);
        } else if constexpr (std::is_same_v<T, log_event>) {
          end_bar();
          err("{}{}\n", e.lvl == log_event::level::info ? "" : e.lvl == log_event::level::warning ? "warning: " : "error: ",
              e.message);
        } else if constexpr (std::is_same_v<T, phase_event> || std::is_same_v<T, plan_event> || std::is_same_v<T, trace_event>) {
          // Progress within phases, the plan as a value and step traces are for GUIs and --json;
          // the terminal gets the plan and transports as log lines.
        } else {
          if (!e.error.empty()) return;  // a failed run: the front-end prints the error once
          end_bar();
          // A stopped run skips the final validation (0 = not measured), as does a run without validation data.
          const std::string val = e.first_val_loss == 0 && e.final_val_loss == 0 ? "no validation"
                                  : e.final_val_loss == 0 ? fmt::format("validation loss {:.4f} (none at the stop)", e.first_val_loss)
                                                          : fmt::format("validation loss {:.4f} -> {:.4f}", e.first_val_loss, e.final_val_loss);
          err("done: {} steps, {}, {:.0f} tokens/s; adapter in {}{}\n", e.steps, val, e.mean_tokens_per_s, e.adapter_dir,
              e.stopped_early ? " (stopped early)" : "");
        }
      },
      ev);
  std::fflush(stderr);
}

}  // namespace lorapipe
