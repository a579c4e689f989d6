// Plan page: the project's pipeline program as the engine plans it (make_plan, computed off the GUI
// thread whenever the project changes): a Gantt chart per device of the simulated step, bubble
// ratio, predicted step time and tokens/s, per-device memory as stacked bars by buffer kind against
// capacity, each link's transport with its reason, and the largest sequence length and micro-batch
// that fit. Schedule, devices and micro-batches can be changed here (they are project fields); a
// what-if box plans a changed project beside this one (plan_questions.h), and "Keep this plan"
// stores the planner's choices (schedule, micro-batches, layers per stage) in the project.
#pragma once

#include <QComboBox>
#include <QDoubleSpinBox>
#include <QLabel>
#include <QLineEdit>
#include <QPushButton>
#include <QSpinBox>
#include <QWidget>

#include <optional>

#include "core/engine/plan_questions.h"
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
  QString whatIfAnswer() const { return whatIfAnswer_->text(); }
  bool askingWhatIf() const { return asking_; }
  void askWhatIf(const QString& question);  // as typed into the what-if box

 signals:
  void fieldEdited(const QString& path, const QVariant& value);
  void planReady();

 private:
  void replan();
  void askWhatIf();
  void keepPlan();
  project_config cfg_;
  bool valid_ = false, busy_ = false, loading_ = false, asking_ = false;
  std::optional<plan_summary> shown_;  // the plan on screen (what-if answers compare with it)
  // Its choices as project fields (path, text), in the order "Keep this plan" sets them.
  std::vector<std::pair<QString, QString>> keepFields_;
  std::shared_ptr<const measured_compute> shownProfile_;  // the layer profile it used, if any
  int generation_ = 0, planned_ = 0, asked_ = 0;
  QComboBox* schedule_ = nullptr;
  QLineEdit* devices_ = nullptr;
  QSpinBox* micro_ = nullptr;
  QDoubleSpinBox* gflops_ = nullptr;
  QLabel* summary_ = nullptr;
  GanttView* gantt_ = nullptr;
  BarChart* memory_ = nullptr;
  TextTableModel* links_ = nullptr;
  QLineEdit* whatIf_ = nullptr;
  QLabel* whatIfAnswer_ = nullptr;
  QPushButton* keep_ = nullptr;
};

}  // namespace lorapipe::ui
