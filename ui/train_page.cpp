// Train page: see train_page.h.
#include "ui/train_page.h"

#include <algorithm>
#include <cmath>
#include <csignal>

#include <QApplication>
#include <QClipboard>
#include <QGridLayout>
#include <QHBoxLayout>
#include <QSplitter>
#include <QTabWidget>
#include <QVBoxLayout>

#include <nlohmann/json.hpp>

#include "ui/async.h"
#include "ui/charts.h"
#include "ui/gantt_view.h"
#include "ui/run_process.h"

namespace lorapipe::ui {

namespace {

QString duration(double s) {
  if (s < 0 || !std::isfinite(s)) return QStringLiteral("–");
  const qint64 t = static_cast<qint64>(std::llround(s));
  if (t >= 3600) return QStringLiteral("%1 h %2 min").arg(t / 3600).arg((t % 3600) / 60, 2, 10, QChar('0'));
  if (t >= 60) return QStringLiteral("%1 min %2 s").arg(t / 60).arg(t % 60, 2, 10, QChar('0'));
  return QStringLiteral("%1 s").arg(t);
}

std::vector<GanttBar> barsOf(const std::vector<trace_entry>& entries) {
  std::vector<GanttBar> out;
  for (const auto& t : entries) {
    const QString text = QString::fromStdString(t.instr);
    out.push_back({t.device, t.start_s, t.end_s, text, barKindOf(text)});
  }
  return out;
}

}  // namespace

TrainPage::TrainPage(QWidget* parent) : QWidget(parent) {
  process_ = new RunProcess(this);
  connect(process_, &RunProcess::eventReceived, this, &TrainPage::onEvent);
  connect(process_, &RunProcess::logLine, this, [this](const QString& l) { appendLog(l, l.startsWith("error") ? "#b02020" : QString()); });
  connect(process_, &RunProcess::ended, this, &TrainPage::onEnded);
  auto* layout = new QVBoxLayout(this);
  auto* bar = new QHBoxLayout;
  start_ = new QPushButton(QIcon::fromTheme("media-playback-start"), tr("&Start training"));
  start_->setObjectName("startButton");
  stop_ = new QPushButton(QIcon::fromTheme("media-playback-stop"), tr("S&top (checkpoint)"));
  stop_->setObjectName("stopButton");
  resume_ = new QPushButton(tr("&Resume run"));
  resume_->setObjectName("resumeButton");
  copy_ = new QPushButton(tr("&Copy as CLI command"));
  copy_->setObjectName("copyCliButton");
  copy_->setToolTip(tr("The same run from a terminal (same project file, same config hash)"));
  for (auto* b : {start_, stop_, resume_, copy_}) bar->addWidget(b);
  bar->addStretch(1);
  x_axis_ = new QComboBox;
  x_axis_->setObjectName("xAxis");
  x_axis_->addItems({tr("step"), tr("epoch"), tr("tokens"), tr("wall time (s)")});
  log_y_ = new QCheckBox(tr("&Log y"));
  smoothing_ = new QSlider(Qt::Horizontal);
  smoothing_->setRange(0, 99);
  smoothing_->setValue(60);
  smoothing_->setMaximumWidth(120);
  smoothing_->setToolTip(tr("Smoothing of the training loss (moving average)"));
  auto* xl = new QLabel(tr("&X axis"));
  xl->setBuddy(x_axis_);
  auto* sl = new QLabel(tr("S&moothing"));
  sl->setBuddy(smoothing_);
  for (QWidget* w : std::initializer_list<QWidget*>{xl, x_axis_, log_y_, sl, smoothing_}) bar->addWidget(w);
  layout->addLayout(bar);
  auto* state = new QHBoxLayout;
  status_ = new QLabel(tr("No run yet. Start one for this project, or pick a run on the Runs page."));
  status_->setObjectName("runStatus");
  progress_ = new QProgressBar;
  progress_->setObjectName("runProgress");
  progress_->setFormat(tr("step %v of %m"));
  eta_ = new QLabel;
  eta_->setObjectName("runEta");
  state->addWidget(status_, 2);
  state->addWidget(progress_, 2);
  state->addWidget(eta_, 1);
  layout->addLayout(state);
  error_ = new QLabel;
  error_->setObjectName("runError");
  error_->setStyleSheet("color: #b02020; font-weight: bold;");
  error_->setWordWrap(true);
  error_->setTextInteractionFlags(Qt::TextSelectableByMouse);
  error_->hide();
  layout->addWidget(error_);

  auto* split = new QSplitter(Qt::Vertical);
  auto* tabs = new QTabWidget;
  auto* curves = new QWidget;
  auto* grid = new QGridLayout(curves);
  grid->setContentsMargins(0, 0, 0, 0);
  loss_ = new CurveChart(tr("Loss"));
  loss_->setObjectName("lossChart");
  loss_->addCurve(tr("train"), true);
  loss_->addCurve(tr("validation"));
  lr_ = new CurveChart(tr("Learning rate"));
  lr_->addCurve(tr("learning rate"));
  speed_ = new CurveChart(tr("Throughput"));
  speed_->addCurve(tr("tokens/s"));
  memory_ = new CurveChart(tr("Memory"));
  memory_->setObjectName("memoryChart");
  memory_->addCurve(tr("process peak RSS"));
  grid->addWidget(loss_, 0, 0);
  grid->addWidget(lr_, 0, 1);
  grid->addWidget(speed_, 1, 0);
  grid->addWidget(memory_, 1, 1);
  tabs->addTab(curves, tr("C&urves"));
  auto* timeline = new QWidget;
  auto* tl = new QVBoxLayout(timeline);
  measured_ = new GanttView;
  measured_->setObjectName("measuredGantt");
  predicted_ = new GanttView;
  predicted_->setObjectName("predictedGantt");
  measured_->setTimeline(tr("Measured step"), {}, {}, 0);
  predicted_->setTimeline(tr("Predicted step"), {}, {}, 0);
  tl->addWidget(measured_);
  tl->addWidget(predicted_);
  tabs->addTab(timeline, tr("T&imeline (pipelines)"));
  split->addWidget(tabs);
  log_ = new QPlainTextEdit;
  log_->setObjectName("runLog");
  log_->setReadOnly(true);
  log_->setMaximumBlockCount(5000);
  log_->setPlaceholderText(tr("Log of the run: phases, warnings, checkpoints"));
  split->addWidget(log_);
  split->setStretchFactor(0, 4);
  split->setStretchFactor(1, 1);
  layout->addWidget(split, 1);
  connect(start_, &QPushButton::clicked, this, &TrainPage::start);
  connect(stop_, &QPushButton::clicked, this, &TrainPage::stop);
  connect(resume_, &QPushButton::clicked, this, [this] { resumeRun(run_id_); });
  connect(copy_, &QPushButton::clicked, this, [this] {
    const QString cmd = copyCliCommand();
    if (cmd.isEmpty()) return;
    QApplication::clipboard()->setText(cmd);
    appendLog(tr("copied: %1").arg(cmd));
  });
  connect(x_axis_, &QComboBox::currentIndexChanged, this, &TrainPage::replot);
  connect(log_y_, &QCheckBox::toggled, this, [this](bool on) {
    loss_->setLogY(on);
  });
  connect(smoothing_, &QSlider::valueChanged, this, [this](int v) { loss_->setSmoothing(v / 100.0); });
  db_timer_.setInterval(2000);
  connect(&db_timer_, &QTimer::timeout, this, &TrainPage::pollDatabase);
  setRunning(false);
}

QStringList TrainPage::trainArguments(const QString& project_file) const { return {"train", project_file}; }

QString TrainPage::copyCliCommand() const {
  const QString program = cliProgram().isEmpty() ? QStringLiteral("lorapipe-cli") : cliProgram();
  if (!last_args_.isEmpty()) return shellCommand(program, last_args_);  // the launch on screen
  if (project_file_.isEmpty()) return {};
  return shellCommand(program, trainArguments(project_file_));
}

void TrainPage::setRunning(bool running) {
  start_->setEnabled(!running);
  stop_->setEnabled(running);
  resume_->setEnabled(!running && run_id_ > 0 && resumable_);
}

bool TrainPage::isLive() const { return process_->isRunning() || following_db_; }

void TrainPage::appendLog(const QString& line, const QString& color) {
  if (color.isEmpty()) log_->appendPlainText(line);
  else log_->appendHtml(QStringLiteral("<span style=\"color:%1\">%2</span>").arg(color, line.toHtmlEscaped()));
}

void TrainPage::showError(const QString& text) {
  error_->setText(text);
  error_->setVisible(!text.isEmpty());
}

// Everything shown of the previous run goes (a new run, a resumed one, another run shown).
void TrainPage::resetCharts() {
  ++request_;  // a database read still coming is for what was shown before
  points_.clear();
  val_.clear();
  wall_offset_ = last_wall_ = 0;
  device_curves_ = 0;
  memory_->removeAllCurves();
  memory_->addCurve(tr("process peak RSS"));
  progress_->setValue(0);
  eta_->clear();
  replot();
}

bool TrainPage::start() {
  if (isLive()) return false;
  QString why;
  const QString file = save_project_ ? save_project_(&why) : QString();
  if (file.isEmpty()) {
    showError(why);
    return false;
  }
  project_file_ = file;
  resetCharts();
  run_id_ = 0;
  last_args_ = trainArguments(file);
  if (!process_->start(QStringList(last_args_) << "--json", &why)) {
    showError(why);
    return false;
  }
  log_->clear();
  appendLog(tr("$ %1").arg(copyCliCommand()));
  status_->setText(tr("Starting (process %1)…").arg(process_->pid()));
  setRunning(true);
  return true;
}

void TrainPage::stop() {
  if (process_->isRunning()) process_->stop();
  else if (following_db_ && followed_pid_ > 0) ::kill(static_cast<pid_t>(followed_pid_), SIGTERM);
  else return;
  status_->setText(tr("Stopping: writing a checkpoint…"));
  stop_->setEnabled(false);
}

bool TrainPage::resumeRun(int64_t run) {
  if (isLive() || run <= 0) return false;
  showError({});
  QString why;
  QStringList args = {"resume", QString::number(run)};
  if (!database_.isEmpty()) args << "--db" << database_;
  last_args_ = args;
  args << "--json";
  run_id_ = run;
  // The curves so far come from the database; the resumed process appends to them.
  resetCharts();
  if (!process_->start(args, &why)) {
    showError(why);
    return false;
  }
  appendLog(tr("$ %1").arg(copyCliCommand()));
  status_->setText(tr("Resuming run %1…").arg(run));
  setRunning(true);
  return true;
}

double TrainPage::xOf(int64_t step, double wall) const {
  switch (x_axis_->currentIndex()) {
    case 1: return train_tokens_ > 0 ? static_cast<double>(step) * tokens_per_step_ / train_tokens_ : step;
    case 2: return static_cast<double>(step) * tokens_per_step_;
    case 3: return wall;
    default: return static_cast<double>(step);
  }
}

void TrainPage::addPoint(const Point& p, bool live) {
  // A resumed run re-reports steps after its checkpoint: the lost tail is replaced.
  bool rewound = false;
  while (!points_.empty() && points_.back().step >= p.step) points_.pop_back(), rewound = true;
  if (live && !points_.empty() && p.step > 0 && p.wall + wall_offset_ < points_.back().wall) wall_offset_ = points_.back().wall;
  Point q = p;
  if (live) q.wall += wall_offset_;
  points_.push_back(q);
  if (!live) return;
  if (rewound) {
    replot();
    return;
  }
  const double x = xOf(q.step, q.wall);
  loss_->append(0, {x, q.loss});
  lr_->append(0, {x, q.lr});
  speed_->append(0, {x, q.tps});
  memory_->append(0, {x, q.rss / 1048576.0});
  while (device_curves_ < static_cast<int64_t>(q.devices.size()))
    memory_->addCurve(tr("device %1 arena peak").arg(device_curves_++));
  for (size_t d = 0; d < q.devices.size(); ++d) memory_->append(1 + static_cast<int>(d), {x, q.devices[d] / 1048576.0});
}

void TrainPage::addVal(int64_t step, double loss, bool live) {
  bool rewound = false;
  while (!val_.empty() && val_.back().first >= step) val_.pop_back(), rewound = true;
  val_.emplace_back(step, loss);
  if (!live) return;
  if (rewound) {  // a resumed run validates again at a step already shown
    replot();
    return;
  }
  double wall = points_.empty() ? 0 : points_.back().wall;
  loss_->append(1, {xOf(step, wall), loss});
}

void TrainPage::replot() {
  const QString x_title = x_axis_->currentText();
  std::vector<QPointF> loss, lr, tps, rss;
  std::vector<std::vector<QPointF>> dev;
  for (const auto& p : points_) {
    const double x = xOf(p.step, p.wall);
    loss.emplace_back(x, p.loss), lr.emplace_back(x, p.lr), tps.emplace_back(x, p.tps), rss.emplace_back(x, p.rss / 1048576.0);
    if (dev.size() < p.devices.size()) dev.resize(p.devices.size());
    for (size_t d = 0; d < p.devices.size(); ++d) dev[d].emplace_back(x, p.devices[d] / 1048576.0);
  }
  std::vector<QPointF> val;
  for (const auto& [step, v] : val_) {
    auto it = std::lower_bound(points_.begin(), points_.end(), step, [](const Point& p, int64_t s) { return p.step < s; });
    val.emplace_back(xOf(step, it == points_.end() ? (points_.empty() ? 0 : points_.back().wall) : it->wall), v);
  }
  loss_->setCurve(0, std::move(loss));
  loss_->setCurve(1, std::move(val));
  lr_->setCurve(0, std::move(lr));
  speed_->setCurve(0, std::move(tps));
  memory_->setCurve(0, std::move(rss));
  if (device_curves_ > static_cast<int64_t>(dev.size())) {  // fewer devices than the run shown before
    memory_->removeAllCurves();
    memory_->addCurve(tr("process peak RSS"));
    device_curves_ = 0;
  }
  while (device_curves_ < static_cast<int64_t>(dev.size())) memory_->addCurve(tr("device %1 arena peak").arg(device_curves_++));
  for (size_t d = 0; d < dev.size(); ++d) memory_->setCurve(1 + static_cast<int>(d), std::move(dev[d]));
  loss_->setAxisTitles(x_title, tr("loss (nats/token)"));
  lr_->setAxisTitles(x_title, tr("learning rate"));
  speed_->setAxisTitles(x_title, tr("tokens/s"));
  memory_->setAxisTitles(x_title, tr("MiB"));
}

void TrainPage::onEvent(const engine_event& ev) {
  std::visit(
      [this](const auto& e) {
        using T = std::decay_t<decltype(e)>;
        if constexpr (std::is_same_v<T, run_started_event>) {
          run_id_ = e.run_id, total_steps_ = e.total_steps, start_step_ = e.start_step, tokens_per_step_ = e.tokens_per_step;
          auto cfg = nlohmann::json::parse(e.config_json.empty() ? "{}" : e.config_json, nullptr, false);
          const int64_t seq = cfg.is_object() ? cfg.value("data", nlohmann::json::object()).value("seq_len", int64_t{0}) : 0;
          train_tokens_ = e.train_sequences * seq;
          if (!e.database.empty()) database_ = QString::fromStdString(e.database);
          progress_->setRange(0, static_cast<int>(e.total_steps));
          progress_->setValue(static_cast<int>(e.start_step));
          status_->setText(tr("Run %1: %2 on %3 · %4 LoRA parameters").arg(e.run_id).arg(QString::fromStdString(e.model))
                               .arg(QStringList([&] {
                                      QStringList d;
                                      for (const auto& s : e.devices) d << QString::fromStdString(s);
                                      return d;
                                    }()).join(", "))
                               .arg(e.lora_parameters));
          if (e.start_step > 0 && !database_.isEmpty()) {  // resumed: the curve so far from the database
            const auto db = database_.toStdString();
            const int64_t run = e.run_id, start = e.start_step;
            runAsync(this, [db, run] { return show_run(db, run); }, [this, run, start](const result<run_details>& d) {
              if (d && run == run_id_) loadHistory(*d, start);
            });
          }
          emit runChanged(e.run_id, "running");
        } else if constexpr (std::is_same_v<T, step_event>) {
          addPoint({e.step, e.elapsed_s, e.loss, e.lr, e.tokens_per_s, e.process_peak_rss, e.device_peak_bytes}, true);
          progress_->setMaximum(static_cast<int>(e.total_steps));
          progress_->setValue(static_cast<int>(e.step));
          const double per_step = e.step > e.start_step ? e.elapsed_s / static_cast<double>(e.step - e.start_step) : -1;
          eta_->setText(tr("ETA %1 · %2 tokens/s").arg(duration(per_step * (e.total_steps - e.step))).arg(e.tokens_per_s, 0, 'f', 0));
        } else if constexpr (std::is_same_v<T, eval_event>) {
          addVal(e.step, e.val_loss, true);
          appendLog(tr("step %1: validation loss %2").arg(e.step).arg(e.val_loss, 0, 'f', 4));
        } else if constexpr (std::is_same_v<T, checkpoint_event>) {
          appendLog(tr("checkpoint at step %1: %2 (%3 MiB)").arg(e.step).arg(QString::fromStdString(e.path)).arg(e.bytes / 1048576.0, 0, 'f', 1));
        } else if constexpr (std::is_same_v<T, sample_event>) {
          appendLog(tr("sample %1 training: %2%3").arg(QString::fromStdString(e.when), QString::fromStdString(e.prompt), QString::fromStdString(e.text)));
        } else if constexpr (std::is_same_v<T, log_event>) {
          const char* color = e.lvl == log_event::level::error ? "#b02020" : e.lvl == log_event::level::warning ? "#a06000" : nullptr;
          const char* prefix = e.lvl == log_event::level::error ? "error: " : e.lvl == log_event::level::warning ? "warning: " : "";
          appendLog(QString::fromLatin1(prefix) + QString::fromStdString(e.message), color ? QString::fromLatin1(color) : QString());
        } else if constexpr (std::is_same_v<T, phase_event>) {
          QString text = tr("%1").arg(QString::fromLatin1(phase_name(e.what)).replace('_', ' '));
          if (e.total > 0) text += QStringLiteral(" %1/%2").arg(e.done).arg(e.total);
          eta_->setText(text);
        } else if constexpr (std::is_same_v<T, plan_event>) {
          appendLog(tr("pipeline: %1, %2 micro-batches, %3 stages, simulated bubble ratio %4")
                        .arg(QString::fromStdString(e.schedule)).arg(e.micro_batches).arg(e.stages.size()).arg(e.bubble_ratio, 0, 'f', 3));
          for (const auto& l : e.links)
            appendLog(tr("  link %1 → %2: %3 (%4)").arg(l.from).arg(l.to).arg(QString::fromStdString(l.kind), QString::fromStdString(l.reason)));
        } else if constexpr (std::is_same_v<T, trace_event>) {
          QStringList rows;
          int n = 0;
          for (const auto& t : e.measured) n = std::max(n, t.device + 1);
          for (int d = 0; d < n; ++d) rows << tr("device %1").arg(d);
          const double span = std::max(e.measured_step_s, e.predicted_step_s);
          measured_->setTimeline(tr("Measured step %1: %2 s").arg(e.step).arg(e.measured_step_s, 0, 'g', 4), rows, barsOf(e.measured), span);
          predicted_->setTimeline(tr("Predicted (calibrated simulator): %1 s").arg(e.predicted_step_s, 0, 'g', 4), rows, barsOf(e.predicted), span);
        } else if constexpr (std::is_same_v<T, run_finished_event>) {
          // A stopped run skips the final validation (0 = not measured).
          const QString val = e.final_val_loss > 0 ? tr("final validation loss %1").arg(e.final_val_loss, 0, 'f', 4) : tr("no final validation");
          status_->setText(tr("Run %1 %2 after %3 steps · %4 · %5 tokens/s")
                               .arg(run_id_).arg(QString::fromStdString(e.status)).arg(e.steps).arg(val)
                               .arg(e.mean_tokens_per_s, 0, 'f', 0));
          if (e.status == "failed") showError(tr("Run %1 failed: %2").arg(run_id_).arg(QString::fromStdString(e.error)));
          resumable_ = e.status != "completed";
          eta_->clear();
        }
      },
      ev);
}

void TrainPage::onEnded(const QString& error) {
  if (!error.isEmpty()) resumable_ = run_id_ > 0;  // crashed: its last checkpoint may continue it
  setRunning(false);
  if (!error.isEmpty()) {
    showError(error);
    status_->setText(run_id_ > 0 && !last_args_.isEmpty() ? tr("Run %1 failed").arg(run_id_) : tr("The run failed"));
    appendLog(error, "#b02020");
  }
  emit runChanged(run_id_, error.isEmpty() ? QStringLiteral("ended") : QStringLiteral("failed"));
}

// The curves of a recorded run from the database. With keep_after >= 0 (a resumed run whose live
// events already arrive), the database gives the steps up to keep_after and the live points after
// it are kept: the recorder writes in batches, so the database may not have them yet.
void TrainPage::loadHistory(const run_details& d, int64_t keep_after) {
  std::vector<Point> live;
  std::vector<std::pair<int64_t, double>> live_val;
  if (keep_after >= 0) {
    for (const auto& p : points_)
      if (p.step > keep_after) live.push_back(p);
    for (const auto& v : val_)
      if (v.first > keep_after) live_val.push_back(v);
  }
  points_.clear();
  val_.clear();
  double offset = 0, last = 0;
  for (const auto& m : d.metrics) {
    if (keep_after >= 0 && m.step > keep_after) break;
    auto mem = nlohmann::json::parse(m.memory_json.empty() ? "{}" : m.memory_json, nullptr, false);
    Point p{m.step, m.elapsed_s, m.loss, m.lr, m.tokens_per_s, 0, {}};
    if (mem.is_object()) {
      p.rss = mem.value("process_rss", int64_t{0});
      p.devices = mem.value("devices", std::vector<int64_t>{});
    }
    if (p.wall + offset < last) offset = last;  // elapsed restarts in a resumed process
    p.wall += offset;
    last = p.wall;
    points_.push_back(std::move(p));
  }
  for (const auto& e : d.evaluations)
    if (e.split == "val" && (keep_after < 0 || e.step <= keep_after)) val_.emplace_back(e.step, e.loss);
  // The live points (elapsed since their process started, plus the offset they were drawn with)
  // continue the wall clock of the history.
  for (auto& p : live) {
    p.wall = p.wall - wall_offset_ + last;
    points_.push_back(p);
  }
  wall_offset_ = last;
  val_.insert(val_.end(), live_val.begin(), live_val.end());
  auto cfg = nlohmann::json::parse(d.record.config_json, nullptr, false);
  if (cfg.is_object()) {
    const auto run = cfg.value("run", nlohmann::json::object());
    const auto data = cfg.value("data", nlohmann::json::object());
    tokens_per_step_ = run.value("batch_size", int64_t{1}) * run.value("grad_accum", int64_t{1}) * data.value("seq_len", int64_t{1});
  }
  total_steps_ = d.record.total_steps;
  progress_->setRange(0, static_cast<int>(d.record.total_steps));
  progress_->setValue(static_cast<int>(std::max<int64_t>(d.record.last_step, points_.empty() ? 0 : points_.back().step)));
  replot();
}

void TrainPage::showRun(int64_t run) {
  if (isLive()) return;  // the live run stays on screen
  const auto db = database_.toStdString();
  const int request = ++request_;
  runAsync(this, [db, run] { return show_run(db, run); }, [this, run, request](const result<run_details>& d) {
    if (request != request_ || isLive()) return;  // something else was started or shown meanwhile
    if (!d) {
      showError(QString::fromStdString(d.message()));
      return;
    }
    resetCharts();
    run_id_ = run;
    last_args_.clear();
    showError({});
    loadHistory(*d);
    const std::string st = live_status(d->record);
    resumable_ = st == "stopped" || st == "crashed" || st == "failed";
    status_->setText(tr("Run %1 (%2): %3 · %4 of %5 steps").arg(run).arg(QString::fromStdString(d->record.project_name))
                         .arg(QString::fromStdString(st)).arg(d->record.last_step).arg(d->record.total_steps));
    if (!d->record.error.empty()) showError(QString::fromStdString(d->record.error));
    log_->clear();
    for (const auto& ev : d->events)
      appendLog(QStringLiteral("%1  %2").arg(QString::fromStdString(ev.at), QString::fromStdString(ev.message)),
                ev.level == "error" ? "#b02020" : ev.level == "warning" ? "#a06000" : QString());
    for (const auto& c : d->checkpoints)
      appendLog(tr("checkpoint at step %1: %2").arg(c.step).arg(QString::fromStdString(c.path)));
    const bool alive_here = process_liveness(d->record.process()) == liveness::alive;
    if (st == "running" && alive_here && process_->attach(d->record.pid)) {
      // Started by an earlier window: its event stream from the start (the curves rebuild from it).
      resetCharts();
      run_id_ = run;
      status_->setText(tr("Following live run %1 (process %2)").arg(run).arg(d->record.pid));
      setRunning(true);
    } else if (st == "running") {  // started from a terminal, or on another machine: the database
      following_db_ = true;
      followed_pid_ = alive_here ? d->record.pid : 0;  // never signal a pid of another host
      db_timer_.start();
      status_->setText(tr("Following live run %1 from the database (process %2)").arg(run).arg(d->record.pid));
      setRunning(true);
    } else {
      setRunning(false);
    }
  });
}

void TrainPage::pollDatabase() {
  if (polling_) return;  // the previous read is still running
  polling_ = true;
  const auto db = database_.toStdString();
  const int64_t run = run_id_;
  runAsync(this, [db, run] { return show_run(db, run); }, [this, run](const result<run_details>& d) {
    polling_ = false;
    if (!d || run != run_id_ || !following_db_) return;
    loadHistory(*d);
    const std::string st = live_status(d->record);
    if (st != "running") {
      resumable_ = st == "stopped" || st == "crashed" || st == "failed";
      following_db_ = false;
      db_timer_.stop();
      status_->setText(tr("Run %1 %2 at step %3").arg(run).arg(QString::fromStdString(st)).arg(d->record.last_step));
      setRunning(false);
      emit runChanged(run, QString::fromStdString(st));
    }
  });
}

}  // namespace lorapipe::ui
