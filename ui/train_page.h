// Train page: start / stop (with a checkpoint) / resume a run, which runs in its own process
// (RunProcess); live charts of training and validation loss, learning rate, tokens/s and memory per
// device against step, epoch, tokens or wall time; progress and ETA; the last traced step's measured
// per-device timeline beside the simulator's prediction; a log panel. A run recorded in the database
// (finished, or live in another process) can be shown and followed.
#pragma once

#include <optional>
#include <vector>

#include <QCheckBox>
#include <QComboBox>
#include <QLabel>
#include <QPlainTextEdit>
#include <QProgressBar>
#include <QPushButton>
#include <QSlider>
#include <QTimer>
#include <QWidget>
#include <functional>

#include "core/base/events.h"
#include "core/engine/run_queries.h"

namespace lorapipe::ui {

class CurveChart;
class GanttView;
class RunProcess;

class TrainPage : public QWidget {
  Q_OBJECT
 public:
  explicit TrainPage(QWidget* parent = nullptr);
  // Saves the project and returns its file, or "" with *why set (problems, cancelled); set by the main window.
  void setProjectSaver(std::function<QString(QString* why)> saver) { save_project_ = std::move(saver); }
  void setDatabase(const QString& db) { database_ = db; }
  void setProjectFile(const QString& file) { project_file_ = file; }
  QStringList trainArguments(const QString& project_file) const;
  bool start();
  void stop();
  bool resumeRun(int64_t run);
  // Shows a recorded run; a live one (its process on this machine) is followed.
  void showRun(int64_t run);
  bool isLive() const;
  int64_t runId() const { return run_id_; }
  QString statusText() const { return status_->text(); }
  QString errorText() const { return error_->isHidden() ? QString() : error_->text(); }
  RunProcess* process() const { return process_; }
  CurveChart* lossChart() const { return loss_; }
  const GanttView* measuredTimeline() const { return measured_; }
  int stepPoints() const { return static_cast<int>(points_.size()); }
  QString copyCliCommand() const;

 signals:
  void runChanged(int64_t run, const QString& status);  // started, finished, failed: refresh the run list

 private:
  struct Point {
    int64_t step = 0;
    double wall = 0, loss = 0, lr = 0, tps = 0;
    int64_t rss = 0;
    std::vector<int64_t> devices;
  };
  void onEvent(const engine_event& e);
  void onEnded(const QString& error);
  void appendLog(const QString& line, const QString& color = {});
  void addPoint(const Point& p, bool live);
  void addVal(int64_t step, double loss, bool live);
  void replot();
  double xOf(int64_t step, double wall) const;
  void resetCharts();
  void setRunning(bool running);
  void loadHistory(const run_details& d, int64_t keep_after = -1);
  void pollDatabase();
  void showError(const QString& text);

  std::function<QString(QString*)> save_project_;
  QString database_, project_file_;
  QStringList last_args_;  // of the run started from this page (copy as CLI command)
  RunProcess* process_ = nullptr;
  int64_t run_id_ = 0, total_steps_ = 0, start_step_ = 0, tokens_per_step_ = 0, train_tokens_ = 0, device_curves_ = 0;
  double wall_offset_ = 0, last_wall_ = 0;
  std::vector<Point> points_;
  std::vector<std::pair<int64_t, double>> val_;
  bool following_db_ = false, polling_ = false, resumable_ = false;
  int request_ = 0;  // the latest database read whose result may still be shown
  qint64 followed_pid_ = 0;
  QTimer db_timer_;
  QPushButton *start_ = nullptr, *stop_ = nullptr, *resume_ = nullptr, *copy_ = nullptr;
  QComboBox* x_axis_ = nullptr;
  QCheckBox* log_y_ = nullptr;
  QSlider* smoothing_ = nullptr;
  QLabel *status_ = nullptr, *eta_ = nullptr, *error_ = nullptr;
  QProgressBar* progress_ = nullptr;
  CurveChart *loss_ = nullptr, *lr_ = nullptr, *speed_ = nullptr, *memory_ = nullptr;
  GanttView *measured_ = nullptr, *predicted_ = nullptr;
  QPlainTextEdit* log_ = nullptr;
};

}  // namespace lorapipe::ui
