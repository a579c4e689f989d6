// Chart wrappers: see charts.h.
#include "ui/charts.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <QBarCategoryAxis>
#include <QBarSeries>
#include <QBarSet>
#include <QChart>
#include <QLineSeries>
#include <QLogValueAxis>
#include <QPen>
#include <QStackedBarSeries>
#include <QValueAxis>

#include "ui/decimate.h"

namespace lorapipe::ui {

namespace {

QChart* makeChart(const QString& title) {
  auto* c = new QChart;
  c->setTitle(title);
  c->legend()->setAlignment(Qt::AlignBottom);
  c->setMargins(QMargins(4, 4, 4, 4));
  c->setBackgroundRoundness(0);
  return c;
}

}  // namespace

CurveChart::CurveChart(const QString& title, QWidget* parent) : QChartView(makeChart(title), parent) {
  setRenderHint(QPainter::Antialiasing);
  setMinimumSize(260, 180);
  flush_timer_.setSingleShot(true);
  flush_timer_.setInterval(100);
  connect(&flush_timer_, &QTimer::timeout, this, &CurveChart::flush);
  attachAxes();
}

int CurveChart::addCurve(const QString& name, bool smoothed) {
  Curve c;
  c.name = name;
  c.line = new QLineSeries;
  c.line->setName(name);
  chart()->addSeries(c.line);
  if (smoothed) {
    // The raw curve in a pale opaque tint of its colour (translucent lines are slow to rasterise).
    const QColor base = c.line->color();
    const QColor faint = QColor::fromRgbF(0.3 * base.redF() + 0.7, 0.3 * base.greenF() + 0.7, 0.3 * base.blueF() + 0.7);
    c.line->setColor(faint);
    c.line->setName(name + tr(" (raw)"));
    c.smooth = new QLineSeries;
    c.smooth->setName(name + tr(" (smoothed)"));
    QPen pen(base);
    pen.setWidthF(2);
    c.smooth->setPen(pen);
    chart()->addSeries(c.smooth);
  }
  curves_.push_back(std::move(c));
  attachAxes();
  return static_cast<int>(curves_.size()) - 1;
}

void CurveChart::setCurve(int curve, std::vector<QPointF> points) {
  std::erase_if(points, [](const QPointF& p) { return !std::isfinite(p.x()) || !std::isfinite(p.y()); });
  curves_.at(curve).raw = std::move(points);
  scheduleFlush();
}

void CurveChart::append(int curve, QPointF point) {
  if (!std::isfinite(point.x()) || !std::isfinite(point.y())) return;  // a diverged loss is not a point
  curves_.at(curve).raw.push_back(point);
  scheduleFlush();
}

void CurveChart::removeAllCurves() {
  chart()->removeAllSeries();
  curves_.clear();
  attachAxes();
}

void CurveChart::setAxisTitles(const QString& x, const QString& y) {
  x_title_ = x, y_title_ = y;
  x_axis_->setTitleText(x);
  y_axis_->setTitleText(y);
}

void CurveChart::setLogY(bool on) {
  if (on == log_y_) return;
  log_y_ = on;
  attachAxes();
  flush();
}

void CurveChart::setSmoothing(double weight) {
  smoothing_ = std::clamp(weight, 0.0, 0.99);
  scheduleFlush();
}

int CurveChart::rawPoints(int curve) const { return static_cast<int>(curves_.at(curve).raw.size()); }
int CurveChart::drawnPoints(int curve) const { return static_cast<int>(curves_.at(curve).line->count()); }
double CurveChart::lastDrawnX(int curve) const {
  const auto* line = curves_.at(curve).line;
  return line->count() > 0 ? line->at(line->count() - 1).x() : std::numeric_limits<double>::quiet_NaN();
}

void CurveChart::resizeEvent(QResizeEvent* e) {
  QChartView::resizeEvent(e);
  scheduleFlush();
}

void CurveChart::scheduleFlush() {
  if (!flush_timer_.isActive()) flush_timer_.start();
}

// Replaces the axes (a log axis is a different type) and attaches every series to them.
void CurveChart::attachAxes() {
  for (auto* a : chart()->axes()) {
    chart()->removeAxis(a);
    delete a;
  }
  x_axis_ = new QValueAxis;
  if (log_y_) {
    auto* l = new QLogValueAxis;
    l->setBase(10);
    l->setLabelFormat("%.3g");
    l->setMinorTickCount(-1);
    y_axis_ = l;
  } else {
    auto* v = new QValueAxis;
    v->setLabelFormat("%.4g");
    y_axis_ = v;
  }
  static_cast<QValueAxis*>(x_axis_)->setLabelFormat("%.6g");
  x_axis_->setTitleText(x_title_);
  y_axis_->setTitleText(y_title_);
  chart()->addAxis(x_axis_, Qt::AlignBottom);
  chart()->addAxis(y_axis_, Qt::AlignLeft);
  for (auto* s : chart()->series()) {
    s->attachAxis(x_axis_);
    s->attachAxis(y_axis_);
  }
}

void CurveChart::flush() {
  flush_timer_.stop();
  double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
  for (const auto& c : curves_)
    for (const auto& p : c.raw) {
      if (log_y_ && p.y() <= 0) continue;
      x0 = std::min(x0, p.x()), x1 = std::max(x1, p.x());
      y0 = std::min(y0, p.y()), y1 = std::max(y1, p.y());
    }
  if (!(x1 >= x0)) x0 = 0, x1 = 1, y0 = log_y_ ? 0.1 : 0, y1 = 1;
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) y0 -= std::abs(y0) * 0.05 + 1e-9, y1 += std::abs(y1) * 0.05 + 1e-9;
  const int columns = std::max(50, static_cast<int>(chart()->plotArea().width()));
  for (auto& c : curves_) {
    std::vector<QPointF> kept;
    const std::vector<QPointF>* src = &c.raw;
    if (log_y_) {
      std::copy_if(c.raw.begin(), c.raw.end(), std::back_inserter(kept), [](const QPointF& p) { return p.y() > 0; });
      src = &kept;
    }
    c.line->replace(decimateMinMax(*src, x0, x1, columns));
    // The moving average is smooth: one point per pixel column draws it exactly.
    if (c.smooth) c.smooth->replace(decimateMean(smoothCurve(*src, smoothing_), x0, x1, columns));
  }
  auto* x = static_cast<QValueAxis*>(x_axis_);
  x->setRange(x0, x1);
  x->applyNiceNumbers();
  if (log_y_) {
    static_cast<QLogValueAxis*>(y_axis_)->setRange(y0 * 0.9, y1 * 1.1);
  } else {
    auto* y = static_cast<QValueAxis*>(y_axis_);
    const double pad = (y1 - y0) * 0.05;
    y->setRange(y0 >= 0 && y0 - pad < 0 ? 0 : y0 - pad, y1 + pad);
    y->applyNiceNumbers();
  }
}

