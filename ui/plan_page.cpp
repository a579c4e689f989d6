// Plan page: see plan_page.h.
#include "ui/plan_page.h"

#include <algorithm>

#include <QFormLayout>
#include <QGroupBox>
#include <QHBoxLayout>
#include <QHeaderView>
#include <QSplitter>
#include <QTableView>
#include <QVBoxLayout>

#include "core/engine/plan_questions.h"
#include "core/engine/plan_report.h"
#include "ui/async.h"
#include "ui/charts.h"
#include "ui/gantt_view.h"
#include "ui/models.h"

namespace lorapipe::ui {

PlanPage::PlanPage(QWidget* parent) : QWidget(parent) {
  auto* layout = new QVBoxLayout(this);
  auto* controls = new QHBoxLayout;
  schedule_ = new QComboBox;
  schedule_->setObjectName("planSchedule");
  for (const auto& s : field_choices("parallel.schedule")) schedule_->addItem(QString::fromStdString(s));
  devices_ = new QLineEdit;
  devices_->setObjectName("planDevices");
  devices_->setToolTip(tr("cpu, cpu:N (CPU virtual devices) or cuda:0,1,…"));
  micro_ = new QSpinBox;
  micro_->setObjectName("planMicroBatches");
  micro_->setRange(1, 1024);
  gflops_ = new QDoubleSpinBox;
  gflops_->setRange(1, 1e6);
  gflops_->setValue(100);
  gflops_->setSuffix(tr(" GFLOP/s"));
  gflops_->setToolTip(tr("Assumed compute throughput per device for the prediction when the project has no layer profile (lorapipe-cli plan --profile)"));
  auto* sl = new QLabel(tr("&Schedule"));
  sl->setBuddy(schedule_);
  auto* dl = new QLabel(tr("&Devices"));
  dl->setBuddy(devices_);
  auto* ml = new QLabel(tr("&Micro-batches"));
  ml->setBuddy(micro_);
  auto* gl = new QLabel(tr("&Throughput"));
  gl->setBuddy(gflops_);
  for (QWidget* w : std::initializer_list<QWidget*>{sl, schedule_, dl, devices_, ml, micro_, gl, gflops_}) controls->addWidget(w);
  controls->addStretch(1);
  layout->addLayout(controls);
  summary_ = new QLabel;
  summary_->setObjectName("planSummary");
  summary_->setWordWrap(true);
  summary_->setTextInteractionFlags(Qt::TextSelectableByMouse);
  layout->addWidget(summary_);
  auto* ask = new QHBoxLayout;
  auto* wl = new QLabel(tr("&What if"));
  whatIf_ = new QLineEdit;
  whatIf_->setObjectName("planWhatIf");
  whatIf_->setPlaceholderText(tr("seq_len=2048   devices=+1   p2p=off   micro_batches=8 offload.stream_weights=off"));
  whatIf_->setToolTip(tr("Settings to change (field=value, space-separated): the changed project is planned and compared with this plan"));
  wl->setBuddy(whatIf_);
  auto* askButton = new QPushButton(tr("Compare"));
  askButton->setObjectName("planAsk");
  keep_ = new QPushButton(tr("Keep this plan"));
  keep_->setObjectName("planKeep");
  keep_->setToolTip(tr("Store the planner's choices (schedule, micro-batches, layers per stage; with offload.auto the offload settings) in the project"));
  keep_->setEnabled(false);
  ask->addWidget(wl);
  ask->addWidget(whatIf_, 1);
  ask->addWidget(askButton);
  ask->addWidget(keep_);
  layout->addLayout(ask);
  whatIfAnswer_ = new QLabel;
  whatIfAnswer_->setObjectName("planWhatIfAnswer");
  whatIfAnswer_->setTextInteractionFlags(Qt::TextSelectableByMouse);
  whatIfAnswer_->setWordWrap(true);
  whatIfAnswer_->hide();
  layout->addWidget(whatIfAnswer_);
  connect(whatIf_, &QLineEdit::returnPressed, this, [this] { askWhatIf(); });
  connect(askButton, &QPushButton::clicked, this, [this] { askWhatIf(); });
  connect(keep_, &QPushButton::clicked, this, &PlanPage::keepPlan);
  gantt_ = new GanttView;
  gantt_->setObjectName("planGantt");
  gantt_->setSizePolicy(QSizePolicy::Expanding, QSizePolicy::Fixed);  // as tall as its devices need
  layout->addWidget(gantt_);
  auto* lower = new QWidget;
  auto* h = new QHBoxLayout(lower);
  h->setContentsMargins(0, 0, 0, 0);
  memory_ = new BarChart(tr("Memory per device at its peak"));
  memory_->setObjectName("planMemory");
  memory_->chart()->legend()->setAlignment(Qt::AlignRight);  // six buffer kinds: one per line, never cut off
  h->addWidget(memory_, 1);
  links_ = new TextTableModel(this);
  auto* table = new QTableView;
  table->setObjectName("planLinks");
  table->setModel(links_);
  table->verticalHeader()->hide();
  table->horizontalHeader()->setStretchLastSection(true);
  table->setWordWrap(true);
  auto* box = new QGroupBox(tr("Links between stages"));
  auto* bl = new QVBoxLayout(box);
  bl->addWidget(table);
  h->addWidget(box, 1);
  layout->addWidget(lower, 1);
  connect(schedule_, &QComboBox::currentTextChanged, this, [this](const QString& s) {
    if (!loading_) emit fieldEdited("parallel.schedule", s);
  });
  connect(devices_, &QLineEdit::textEdited, this, [this](const QString& s) { emit fieldEdited("parallel.devices", s); });
  connect(micro_, &QSpinBox::valueChanged, this, [this](int v) {
    if (!loading_) emit fieldEdited("parallel.micro_batches", v);
  });
  connect(gflops_, &QDoubleSpinBox::valueChanged, this, &PlanPage::replan);
}

void PlanPage::setProject(const project_config& cfg, bool valid) {
  cfg_ = cfg;
  valid_ = valid;
  loading_ = true;
  schedule_->setCurrentText(QString::fromStdString(cfg.parallel.schedule));
  if (devices_->text() != QString::fromStdString(cfg.parallel.devices) && !devices_->hasFocus())
    devices_->setText(QString::fromStdString(cfg.parallel.devices));
  micro_->setValue(static_cast<int>(cfg.parallel.micro_batches));
  loading_ = false;
  replan();
}

namespace {

QString mib(double bytes) { return QString::number(bytes / 1048576.0, 'f', 2); }

// The memory plan in one line: the largest device peak and the host, or why it does not fit.
QString memoryText(const plan_report& p) {
  double peak = 0, expected = 0;
  for (const auto& d : p.memory.devices) {
    peak = std::max(peak, d.peak_bytes);
    expected = std::max(expected, d.expected_peak_bytes);
  }
  QString text = QObject::tr("<br>Memory plan: largest device peak <b>%1 MiB</b> (expected %2 MiB; checked before anything is "
                             "allocated), host %3 MiB")
                     .arg(peak / 1048576.0, 0, 'f', 1)
                     .arg(expected / 1048576.0, 0, 'f', 1)
                     .arg(p.memory.host_bytes / 1048576.0, 0, 'f', 1);
  if (!p.memory_refusal.empty())
    text += QObject::tr("<br><span style='color:#b00020'><b>Does not fit:</b> %1</span>").arg(QString::fromStdString(p.memory_refusal).toHtmlEscaped());
  return text;
}

// Layers per stage, how they were chosen and the devices' speeds (pipelines only).
QString partitionText(const plan_report& p) {
  const auto& pc = p.partition;
  if (pc.sizes.empty()) return {};
  QStringList sizes, speeds;
  for (int32_t n : pc.sizes) sizes << QString::number(n);
  for (size_t d = 0; d < p.device_speeds.size() && d < p.devices.size(); ++d)
    speeds << QStringLiteral("%1 ×%2").arg(QString::fromStdString(p.devices[d].name)).arg(p.device_speeds[d], 0, 'g', 3);
  QString text = QObject::tr("<br>Layers per stage: <b>%1</b> (%2").arg(sizes.join(QStringLiteral(", ")), QString::fromStdString(pc.how));
  const bool searched = pc.how == "balanced" || pc.backward_how == "balanced";
  const double gain = (1 - pc.step_s / pc.even_step_s) * 100;
  if (pc.backward_how.empty()) {
    if (searched && pc.even_step_s > 0) text += QObject::tr(", %1% faster than even").arg(gain, 0, 'f', 1);
    text += QStringLiteral(")");
  } else {  // round-robin: its backward stages, and the gain over even forward stages with one layer per backward stage
    text += QObject::tr(") · backward stages: <b>%1</b> (%2)")
                .arg(QString::fromStdString(backward_partition_text(pc)), QString::fromStdString(pc.backward_how));
    if (searched && pc.even_step_s > 0) text += QObject::tr(", %1% faster than even forward stages with one layer per backward stage").arg(gain, 0, 'f', 1);
  }
  return text + QObject::tr(" · device speeds %1").arg(speeds.join(QStringLiteral(", ")));
}

// The largest sequence length and micro-batch whose memory plans fit every device.
QString fitText(const result<fit_limits>& f) {
  if (!f) return QObject::tr("<br>Largest fit: %1").arg(QString::fromStdString(f.message()).toHtmlEscaped());
  if (!f->bounded || f->max_seq_len == 0) return QObject::tr("<br>Largest fit: %1").arg(QString::fromStdString(f->note).toHtmlEscaped());
  return QObject::tr("<br>Largest fit with this schedule and partition: sequences up to <b>%1 tokens</b>%2 at %3 per micro-batch; "
                     "up to <b>%4 sequences per micro-batch</b> at this length")
      .arg(f->max_seq_len)
      .arg(f->seq_len_at_model_limit ? QObject::tr(" (the model's context length)") : QString())
      .arg(f->rows_per_micro_batch)
      .arg(f->max_rows_per_micro_batch);
}

// On GPUs without offload.copy_gbps this page (which keeps CUDA out of its process) costs copies as
// free, while `train` costs them at a cached probe or the PCIe estimate: said, so a user compares alike.
QString gpuCopyText(const project_config& cfg) {
  if (cfg.offload.copy_gbps > 0 || cfg.distributed.processes > 1 || !QString::fromStdString(cfg.parallel.devices).startsWith("cuda")) return {};
  return QObject::tr("<br>Copies are costed as free here (offload.copy_gbps is 0); training costs them at a cached probe of "
                     "the GPUs, else at their PCIe links' rate: <tt>lorapipe-cli plan</tt> shows it");
}

// offload.auto's choice (empty when it is off).
QString offloadChoiceText(const plan_report& p) {
  const std::string t = offload_choice_text(p);
  return t.empty() ? QString() : QStringLiteral("<br>") + QString::fromStdString(t).toHtmlEscaped();
}

// Schedule "auto": what the planner weighed, the choice against the runner-up.
QString autoChoiceText(const plan_report& p) {
  if (p.schedule_candidates.empty()) return {};
  int feasible = 0;
  for (const auto& c : p.schedule_candidates) feasible += c.ok ? 1 : 0;
  QString text = QObject::tr("<br>Schedule <b>auto</b>: chosen among %1 candidates (%2 feasible)")
                     .arg(p.schedule_candidates.size())
                     .arg(feasible);
  if (p.schedule_candidates.size() > 1 && p.schedule_candidates[1].ok && p.schedule_candidates[0].step_s > 0) {
    const auto& r = p.schedule_candidates[1];
    text += QObject::tr("; runner-up %1 with %2 micro-batches, %3% slower")
                .arg(QString::fromStdString(r.schedule))
                .arg(r.micro_batches)
                .arg((r.step_s / p.schedule_candidates[0].step_s - 1) * 100, 0, 'f', 1);
  }
  return text;
}

}  // namespace

void PlanPage::replan() {
  // What is on screen no longer describes the project: nothing to keep, no answer to wait for.
  shown_.reset();
  keep_->setEnabled(false);
  if (asking_) {
    ++asked_;
    asking_ = false;
    whatIfAnswer_->hide();
  }
  if (!valid_) {
    summary_->setText(tr("Fix the project's problems (Project page) to see its plan."));
    ++generation_;  // a result still coming for an earlier project is stale
    busy_ = false;
    return;
  }
  busy_ = true;
  const int generation = ++generation_;
  auto cfg = cfg_;
  const double gflops = gflops_->value();
  struct Outcome {
    result<plan_report> plan;
    result<fit_limits> fit;
  };
  const auto work = [cfg, gflops] {
    auto plan = make_plan(cfg, gflops);
    auto fit = plan ? largest_fit(with_plan_choices(cfg, *plan), project_capacity(cfg, nullptr)) : result<fit_limits>(make_error("no plan"));
    return Outcome{std::move(plan), std::move(fit)};
  };
  runAsync(this, work, [this, generation](const Outcome& o) {
    if (generation != generation_) return;  // a newer change is being planned
    busy_ = false;
    ++planned_;
    const auto& r = o.plan;
    if (!r) {
      summary_->setText(tr("No plan: %1").arg(QString::fromStdString(r.message())));
      gantt_->setTimeline(tr("Simulated step"), {}, {}, 0);
      links_->setTable({}, {});
      emit planReady();
      return;
    }
    const auto& p = *r;
    const auto& sim = p.sim;
    const double tokens = static_cast<double>(p.tokens_per_micro_batch) * p.prog.micro_batches;
    summary_->setText(tr("<b>%1</b> on %2 device(s), %3 stages, %4 micro-batches of %5 tokens · predicted step <b>%6 s</b> · "
                         "<b>%7 tokens/s</b> · bubble ratio <b>%8</b> (idle share of device time) · compute: %9")
                          .arg(QString::fromStdString(p.prog.schedule))
                          .arg(p.prog.num_devices())
                          .arg(p.prog.stages.size())
                          .arg(p.prog.micro_batches)
                          .arg(p.tokens_per_micro_batch)
                          .arg(sim.makespan_s, 0, 'g', 4)
                          .arg(sim.makespan_s > 0 ? tokens / sim.makespan_s : 0, 0, 'f', 0)
                          .arg(sim.bubble_ratio, 0, 'f', 3)
                          .arg(QString::fromStdString(p.compute).toHtmlEscaped()) +
                      tr("<br>LM head: loss on labelled positions only, in chunks of %1 rows: working set <b>%2 MiB</b> "
                         "(full logits, softmax and gradient would take %3 MiB per micro-batch)")
                          .arg(p.head_chunk_rows)
                          .arg(mib(static_cast<double>(p.head_working_bytes)))
                          .arg(mib(static_cast<double>(p.full_logits_bytes))) +
                      offloadChoiceText(p) + autoChoiceText(p) + partitionText(p) + memoryText(p) + fitText(o.fit) + gpuCopyText(cfg_));
    shown_ = summarize_plan(cfg_, p);
    shownProfile_ = p.measured;
    const project_config kept = with_plan_choices(cfg_, p);
    keepFields_.clear();
    // offload.auto off first: the plans started while the fields are set search nothing.
    std::vector<std::string> paths;
    if (p.offload_auto.weighed)
      paths = {"offload.auto", "offload.stream_weights", "offload.activations", "offload.recompute", "offload.recompute_granularity"};
    paths.push_back("parallel.schedule");
    if (p.schedule != "single") paths.insert(paths.end(), {"parallel.micro_batches", "parallel.partition", "parallel.backward_partition"});
    for (const auto& path : paths)
      keepFields_.emplace_back(QString::fromStdString(path), QString::fromStdString(project_field_text(kept, path)));
    keep_->setEnabled(p.memory_refusal.empty());
    QStringList rows;
    for (size_t d = 0; d < p.devices.size(); ++d) rows << QString::fromStdString(p.devices[d].name);
    std::vector<GanttBar> bars;
    for (const auto& iv : sim.timeline) {
      const QString text = QString::fromStdString(instr_to_text(iv.in));
      bars.push_back({iv.device, iv.start_s, iv.end_s, text, barKindOf(text)});
    }
    gantt_->setTimeline(tr("Simulated step (compute per device; copies overlap it)"), rows, std::move(bars), sim.makespan_s);
    // The memory plan at each device's peak, by buffer (what the executor checks before it allocates).
    const std::vector<std::pair<QString, QStringList>> groups{
        {tr("frozen weights (arena)"), {"weight arena"}},
        {tr("LoRA, RoPE tables, cuBLAS"), {"LoRA weights", "RoPE tables", "cuBLAS workspaces"}},
        {tr("activations, inputs"), {"activations", "inputs"}},
        {tr("checkpoints"), {"checkpoints"}},
        {tr("autograd graphs"), {"graphs"}},
        {tr("head working set"), {"head"}}};
    std::vector<BarChart::BarSet> sets;
    for (const auto& g : groups) sets.push_back({g.first, {}});
    QStringList cats;
    for (size_t d = 0; d < p.memory.devices.size(); ++d) {
      cats << (d < p.devices.size() ? QString::fromStdString(p.devices[d].name) : QString::number(d));
      for (size_t k = 0; k < groups.size(); ++k) {
        double bytes = 0;
        for (const auto& [name, b] : p.memory.devices[d].held)
          if (groups[k].second.contains(QString::fromStdString(name))) bytes += b;
        sets[k].values.push_back(bytes / 1048576.0);
      }
    }
    const double cap = p.memory_bound_mb > 0 ? p.memory_bound_mb : -1;  // offload.device_memory_mb, or the GPUs'
    memory_->setBars(cats, sets, true, tr("device"), tr("MiB"), cap, tr("capacity %1 MiB").arg(cap, 0, cap >= 100 ? 'f' : 'g', cap >= 100 ? 0 : 3));
    const bool gpus = QString::fromStdString(cfg_.parallel.devices).startsWith("cuda");
    memory_->chart()->setTitle(cap > 0  ? tr("Memory per device at its peak")
                               : gpus ? tr("Memory per device at its peak (no limit set: train fits 90% of free GPU memory)")
                                      : tr("Memory per device at its peak (capacity not limited: offload.device_memory_mb = 0)"));
    std::vector<QStringList> link_rows;
    for (const auto& l : p.links)
      link_rows.push_back({QString::fromStdString(p.devices[l.from].name) + " → " + QString::fromStdString(p.devices[l.to].name),
                           QString::fromStdString(transport_name(l.kind)), QString::fromStdString(l.reason)});
    links_->setTable({tr("Link"), tr("Transport"), tr("Why")}, std::move(link_rows));
    std::vector<std::string> names;
    for (const auto& f : p.devices) names.push_back(f.name);
    memory_->setToolTip(QString::fromStdString(memory_plan_text(p.memory, names) +
                                               (p.memory_refusal.empty() ? std::string() : "\ndoes not fit: " + p.memory_refusal)));
    emit planReady();
  });
}

void PlanPage::askWhatIf(const QString& question) {
  whatIf_->setText(question);
  askWhatIf();
}

void PlanPage::askWhatIf() {
  const std::string question = whatIf_->text().trimmed().toStdString();
  if (question.empty() || !shown_ || asking_) return;
  asking_ = true;
  whatIfAnswer_->show();
  whatIfAnswer_->setText(tr("Planning %1 …").arg(QString::fromStdString(question).toHtmlEscaped()));
  const auto cfg = cfg_;
  const auto base = *shown_;
  const double gflops = gflops_->value();
  const auto profile = shownProfile_;
  const int ask = ++asked_;
  runAsync(this, [cfg, base, question, gflops, profile] { return what_if(cfg, base, question, gflops, nullptr, profile); },
           [this, ask](const what_if_answer& a) {
             if (ask != asked_) return;  // asked of a plan that has changed since
             asking_ = false;
             whatIfAnswer_->setText(QStringLiteral("<pre>%1</pre>").arg(QString::fromStdString(what_if_text(a)).toHtmlEscaped()));
           });
}

void PlanPage::keepPlan() {
  if (!shown_) return;
  const auto fields = keepFields_;  // a slot may replan (and refill it) while they are emitted
  for (const auto& [path, text] : fields) emit fieldEdited(path, text);
}

}  // namespace lorapipe::ui
