// Curve decimation and smoothing: see decimate.h.
#include "ui/decimate.h"

#include <algorithm>
#include <cmath>

namespace lorapipe::ui {

QList<QPointF> decimateMinMax(const std::vector<QPointF>& pts, double x0, double x1, int columns) {
  QList<QPointF> out;
  if (columns < 1 || pts.size() <= static_cast<size_t>(columns) * 4 || !(x1 > x0)) {
    out.reserve(static_cast<qsizetype>(pts.size()));
    for (const auto& p : pts) out.append(p);
    return out;
  }
  out.reserve(columns * 2 + 2);
  const double width = (x1 - x0) / columns;
  size_t i = 0;
  while (i < pts.size()) {
    const long bucket = std::lround(std::floor((pts[i].x() - x0) / width));
    size_t j = i, lo = i, hi = i;
    while (j < pts.size() && std::lround(std::floor((pts[j].x() - x0) / width)) == bucket) {
      if (pts[j].y() < pts[lo].y()) lo = j;
      if (pts[j].y() > pts[hi].y()) hi = j;
      ++j;
    }
    // A pixel column shows the vertical span from its lowest to its highest point: those two, in
    // their order, draw it (plus the curve's very first and last points).
    size_t keep[4] = {i == 0 ? i : std::min(lo, hi), std::min(lo, hi), std::max(lo, hi), j == pts.size() ? j - 1 : std::max(lo, hi)};
    size_t last = static_cast<size_t>(-1);
    for (size_t k : keep)
      if (k != last) out.append(pts[k]), last = k;
    i = j;
  }
  return out;
}

QList<QPointF> decimateMean(const std::vector<QPointF>& pts, double x0, double x1, int columns) {
  QList<QPointF> out;
  if (columns < 1 || pts.size() <= static_cast<size_t>(columns) * 2 || !(x1 > x0)) {
    out.reserve(static_cast<qsizetype>(pts.size()));
    for (const auto& p : pts) out.append(p);
    return out;
  }
  out.reserve(columns + 2);
  const double width = (x1 - x0) / columns;
  size_t i = 0;
  while (i < pts.size()) {
    const double bucket = std::floor((pts[i].x() - x0) / width);
    double sx = 0, sy = 0;
    size_t j = i;
    for (; j < pts.size() && std::floor((pts[j].x() - x0) / width) == bucket; ++j) sx += pts[j].x(), sy += pts[j].y();
    const double n = static_cast<double>(j - i);
    if (i == 0) out.append(pts[0]);
    out.append(QPointF(sx / n, sy / n));
    if (j == pts.size()) out.append(pts[j - 1]);
    i = j;
  }
  return out;
}

std::vector<QPointF> smoothCurve(const std::vector<QPointF>& pts, double weight) {
  if (weight <= 0) return pts;
  std::vector<QPointF> out;
  out.reserve(pts.size());
  double ema = 0, debias = 1;
  for (const auto& p : pts) {
    ema = ema * weight + (1 - weight) * p.y();
    debias *= weight;
    out.emplace_back(p.x(), ema / (1 - debias));
  }
  return out;
}

}  // namespace lorapipe::ui
