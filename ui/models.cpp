// Item models: see models.h.
#include "ui/models.h"

#include <QBrush>
#include <QColor>

#include <nlohmann/json.hpp>

namespace lorapipe::ui {

void RunTableModel::setRuns(std::vector<run_overview> runs) {
  beginResetModel();
  runs_ = std::move(runs);
  status_.clear();
  for (const auto& r : runs_) status_.push_back(QString::fromStdString(live_status(r.record)));
  endResetModel();
}

const run_overview* RunTableModel::runAt(int row) const {
  return row >= 0 && row < static_cast<int>(runs_.size()) ? &runs_[row] : nullptr;
}

int RunTableModel::rowOfRun(int64_t id) const {
  for (size_t i = 0; i < runs_.size(); ++i)
    if (runs_[i].record.id == id) return static_cast<int>(i);
  return -1;
}

int RunTableModel::rowCount(const QModelIndex& parent) const { return parent.isValid() ? 0 : static_cast<int>(runs_.size()); }
int RunTableModel::columnCount(const QModelIndex& parent) const { return parent.isValid() ? 0 : ColumnCount; }

namespace {

QString devicesOf(const run_record& r) {
  auto j = nlohmann::json::parse(r.config_json, nullptr, false);
  if (j.is_discarded()) return {};
  const auto par = j.value("parallel", nlohmann::json::object());
  const std::string sched = par.value("schedule", std::string("single"));
  const std::string dev = par.value("devices", std::string("cpu"));
  return sched == "single" ? QString::fromStdString(dev) : QString::fromStdString(dev + " · " + sched);
}

QVariant optional(const std::optional<double>& v, bool display) {
  if (!v) return display ? QVariant(QStringLiteral("–")) : QVariant(-1.0);
  return display ? QVariant(QString::number(*v, 'f', 4)) : QVariant(*v);
}

}  // namespace

QVariant RunTableModel::data(const QModelIndex& index, int role) const {
  if (!index.isValid() || index.row() >= static_cast<int>(runs_.size())) return {};
  const auto& r = runs_[index.row()];
  const bool display = role == Qt::DisplayRole;
  if (role == Qt::ForegroundRole && index.column() == Status) {
    const QString& s = status_[index.row()];
    if (s == "failed" || s == "crashed") return QBrush(QColor(0xb0, 0x20, 0x20));
    if (s == "running") return QBrush(QColor(0x20, 0x70, 0xb0));
    if (s == "completed") return QBrush(QColor(0x20, 0x80, 0x40));
    return {};
  }
  if (role == Qt::ToolTipRole && index.column() == Status && !r.record.error.empty()) return QString::fromStdString(r.record.error);
  if (role == Qt::TextAlignmentRole)
    return index.column() == Id || (index.column() >= Steps && index.column() != Devices) ? QVariant(Qt::AlignRight | Qt::AlignVCenter) : QVariant(Qt::AlignLeft | Qt::AlignVCenter);
  if (role != Qt::DisplayRole && role != SortRole) return {};
  switch (static_cast<Column>(index.column())) {
    case Id: return display ? QVariant(QString::number(r.record.id)) : QVariant(qlonglong(r.record.id));
    case Status: return status_[index.row()];
    case Project: return QString::fromStdString(r.record.project_name);
    case Started: {  // 2026-12-03T16:13:24.537Z -> 2026-12-03 16:13:24
      QString t = QString::fromStdString(r.record.started_at);
      return t.left(19).replace('T', ' ');
    }
    case Steps:
      return display ? QVariant(QStringLiteral("%1 / %2").arg(r.record.last_step).arg(r.record.total_steps)) : QVariant(qlonglong(r.record.last_step));
    case FinalLoss: return optional(r.summary.last_loss, display);
    case ValLoss: return optional(r.summary.final_val, display);
    case TokensPerS:
      return display ? QVariant(QString::number(r.summary.mean_tokens_per_s, 'f', 0)) : QVariant(r.summary.mean_tokens_per_s);
    case Devices: return devicesOf(r.record);
    case ColumnCount: break;
  }
  return {};
}

QVariant RunTableModel::headerData(int section, Qt::Orientation o, int role) const {
  if (o != Qt::Horizontal || role != Qt::DisplayRole) return {};
  static const char* names[] = {"ID", "Status", "Project", "Started (UTC)", "Steps", "Last loss", "Val loss", "Tokens/s", "Devices"};
  return section >= 0 && section < ColumnCount ? tr(names[section]) : QVariant();
}

void TextTableModel::setTable(QStringList headers, std::vector<QStringList> rows) {
  beginResetModel();
  headers_ = std::move(headers);
  rows_ = std::move(rows);
  endResetModel();
}

QString TextTableModel::text(int row, int column) const {
  if (row < 0 || row >= static_cast<int>(rows_.size()) || column < 0 || column >= rows_[row].size()) return {};
  return rows_[row][column];
}

int TextTableModel::rowCount(const QModelIndex& parent) const { return parent.isValid() ? 0 : static_cast<int>(rows_.size()); }
int TextTableModel::columnCount(const QModelIndex& parent) const { return parent.isValid() ? 0 : static_cast<int>(headers_.size()); }

QVariant TextTableModel::data(const QModelIndex& index, int role) const {
  if (!index.isValid() || (role != Qt::DisplayRole && role != Qt::ToolTipRole)) return {};
  return text(index.row(), index.column());
}

QVariant TextTableModel::headerData(int section, Qt::Orientation o, int role) const {
  if (role != Qt::DisplayRole) return {};
  if (o == Qt::Horizontal) return section >= 0 && section < headers_.size() ? headers_[section] : QVariant();
  return QString::number(section + 1);
}

}  // namespace lorapipe::ui
