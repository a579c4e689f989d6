// Runs page: the run database as a sortable, filterable table (read off the GUI thread); select two
// or more runs to overlay their loss curves and see their configuration and hardware differences
// (the engine's compare); open a run's folder, resume a crashed or stopped run, delete one.
#pragma once

#include <QComboBox>
#include <QLabel>
#include <QLineEdit>
#include <QPushButton>
#include <QSortFilterProxyModel>
#include <QTableView>
#include <QTimer>
#include <QWidget>

#include "core/engine/run_queries.h"

namespace lorapipe::ui {

class CurveChart;
class RunTableModel;
class TextTableModel;

class RunFilter : public QSortFilterProxyModel {
  Q_OBJECT
 public:
  using QSortFilterProxyModel::QSortFilterProxyModel;
  void setText(const QString& t);
  void setStatus(const QString& s);  // "" = any

 protected:
  bool filterAcceptsRow(int row, const QModelIndex& parent) const override;

 private:
  QString text_, status_;
};

class RunsPage : public QWidget {
  Q_OBJECT
 public:
  explicit RunsPage(QWidget* parent = nullptr);
  void setDatabase(const QString& db);
  QString database() const { return database_; }
  void refresh();
  bool busy() const { return busy_; }
  RunTableModel* runs() const { return model_; }
  RunFilter* filter() const { return filter_; }
  QTableView* table() const { return table_; }
  void selectRuns(const QList<int64_t>& ids);
  QList<int64_t> selectedRuns() const;
  void compareSelected();
  // Deletes off the GUI thread, then refreshes; no confirmation (the button asks first). A refusal
  // (e.g. a live run) shows in the page's status line.
  void deleteRun(int64_t run, bool with_files);
  int deletions() const { return deletions_; }  // finished delete requests
  QString infoText() const { return info_->text(); }
  const TextTableModel* diff() const { return diff_; }
  CurveChart* overlay() const { return overlay_; }
  int comparisons() const { return comparisons_; }

 signals:
  void loaded();
  void showRunRequested(int64_t run);
  void resumeRequested(int64_t run);

 private:
  void updateButtons();
  QString database_;
  bool busy_ = false;
  int generation_ = 0, comparisons_ = 0, deletions_ = 0;
  QTimer live_timer_;  // refreshes the table while a listed run is live
  RunTableModel* model_ = nullptr;
  RunFilter* filter_ = nullptr;
  QTableView* table_ = nullptr;
  QLineEdit* search_ = nullptr;
  QComboBox* status_ = nullptr;
  QLabel* info_ = nullptr;
  QPushButton *show_ = nullptr, *compare_ = nullptr, *open_ = nullptr, *resume_ = nullptr, *delete_ = nullptr;
  CurveChart* overlay_ = nullptr;
  TextTableModel* diff_ = nullptr;
  QTableView* diff_view_ = nullptr;
};

}  // namespace lorapipe::ui
