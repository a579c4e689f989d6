// Timeline painting: see gantt_view.h.
#include "ui/gantt_view.h"

#include <algorithm>
#include <cmath>

#include <QPainter>
#include <QRegularExpression>

namespace lorapipe::ui {

namespace {

struct KindStyle {
  BarKind kind;
  const char* name;
  QColor color;
};
const KindStyle kStyles[] = {{BarKind::Forward, "forward", QColor(0x3b, 0x82, 0xc4)},
                             {BarKind::Backward, "backward", QColor(0xe0, 0x7b, 0x39)},
                             {BarKind::Recompute, "recompute", QColor(0x8e, 0x6c, 0xc4)},
                             {BarKind::Copy, "copies", QColor(0x4c, 0xa8, 0x6a)},
                             {BarKind::Optimizer, "optimizer", QColor(0xc9, 0x3c, 0x4b)},
                             {BarKind::Other, "other", QColor(0x99, 0x99, 0x99)}};

QColor colorOf(BarKind k) {
  for (const auto& s : kStyles)
    if (s.kind == k) return s.color;
  return Qt::gray;
}

// A "nice" tick step for a span divided into about n parts.
double tickStep(double span, int n) {
  const double raw = span / std::max(1, n);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * mag) return m * mag;
  return 10 * mag;
}

}  // namespace

BarKind barKindOf(const QString& instr) {
  static const QRegularExpression mnemonic("^\\d+([A-Z_]+)");
  const auto m = mnemonic.match(instr);
  const QString op = m.hasMatch() ? m.captured(1) : instr;
  if (op == "F") return BarKind::Forward;
  if (op == "B") return BarKind::Backward;
  if (op == "R") return BarKind::Recompute;
  if (op == "STEP") return BarKind::Optimizer;
  if (op.startsWith("SEND") || op.startsWith("RECV") || op == "PW" || op == "OFF" || op == "ON" || op == "LOAD") return BarKind::Copy;
  return BarKind::Other;
}

GanttView::GanttView(QWidget* parent) : QWidget(parent) {
  setMinimumHeight(120);
  setSizePolicy(QSizePolicy::Expanding, QSizePolicy::Preferred);
}

void GanttView::setTimeline(const QString& title, const QStringList& rows, std::vector<GanttBar> bars, double span_s) {
  title_ = title, rows_ = rows, bars_ = std::move(bars), span_ = span_s;
  for (const auto& b : bars_) span_ = std::max(span_, b.end);
  updateGeometry();
  update();
}

QSize GanttView::sizeHint() const {
  const int line = fontMetrics().height();
  return {600, line + 12 + 34 * static_cast<int>(std::max<qsizetype>(1, rows_.size())) + 3 * line + 24};
}

void GanttView::paintEvent(QPaintEvent*) {
  QPainter p(this);
  p.setRenderHint(QPainter::Antialiasing);
  p.fillRect(rect(), palette().base());
  const QFontMetrics fm = p.fontMetrics();
  const int line = fm.height();
  p.setPen(palette().text().color());
  QFont bold = p.font();
  bold.setBold(true);
  p.setFont(bold);
  p.drawText(QRect(8, 4, width() - 16, line), Qt::AlignLeft | Qt::AlignVCenter, title_);
  p.setFont(font());
  if (rows_.isEmpty() || span_ <= 0) {
    p.drawText(rect(), Qt::AlignCenter, tr("no timeline yet"));
    return;
  }
  int label_w = 0;
  for (const auto& r : rows_) label_w = std::max(label_w, fm.horizontalAdvance(r));
  const int left = 12 + label_w, right = width() - 12, top = 8 + line + 4;
  const int legend_h = line + 8, axis_h = 2 * line + 6;
  const int row_h = std::clamp((height() - top - axis_h - legend_h) / static_cast<int>(rows_.size()), 12, 34);
  const double scale = (right - left) / span_;
  for (int r = 0; r < rows_.size(); ++r) {
    const QRect lane(left, top + r * row_h + 2, right - left, row_h - 4);
    p.fillRect(lane, QBrush(palette().alternateBase().color().darker(105), Qt::BDiagPattern));  // idle
    p.setPen(palette().text().color());
    p.drawText(QRect(4, lane.top(), label_w + 4, lane.height()), Qt::AlignRight | Qt::AlignVCenter, rows_[r]);
  }
  for (const auto& b : bars_) {
    if (b.row < 0 || b.row >= rows_.size()) continue;
    const double x0 = left + b.start * scale, x1 = left + std::max(b.end, b.start) * scale;
    const QRectF box(x0, top + b.row * row_h + 2, std::max(1.0, x1 - x0), row_h - 4);
    p.fillRect(box, colorOf(b.kind));
    if (box.width() > fm.horizontalAdvance(b.label) + 4) {
      p.setPen(Qt::white);
      p.drawText(box, Qt::AlignCenter, b.label);
    }
  }
  // Time axis.
  const int axis_y = top + static_cast<int>(rows_.size()) * row_h + 2;
  p.setPen(palette().text().color());
  p.drawLine(left, axis_y, right, axis_y);
  const double step = tickStep(span_, std::max(2, (right - left) / 90));
  const bool ms = span_ < 1.0;
  for (double t = 0; t <= span_ * 1.0001; t += step) {
    const int x = left + static_cast<int>(t * scale);
    p.drawLine(x, axis_y, x, axis_y + 4);
    const QString text = ms ? QString::number(t * 1e3, 'g', 4) : QString::number(t, 'g', 4);
    p.drawText(QRect(x - 40, axis_y + 4, 80, line), Qt::AlignHCenter | Qt::AlignTop, text);
  }
  p.drawText(QRect(left, axis_y + 4 + line, right - left, line), Qt::AlignHCenter, ms ? tr("time in step (ms)") : tr("time in step (s)"));
  // Legend.
  int x = left;
  const int ly = axis_y + axis_h;
  for (const auto& s : kStyles) {
    p.fillRect(QRect(x, ly + 3, 12, line - 6), s.color);
    x += 16;
    const QString name = tr(s.name);
    p.drawText(QRect(x, ly, fm.horizontalAdvance(name) + 4, line), Qt::AlignVCenter, name);
    x += fm.horizontalAdvance(name) + 14;
  }
  p.fillRect(QRect(x, ly + 3, 12, line - 6), QBrush(palette().alternateBase().color().darker(105), Qt::BDiagPattern));
  p.drawRect(QRect(x, ly + 3, 12, line - 6));
  p.drawText(QRect(x + 16, ly, 60, line), Qt::AlignVCenter, tr("idle"));
}

}  // namespace lorapipe::ui
