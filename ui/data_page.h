// Data page: the engine's data report of the project (inspect_data, computed off the GUI thread):
// counts, token-length histogram, truncation and skips, and rendered examples with the trained
// tokens highlighted against the masked ones.
#pragma once

#include <QLabel>
#include <QTextBrowser>
#include <QWidget>

#include "core/project/project.h"

namespace lorapipe::ui {

class BarChart;
class TextTableModel;

class DataPage : public QWidget {
  Q_OBJECT
 public:
  explicit DataPage(QWidget* parent = nullptr);
  void setProject(const project_config& cfg, bool valid);
  void refresh();
  bool busy() const { return busy_; }
  const TextTableModel* counts() const { return counts_; }
  QString examplesHtml() const { return examples_->toHtml(); }
  int histogramBars() const;
  int64_t histogramTotal() const { return histogram_total_; }  // examples counted in the histogram

 signals:
  void reportReady();

 private:
  project_config cfg_;
  bool valid_ = false, busy_ = false, stale_ = true;
  int64_t histogram_total_ = 0;
  int generation_ = 0;
  QLabel* status_ = nullptr;
  TextTableModel* counts_ = nullptr;
  BarChart* histogram_ = nullptr;
  QTextBrowser* examples_ = nullptr;

 protected:
  void showEvent(QShowEvent* e) override;
};

}  // namespace lorapipe::ui