BarChart::BarChart(const QString& title, QWidget* parent) : QChartView(makeChart(title), parent) {
  setRenderHint(QPainter::Antialiasing);
  setMinimumSize(260, 180);
}

void BarChart::setBars(const QStringList& categories, const std::vector<BarSet>& sets, bool stacked, const QString& x_title,
                       const QString& y_title, double limit, const QString& limit_name) {
  QChart* c = chart();
  c->removeAllSeries();
  for (auto* a : c->axes()) {
    c->removeAxis(a);
    delete a;
  }
  QAbstractBarSeries* series = stacked ? static_cast<QAbstractBarSeries*>(new QStackedBarSeries) : new QBarSeries;
  double top = 0;
  std::vector<double> totals(categories.size(), 0.0);
  for (const auto& s : sets) {
    auto* set = new QBarSet(s.name);
    for (size_t i = 0; i < s.values.size(); ++i) {
      set->append(s.values[i]);
      if (i < totals.size()) totals[i] = stacked ? totals[i] + s.values[i] : std::max(totals[i], s.values[i]);
    }
    series->append(set);
  }
  for (double t : totals) top = std::max(top, t);
  set_count_ = static_cast<int>(sets.size());
  c->addSeries(series);
  auto* x = new QBarCategoryAxis;
  x->append(categories);
  x->setTitleText(x_title);
  auto* y = new QValueAxis;
  y->setTitleText(y_title);
  y->setLabelFormat("%.4g");
  if (limit >= 0) top = std::max(top, limit);
  y->setRange(0, top > 0 ? top * 1.1 : 1);
  y->applyNiceNumbers();
  c->addAxis(x, Qt::AlignBottom);
  c->addAxis(y, Qt::AlignLeft);
  series->attachAxis(x);
  series->attachAxis(y);
  if (limit >= 0) {
    auto* line = new QLineSeries;
    line->setName(limit_name);
    QPen pen(Qt::red);
    pen.setStyle(Qt::DashLine);
    pen.setWidthF(2);
    line->setPen(pen);
    line->append(-0.5, limit);
    line->append(categories.size() - 0.5, limit);
    c->addSeries(line);
    line->attachAxis(x);
    line->attachAxis(y);
  }
}

}  // namespace lorapipe::ui
