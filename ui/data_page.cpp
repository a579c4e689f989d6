// Data page: see data_page.h.
#include "ui/data_page.h"

#include <QHBoxLayout>
#include <QHeaderView>
#include <QPushButton>
#include <QSplitter>
#include <QTableView>
#include <QVBoxLayout>

#include "core/engine/model_session.h"
#include "ui/async.h"
#include "ui/charts.h"
#include "ui/models.h"

namespace lorapipe::ui {

namespace {

// Trained tokens come back between these control characters (they never occur in rendered text).
const std::string kOpen = "\x01", kClose = "\x02";

QString exampleHtml(const data_report_example& ex, int n) {
  QString body;
  const QString marked = QString::fromStdString(ex.marked);
  bool trained = false;
  QString run;
  auto flush = [&] {
    if (run.isEmpty()) return;
    const QString escaped = run.toHtmlEscaped().replace("\n", "<br>");
    body += trained ? QStringLiteral("<span style=\"background:#c8ecd0;color:#0b5d1e;\">%1</span>").arg(escaped)
                    : QStringLiteral("<span style=\"color:#777777;\">%1</span>").arg(escaped);
    run.clear();
  };
  for (QChar c : marked) {
    if (c == QChar(1) || c == QChar(2)) {
      flush();
      trained = c == QChar(1);
    } else {
      run += c;
    }
  }
  flush();
  int64_t on = 0;
  for (auto m : ex.example.mask) on += m;
  return QStringLiteral("<h4>Example %1 (record %2): %3 tokens, %4 trained</h4><p style=\"font-family:monospace;\">%5</p>")
      .arg(n)
      .arg(ex.example.line)
      .arg(ex.example.ids.size())
      .arg(on)
      .arg(body);
}

}  // namespace

DataPage::DataPage(QWidget* parent) : QWidget(parent) {
  auto* layout = new QVBoxLayout(this);
  auto* top = new QHBoxLayout;
  status_ = new QLabel(tr("Open or create a project to inspect its data."));
  status_->setObjectName("dataStatus");
  status_->setWordWrap(true);
  auto* again = new QPushButton(tr("&Inspect again"));
  again->setObjectName("inspectButton");
  connect(again, &QPushButton::clicked, this, &DataPage::refresh);
  top->addWidget(status_, 1);
  top->addWidget(again);
  layout->addLayout(top);
  auto* split = new QSplitter(Qt::Vertical);
  auto* upper = new QWidget;
  auto* h = new QHBoxLayout(upper);
  h->setContentsMargins(0, 0, 0, 0);
  counts_ = new TextTableModel(this);
  auto* table = new QTableView;
  table->setObjectName("dataCounts");
  table->setModel(counts_);
  table->verticalHeader()->hide();
  table->horizontalHeader()->setStretchLastSection(true);
  table->setSelectionBehavior(QAbstractItemView::SelectRows);
  table->setMinimumWidth(320);
  h->addWidget(table, 2);
  histogram_ = new BarChart(tr("Token length of examples"));
  histogram_->setObjectName("dataHistogram");
  h->addWidget(histogram_, 3);
  split->addWidget(upper);
  examples_ = new QTextBrowser;
  examples_->setObjectName("dataExamples");
  split->addWidget(examples_);
  split->setStretchFactor(0, 1);
  split->setStretchFactor(1, 1);
  layout->addWidget(split, 1);
}

int DataPage::histogramBars() const { return histogram_->barSetCount(); }

void DataPage::setProject(const project_config& cfg, bool valid) {
  cfg_ = cfg;
  valid_ = valid;
  stale_ = true;
  if (isVisible()) refresh();
}

void DataPage::showEvent(QShowEvent* e) {
  QWidget::showEvent(e);
  if (stale_) refresh();
}

void DataPage::refresh() {
  stale_ = false;
  if (!valid_) {
    status_->setText(tr("Fix the project's problems (Project page) to inspect its data."));
    ++generation_;  // a result still coming for an earlier project is stale
    busy_ = false;
    return;
  }
  busy_ = true;
  const int generation = ++generation_;
  status_->setText(tr("Tokenizing %1…").arg(QString::fromStdString(cfg_.resolve(cfg_.data.train).string())));
  auto cfg = cfg_;
  runAsync(this, [cfg] { return inspect_data(cfg, 4, kOpen, kClose); }, [this, generation](const result<data_report>& r) {
    if (generation != generation_) return;
    busy_ = false;
    if (!r) {
      status_->setText(tr("Cannot read the data: %1").arg(QString::fromStdString(r.message())));
      emit reportReady();
      return;
    }
    const auto& d = *r;
    const auto& s = d.stats;
    status_->setText(tr("%1 · format %2%3 · tokenizer %4 (%5)")
                         .arg(QString::fromStdString(d.data_path), QString::fromStdString(d.format),
                              d.format_detected ? tr(" (detected)") : QString(), QString::fromStdString(d.tokenizer_path),
                              QString::fromStdString(d.tokenizer_kind)));
    auto row = [](const QString& k, const QString& v) { return QStringList{k, v}; };
    std::vector<QStringList> rows = {
        row(tr("Records"), QString::number(s.records)),
        row(tr("Examples"), QString::number(s.examples)),
        row(tr("Tokens"), QString::number(s.tokens)),
        row(tr("Trained tokens"), QStringLiteral("%1 (%2%)").arg(s.trained_tokens).arg(s.tokens ? 100.0 * s.trained_tokens / s.tokens : 0, 0, 'f', 1)),
        row(tr("Length min / mean / max"), QStringLiteral("%1 / %2 / %3 tokens").arg(s.min_len).arg(s.mean_len, 0, 'f', 1).arg(s.max_len)),
        row(tr("Truncated"), QString::number(s.truncated)),
        row(tr("Dropped (too long)"), QString::number(s.dropped)),
        row(tr("Skipped (malformed)"), QString::number(s.skipped)),
        row(tr("Sequences (train / val)"), QStringLiteral("%1 / %2 of %3 tokens").arg(d.train_sequences).arg(d.val_sequences).arg(d.seq_len)),
        row(tr("Packing"), d.packing ? tr("on") : tr("off")),
        row(tr("Chat template"), d.template_source.empty() ? tr("–") : QString::fromStdString(d.template_source))};
    for (const auto& e : s.skipped_errors) rows.push_back(row(tr("Skipped"), QString::fromStdString(e)));
    counts_->setTable({tr("Quantity"), tr("Value")}, std::move(rows));
    QStringList cats;
    BarChart::BarSet set{tr("examples"), {}};
    histogram_total_ = 0;
    for (const auto& [upper, count] : s.histogram) {  // buckets by upper bound: "≤256" stays whole where "129–256" was cut off
      histogram_total_ += count;
      cats << QStringLiteral("≤%1").arg(upper);
      set.values.push_back(static_cast<double>(count));
    }
    histogram_->setBars(cats, {set}, false, tr("tokens per example (bucket's upper bound)"), tr("examples"));
    QString html = tr("<p><span style=\"background:#c8ecd0;color:#0b5d1e;\">Highlighted</span> tokens are trained on (carry a label); "
                      "<span style=\"color:#777777;\">grey</span> ones are masked (context only).</p>");
    int n = 1;
    for (const auto& ex : d.preview) html += exampleHtml(ex, n++);
    examples_->setHtml(html);
    emit reportReady();
  });
}

}  // namespace lorapipe::ui
