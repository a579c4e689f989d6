// Item models over the engine's values. RunTableModel: the run database's runs (one row per run,
// sortable by the raw value of each column through SortRole). TextTableModel: a read-only table of
// strings with headers (transports, config differences, data counts).
#pragma once

#include <vector>

#include <QAbstractTableModel>
#include <QStringList>

#include "core/engine/run_queries.h"

namespace lorapipe::ui {

class RunTableModel : public QAbstractTableModel {
  Q_OBJECT
 public:
  enum Column { Id, Status, Project, Started, Steps, FinalLoss, ValLoss, TokensPerS, Devices, ColumnCount };
  static constexpr int SortRole = Qt::UserRole + 1;
  using QAbstractTableModel::QAbstractTableModel;
  void setRuns(std::vector<run_overview> runs);
  const run_overview* runAt(int row) const;
  int rowOfRun(int64_t id) const;
  int rowCount(const QModelIndex& parent = {}) const override;
  int columnCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  QVariant headerData(int section, Qt::Orientation o, int role = Qt::DisplayRole) const override;

 private:
  std::vector<run_overview> runs_;
  std::vector<QString> status_;  // live status ("crashed" for a running run whose process is gone)
};

class TextTableModel : public QAbstractTableModel {
  Q_OBJECT
 public:
  using QAbstractTableModel::QAbstractTableModel;
  void setTable(QStringList headers, std::vector<QStringList> rows);
  QString text(int row, int column) const;
  int rowCount(const QModelIndex& parent = {}) const override;
  int columnCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  QVariant headerData(int section, Qt::Orientation o, int role = Qt::DisplayRole) const override;

 private:
  QStringList headers_;
  std::vector<QStringList> rows_;
};

}  // namespace lorapipe::ui
