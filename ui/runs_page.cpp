// Runs page: see runs_page.h.
#include "ui/runs_page.h"

#include <QCheckBox>
#include <QDesktopServices>
#include <QHBoxLayout>
#include <QHeaderView>
#include <QMessageBox>
#include <QPushButton>
#include <QSplitter>
#include <QUrl>
#include <QVBoxLayout>

#include <nlohmann/json.hpp>

#include "ui/async.h"
#include "ui/charts.h"
#include "ui/models.h"

namespace lorapipe::ui {

void RunFilter::setText(const QString& t) {
  text_ = t.trimmed();
  invalidateFilter();
}

void RunFilter::setStatus(const QString& s) {
  status_ = s;
  invalidateFilter();
}

bool RunFilter::filterAcceptsRow(int row, const QModelIndex& parent) const {
  const auto* m = sourceModel();
  auto cell = [&](int col) { return m->index(row, col, parent).data().toString(); };
  if (!status_.isEmpty() && cell(RunTableModel::Status) != status_) return false;
  if (text_.isEmpty()) return true;
  for (int c : {RunTableModel::Id, RunTableModel::Project, RunTableModel::Status, RunTableModel::Devices, RunTableModel::Started})
    if (cell(c).contains(text_, Qt::CaseInsensitive)) return true;
  return false;
}

RunsPage::RunsPage(QWidget* parent) : QWidget(parent) {
  auto* layout = new QVBoxLayout(this);
  auto* bar = new QHBoxLayout;
  search_ = new QLineEdit;
  search_->setObjectName("runSearch");
  search_->setPlaceholderText(tr("Filter by id, project, devices or date"));
  search_->setClearButtonEnabled(true);
  status_ = new QComboBox;
  status_->setObjectName("runStatusFilter");
  status_->addItem(tr("any status"), QString());
  for (const char* s : {"running", "completed", "stopped", "failed", "crashed"}) status_->addItem(tr(s), QString::fromLatin1(s));
  auto* refresh = new QPushButton(QIcon::fromTheme("view-refresh"), tr("Re&fresh"));
  show_ = new QPushButton(tr("S&how in Train"));
  compare_ = new QPushButton(tr("&Compare selected"));
  compare_->setObjectName("compareButton");
  open_ = new QPushButton(QIcon::fromTheme("folder-open"), tr("&Open folder"));
  resume_ = new QPushButton(tr("&Resume"));
  resume_->setObjectName("runsResumeButton");
  delete_ = new QPushButton(QIcon::fromTheme("edit-delete"), tr("&Delete…"));
  delete_->setObjectName("deleteButton");
  bar->addWidget(search_, 1);
  bar->addWidget(status_);
  for (auto* b : {refresh, show_, compare_, open_, resume_, delete_}) bar->addWidget(b);
  layout->addLayout(bar);
  info_ = new QLabel;
  info_->setObjectName("runsInfo");
  layout->addWidget(info_);
  auto* split = new QSplitter(Qt::Vertical);
  model_ = new RunTableModel(this);
  filter_ = new RunFilter(this);
  filter_->setSourceModel(model_);
  filter_->setSortRole(RunTableModel::SortRole);
  table_ = new QTableView;
  table_->setObjectName("runsTable");
  table_->setModel(filter_);
  table_->setSortingEnabled(true);
  table_->sortByColumn(RunTableModel::Id, Qt::DescendingOrder);
  table_->setSelectionBehavior(QAbstractItemView::SelectRows);
  table_->setSelectionMode(QAbstractItemView::ExtendedSelection);
  table_->verticalHeader()->hide();
  table_->horizontalHeader()->setSectionResizeMode(QHeaderView::ResizeToContents);
  table_->horizontalHeader()->setStretchLastSection(true);
  table_->setAlternatingRowColors(true);
  split->addWidget(table_);
  auto* compare = new QWidget;
  auto* ch = new QHBoxLayout(compare);
  ch->setContentsMargins(0, 0, 0, 0);
  overlay_ = new CurveChart(tr("Training loss of the selected runs"));
  overlay_->setObjectName("overlayChart");
  overlay_->setAxisTitles(tr("step"), tr("loss (nats/token)"));
  ch->addWidget(overlay_, 1);
  diff_ = new TextTableModel(this);
  diff_->setTable({tr("Difference")}, {{tr("Select two or more runs and press Compare: their loss curves, then what differs "
                                          "in configuration, hardware and results.")}});
  auto* diff_view = diff_view_ = new QTableView;
  diff_view->setObjectName("diffTable");
  diff_view->setModel(diff_);
  diff_view->verticalHeader()->hide();
  diff_view->horizontalHeader()->setSectionResizeMode(QHeaderView::Stretch);
  diff_view->setWordWrap(true);
  ch->addWidget(diff_view, 1);
  split->addWidget(compare);
  split->setStretchFactor(0, 1);
  split->setStretchFactor(1, 1);
  layout->addWidget(split, 1);
  live_timer_.setInterval(3000);
  connect(&live_timer_, &QTimer::timeout, this, [this] {
    if (isVisible() && !busy_) this->refresh();
  });
  connect(search_, &QLineEdit::textChanged, filter_, &RunFilter::setText);
  connect(status_, &QComboBox::currentIndexChanged, this, [this] { filter_->setStatus(status_->currentData().toString()); });
  connect(refresh, &QPushButton::clicked, this, &RunsPage::refresh);
  connect(table_->selectionModel(), &QItemSelectionModel::selectionChanged, this, &RunsPage::updateButtons);
  connect(table_, &QTableView::doubleClicked, this, [this] {
    if (auto ids = selectedRuns(); !ids.isEmpty()) emit showRunRequested(ids.front());
  });
  connect(show_, &QPushButton::clicked, this, [this] {
    if (auto ids = selectedRuns(); !ids.isEmpty()) emit showRunRequested(ids.front());
  });
  connect(compare_, &QPushButton::clicked, this, &RunsPage::compareSelected);
  connect(open_, &QPushButton::clicked, this, [this] {
    const auto ids = selectedRuns();
    const int row = ids.isEmpty() ? -1 : model_->rowOfRun(ids.front());
    if (const auto* r = model_->runAt(row)) QDesktopServices::openUrl(QUrl::fromLocalFile(QString::fromStdString(r->record.output_dir)));
  });
  connect(resume_, &QPushButton::clicked, this, [this] {
    if (auto ids = selectedRuns(); !ids.isEmpty()) emit resumeRequested(ids.front());
  });
  connect(delete_, &QPushButton::clicked, this, [this] {
    const auto ids = selectedRuns();
    if (ids.isEmpty()) return;
    QMessageBox box(QMessageBox::Warning, tr("Delete run %1").arg(ids.front()),
                    tr("Delete run %1 from the run database? Its adapter folder is kept.").arg(ids.front()),
                    QMessageBox::Yes | QMessageBox::Cancel, this);
    auto* files = new QCheckBox(tr("Also delete its checkpoints"));
    box.setCheckBox(files);
    if (box.exec() == QMessageBox::Yes) deleteRun(ids.front(), files->isChecked());
  });
  updateButtons();
}

void RunsPage::setDatabase(const QString& db) {
  if (db == database_) return;
  database_ = db;
  refresh();
}

void RunsPage::refresh() {
  busy_ = true;
  const int generation = ++generation_;
  const auto db = database_.toStdString();
  info_->setText(tr("Reading %1…").arg(database_));
  runAsync(this, [db] { return list_runs(db, 10000); }, [this, generation](const result<std::vector<run_overview>>& r) {
    if (generation != generation_) return;
    busy_ = false;
    if (!r) {
      info_->setText(tr("Cannot read the run database: %1").arg(QString::fromStdString(r.message())));
      emit loaded();
      return;
    }
    const auto keep = selectedRuns();
    const bool refused = info_->text().contains(tr("was not deleted"));
    model_->setRuns(*r);
    if (!refused) info_->setText(tr("%1 run(s) in %2").arg(r->size()).arg(database_));
    bool live = false;
    for (int row = 0; row < model_->rowCount(); ++row)
      live |= model_->index(row, RunTableModel::Status).data().toString() == "running";
    if (live) live_timer_.start();
    else live_timer_.stop();
    selectRuns(keep);
    updateButtons();
    emit loaded();
  });
}

QList<int64_t> RunsPage::selectedRuns() const {
  QList<int64_t> ids;
  for (const auto& idx : table_->selectionModel()->selectedRows())
    if (const auto* r = model_->runAt(filter_->mapToSource(idx).row())) ids << r->record.id;
  return ids;
}

void RunsPage::selectRuns(const QList<int64_t>& ids) {
  table_->clearSelection();
  for (int64_t id : ids) {
    const int row = model_->rowOfRun(id);
    if (row < 0) continue;
    const auto idx = filter_->mapFromSource(model_->index(row, 0));
    table_->selectionModel()->select(idx, QItemSelectionModel::Select | QItemSelectionModel::Rows);
  }
}

void RunsPage::updateButtons() {
  const auto ids = selectedRuns();
  show_->setEnabled(ids.size() == 1);
  open_->setEnabled(ids.size() == 1);
  compare_->setEnabled(ids.size() >= 2);
  compare_->setToolTip(ids.size() > 2 ? tr("Curves of all selected runs; differences between the first two") : QString());
  bool resumable = false, running = false;
  if (ids.size() == 1)
    if (const auto* r = model_->runAt(model_->rowOfRun(ids.front()))) {
      const auto st = live_status(r->record);
      resumable = st == "stopped" || st == "crashed" || st == "failed";
      running = st == "running";
    }
  resume_->setEnabled(resumable);
  delete_->setEnabled(ids.size() == 1 && !running);
}

void RunsPage::deleteRun(int64_t run, bool with_files) {
  const auto db = database_.toStdString();
  info_->setText(tr("Deleting run %1…").arg(run));
  runAsync(this, [db, run, with_files] { return delete_run(db, run, with_files); }, [this, run](const status& st) {
    ++deletions_;
    refresh();
    if (!st) info_->setText(tr("Run %1 was not deleted: %2").arg(run).arg(QString::fromStdString(st.message())));
  });
}

void RunsPage::compareSelected() {
  const auto ids = selectedRuns();
  if (ids.size() < 2) return;
  const auto db = database_.toStdString();
  std::vector<int64_t> runs(ids.begin(), ids.end());
  struct Loaded {
    std::vector<result<run_details>> details;
    result<run_comparison> comparison = error{"not compared"};
  };
  runAsync(this,
           [db, runs] {
             Loaded l;
             for (int64_t r : runs) l.details.push_back(show_run(db, r));
             l.comparison = compare_runs(db, runs[0], runs[1]);
             return l;
           },
           [this](const Loaded& l) {
             overlay_->removeAllCurves();
             for (const auto& d : l.details) {
               if (!d) continue;
               std::vector<QPointF> pts;
               for (const auto& m : d->metrics) pts.emplace_back(static_cast<double>(m.step), m.loss);
               const int c = overlay_->addCurve(tr("run %1").arg(d->record.id));
               overlay_->setCurve(c, std::move(pts));
             }
             overlay_->setAxisTitles(tr("step"), tr("loss (nats/token)"));
             std::vector<QStringList> rows;
             if (!l.comparison) {
               rows.push_back({tr("error"), QString::fromStdString(l.comparison.message()), {}});
             } else {
               const auto& c = *l.comparison;
               auto str = [](const nlohmann::json& j) { return QString::fromStdString(j.is_string() ? j.get<std::string>() : j.dump()); };
               for (const auto& [k, v] : c.config_diff) rows.push_back({QString::fromStdString(k), str(v.first), str(v.second)});
               for (const auto& [k, v] : c.environment_diff) rows.push_back({tr("hardware/versions: %1").arg(QString::fromStdString(k)), str(v.first), str(v.second)});
               auto opt = [](const std::optional<double>& v) { return v ? QString::number(*v, 'f', 4) : QStringLiteral("–"); };
               rows.push_back({tr("final validation loss"), opt(c.summary_a.final_val), opt(c.summary_b.final_val)});
               rows.push_back({tr("mean tokens/s"), QString::number(c.summary_a.mean_tokens_per_s, 'f', 0), QString::number(c.summary_b.mean_tokens_per_s, 'f', 0)});
               const QString curves = c.first_differing_step < 0 ? tr("identical at all %1 common steps").arg(c.common_steps)
                                                                 : tr("differ from step %1 on (max |Δ| %2 over %3 common steps)")
                                                                       .arg(c.first_differing_step).arg(c.max_abs_loss_diff, 0, 'g', 3).arg(c.common_steps);
               rows.push_back({tr("training loss curves"), curves, QString()});
             }
             const QString a = l.details.size() > 0 && l.details[0] ? tr("run %1").arg(l.details[0]->record.id) : tr("A");
             const QString b = l.details.size() > 1 && l.details[1] ? tr("run %1").arg(l.details[1]->record.id) : tr("B");
             const int span_row = l.comparison ? static_cast<int>(rows.size()) - 1 : 0;
             diff_->setTable({tr("Difference"), a, b}, std::move(rows));
             diff_view_->clearSpans();
             diff_view_->setSpan(span_row, 1, 1, 2);  // the curves' verdict is about both runs
             diff_view_->resizeRowsToContents();
             ++comparisons_;
           });
}

}  // namespace lorapipe::ui
