// Our one wrapper over Qt Charts. CurveChart: line curves (raw plus an optional smoothed companion)
// that may hold 100,000s of points; the chart only ever gets a per-pixel min/max decimation of them,
// rebuilt at most every 100 ms however fast points are appended; linear or log y. BarChart: plain or
// stacked bars over categories with an optional limit line (e.g. a device's capacity).
#pragma once

#include <vector>

#include <QChartView>
#include <QPointF>
#include <QString>
#include <QStringList>
#include <QTimer>

class QLineSeries;
class QAbstractAxis;

namespace lorapipe::ui {

class CurveChart : public QChartView {
  Q_OBJECT
 public:
  explicit CurveChart(const QString& title, QWidget* parent = nullptr);
  // A new curve; `smoothed` also draws its moving average (the raw curve then drawn faint).
  int addCurve(const QString& name, bool smoothed = false);
  void setCurve(int curve, std::vector<QPointF> points);  // points sorted by x
  void append(int curve, QPointF point);
  void removeAllCurves();
  void setAxisTitles(const QString& x, const QString& y);
  void setLogY(bool on);
  void setSmoothing(double weight);  // 0 (off) .. 0.99
  // Applies pending points now (normally a timer does it).
  void flush();
  int curveCount() const { return static_cast<int>(curves_.size()); }
  int rawPoints(int curve) const;
  int drawnPoints(int curve) const;  // points the chart holds for the raw curve
  double lastDrawnX(int curve) const;  // x of the last of them (NaN when none)

 protected:
  void resizeEvent(QResizeEvent* e) override;

 private:
  struct Curve {
    QString name;
    std::vector<QPointF> raw;
    QLineSeries* line = nullptr;
    QLineSeries* smooth = nullptr;
  };
  void scheduleFlush();
  void attachAxes();
  std::vector<Curve> curves_;
  QAbstractAxis* x_axis_ = nullptr;
  QAbstractAxis* y_axis_ = nullptr;
  QString x_title_, y_title_;
  bool log_y_ = false;
  double smoothing_ = 0.6;
  QTimer flush_timer_;
};

class BarChart : public QChartView {
  Q_OBJECT
 public:
  explicit BarChart(const QString& title, QWidget* parent = nullptr);
  struct BarSet {
    QString name;
    std::vector<double> values;  // one per category
  };
  // limit >= 0 draws a horizontal line labelled `limit_name` across the chart.
  void setBars(const QStringList& categories, const std::vector<BarSet>& sets, bool stacked, const QString& x_title,
               const QString& y_title, double limit = -1, const QString& limit_name = {});
  int barSetCount() const { return set_count_; }

 private:
  int set_count_ = 0;
};

}  // namespace lorapipe::ui
