// Per-pixel min/max decimation of a curve: what a chart needs to draw a long series exactly as its
// pixels would show it, in at most 2 points per pixel column instead of every point.
#pragma once

#include <vector>

#include <QList>
#include <QPointF>

namespace lorapipe::ui {

// pts sorted by x. Splits [x0, x1] into `columns` buckets and keeps, per bucket, its lowest and
// highest points in their original order (and the curve's first and last points): at most
// 2 x columns + 2 points. Returns every point when there are no more than 4 per column.
QList<QPointF> decimateMinMax(const std::vector<QPointF>& pts, double x0, double x1, int columns);

// One point per column (the mean of its points) for curves without spikes worth keeping (a moving
// average); every point when there are no more than 2 per column.
QList<QPointF> decimateMean(const std::vector<QPointF>& pts, double x0, double x1, int columns);

// Exponential moving average of y (TensorBoard-style debiased), 0 <= weight < 1 (0 = raw).
std::vector<QPointF> smoothCurve(const std::vector<QPointF>& pts, double weight);

}  // namespace lorapipe::ui
