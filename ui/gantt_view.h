// A per-device timeline (Gantt chart) of a pipeline step: one row per device, one bar per
// instruction, coloured by kind (forward, backward, recompute, copies, optimizer), idle time as the
// hatched background, a time axis in seconds and a legend. Used for the simulated program (Plan) and
// for the measured step next to the prediction (Train).
#pragma once

#include <vector>

#include <QString>
#include <QStringList>
#include <QWidget>

namespace lorapipe::ui {

enum class BarKind { Forward, Backward, Recompute, Copy, Optimizer, Other };
// The kind of an instruction from its text form ("2F0", "1SEND_F3@0", "0PW", ...).
BarKind barKindOf(const QString& instr);

struct GanttBar {
  int row = 0;
  double start = 0, end = 0;  // seconds
  QString label;
  BarKind kind = BarKind::Other;
};

class GanttView : public QWidget {
  Q_OBJECT
 public:
  explicit GanttView(QWidget* parent = nullptr);
  void setTimeline(const QString& title, const QStringList& rows, std::vector<GanttBar> bars, double span_s);
  const std::vector<GanttBar>& bars() const { return bars_; }
  int rowCount() const { return static_cast<int>(rows_.size()); }
  QSize sizeHint() const override;

 protected:
  void paintEvent(QPaintEvent*) override;

 private:
  QString title_;
  QStringList rows_;
  std::vector<GanttBar> bars_;
  double span_ = 0;
};

}  // namespace lorapipe::ui
