// Plan page: the project's pipeline program as the engine plans it (make_plan, computed off the GUI
// thread whenever the project changes): a Gantt chart per device of the simulated step, bubble
// ratio, predicted step time and tokens/s, per-device memory as stacked bars by buffer kind against
// capacity, and each link's transport with its reason. Schedule, devices and micro-batches can be
// changed here; they are project fields.
#pragma once

#include <QComboBox>
#include <QDoubleSpinBox>
#include <QLabel>
#include <QLineEdit>
#include <QSpinBox>
#include <QWidget>

#include "core/project/project.h"

namespace lorapipe::ui {

class BarChart;
class GanttView;
class TextTableModel;

class PlanPage : public QWidget {
  Q_OBJECT
 public:
  explicit PlanPage(QWidget* parent = nullptr);
  void setProject(const project_config& cfg, bool valid);
  bool busy() const { return busy_; }
  int planned() const { return planned_; }  // plans shown so far
  const GanttView* gantt() const { return gantt_; }
  const TextTableModel* links() const { return links_; }
  QString summary() const { return summary_->text(); }

 signals:
  void fieldEdited(const QString& path, const QVariant& value);
  void planReady();

 private:
  void replan();
  project_config cfg_;
  bool valid_ = false, busy_ = false, loading_ = false;
  int generation_ = 0, planned_ = 0;
  QComboBox* schedule_ = nullptr;
  QLineEdit* devices_ = nullptr;
  QSpinBox* micro_ = nullptr;
  QDoubleSpinBox* gflops_ = nullptr;
  QLabel* summary_ = nullptr;
  GanttView* gantt_ = nullptr;
  BarChart* memory_ = nullptr;
  TextTableModel* links_ = nullptr;
};

}  // namespace lorapipe::ui
