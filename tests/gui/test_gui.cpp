// GUI tests (QtTest, offscreen): the item models under QAbstractItemModelTester, curve decimation and
// the 100,000-point render, and the main flow on stories260K driven through the window: a project
// from the model folder and Tiny Shakespeare, a validation error seen and fixed, the data report, a
// plan for cpu:2, a training run started, its points arriving, stopped, found as "stopped" in the Runs
// table, resumed to the end, compared with a second run, generation with its adapter, export; a run
// whose model cannot be loaded and a run killed with SIGKILL leave the window working and show why;
// a run left running when the window closes is followed by the next window. While runs train, the GUI
// thread's event-loop latency is measured (99th percentile < 100 ms).
#include <algorithm>
#include <csignal>
#include <random>

#include <QAbstractItemModelTester>
#include <QApplication>
#include <QComboBox>
#include <QElapsedTimer>
#include <QFile>
#include <QLineEdit>
#include <QProcess>
#include <QPushButton>
#include <QSettings>
#include <QSpinBox>
#include <QTemporaryDir>
#include <QTest>

#include "ui/charts.h"
#include "ui/data_page.h"
#include "ui/decimate.h"
#include "ui/gantt_view.h"
#include "ui/main_window.h"
#include "ui/models.h"
#include "ui/plan_page.h"
#include "ui/project_page.h"
#include "ui/run_process.h"
#include "ui/runs_page.h"
#include "ui/train_page.h"
#include "ui/try_page.h"

using namespace lorapipe;
using namespace lorapipe::ui;

namespace {

QString dataDir() { return qEnvironmentVariable("LORAPIPE_TEST_DATA", LORAPIPE_TEST_DATA_DEFAULT); }

// Measures how late a 20 ms timer fires while the GUI works: the event loop's latency.
class LatencyProbe : public QObject {
 public:
  LatencyProbe() {
    timer_.setInterval(20);
    timer_.setTimerType(Qt::PreciseTimer);
    QObject::connect(&timer_, &QTimer::timeout, this, [this] {
      // A stall of L ms is every tick it swallowed, each late by what was left of L when it was due.
      const qint64 now = clock_.nsecsElapsed();
      if (last_ > 0)
        for (double late = (now - last_) / 1e6 - 20.0; ; late -= 20.0) {
          late_ms_.push_back(std::max(0.0, late));
          if (late < 20.0) break;
        }
      last_ = now;
    });
  }
  void start() {
    clock_.start();
    last_ = 0;
    timer_.start();
  }
  void stop() { timer_.stop(); }
  double percentile(double p) const {
    if (late_ms_.empty()) return 0;
    auto v = late_ms_;
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
  }
  size_t samples() const { return late_ms_.size(); }

 private:
  QTimer timer_;
  QElapsedTimer clock_;
  qint64 last_ = 0;
  std::vector<double> late_ms_;
};

// Alive and not a zombie (a container's init may never reap what startDetached left behind).
bool processAlive(qint64 pid) {
  if (pid <= 0 || ::kill(static_cast<pid_t>(pid), 0) != 0) return false;
  QFile stat(QStringLiteral("/proc/%1/stat").arg(pid));
  if (!stat.open(QIODevice::ReadOnly)) return true;
  const QByteArray text = stat.readAll();
  const qsizetype close = text.lastIndexOf(')');
  return !(close > 0 && close + 2 < text.size() && text[close + 2] == 'Z');
}

}  // namespace

class GuiTest : public QObject {
  Q_OBJECT
 private:
  QTemporaryDir tmp_;
  QList<qint64> pids_;  // every training process a test started: none outlives the test
  QString db() const { return tmp_.filePath("runs.db"); }
  QString fixture() const { return tmp_.filePath("fixture.lorapipe.json"); }
  void track(TrainPage* train) {
    if (train->process()->pid() > 0) pids_ << train->process()->pid();
  }
  // Finds the run row's live status in the Runs table (after a refresh).
  QString runStatus(RunsPage* runs, int64_t id) {
    runs->refresh();
    if (!QTest::qWaitFor([&] { return !runs->busy(); }, 20000)) return "timeout";
    const int row = runs->runs()->rowOfRun(id);
    return row < 0 ? QString("missing") : runs->runs()->index(row, RunTableModel::Status).data().toString();
  }

 private slots:
  void initTestCase();
  void cleanup();
  void modelsPassTheModelTester();
  void dataPageMarksTrainedAndMaskedTokens();
  void decimationKeepsEveryPixelsExtremes();
  void curveOf100000PointsRendersFast();
  void ganttClassifiesInstructions();
  void mainFlow();
  void failingRunsLeaveTheWindowWorking();
  void runLeftRunningIsFollowedByTheNextWindow();
};

// A saved project the failure and follow tests start from (independent of mainFlow).
void GuiTest::initTestCase() {
  QVERIFY(tmp_.isValid());
  const QString data = dataDir();
  const QString text = QStringLiteral(R"({"schema_version": 2, "name": "fixture",
    "model": {"path": "%1/models/stories260K/hf"}, "data": {"train": "%1/text/tinyshakespeare.txt", "seq_len": 64},
    "run": {"steps": 100000, "batch_size": 8, "eval_interval": 0, "sample_tokens": 0, "checkpoint_interval": 0,
            "output_dir": "%2", "database": "%3"}})").arg(data, tmp_.filePath("fixture-out"), db());
  QFile f(fixture());
  QVERIFY(f.open(QIODevice::WriteOnly));
  f.write(text.toUtf8());
}

void GuiTest::cleanup() {
  for (qint64 pid : pids_)
    if (processAlive(pid)) ::kill(static_cast<pid_t>(pid), SIGKILL);
  pids_.clear();
}

void GuiTest::modelsPassTheModelTester() {
  RunTableModel runs;
  QAbstractItemModelTester t1(&runs, QAbstractItemModelTester::FailureReportingMode::QtTest);
  std::vector<run_overview> v(3);
  for (int i = 0; i < 3; ++i) {
    v[i].record.id = 3 - i;
    v[i].record.status = i == 1 ? "failed" : "completed";
    v[i].record.project_name = QStringLiteral("p%1").arg(i).toStdString();
    v[i].record.config_json = R"({"parallel":{"devices":"cpu:2","schedule":"1f1b"}})";
    v[i].summary.last_loss = 1.5 + i;
    v[i].summary.mean_tokens_per_s = 1000.0 * (i + 1);
  }
  runs.setRuns(v);
  QCOMPARE(runs.rowCount(), 3);
  QCOMPARE(runs.index(1, RunTableModel::Status).data().toString(), QString("failed"));
  QCOMPARE(runs.index(0, RunTableModel::Devices).data().toString(), QString("cpu:2 · 1f1b"));
  QCOMPARE(runs.rowOfRun(1), 2);
  RunFilter filter;
  filter.setSourceModel(&runs);
  filter.setSortRole(RunTableModel::SortRole);
  QAbstractItemModelTester t2(&filter, QAbstractItemModelTester::FailureReportingMode::QtTest);
  filter.sort(RunTableModel::TokensPerS, Qt::DescendingOrder);
  QCOMPARE(filter.index(0, RunTableModel::Id).data().toString(), QString("1"));  // 3000 tokens/s
  filter.setStatus("failed");
  QCOMPARE(filter.rowCount(), 1);
  filter.setStatus({});
  filter.setText("p2");
  QCOMPARE(filter.rowCount(), 1);
  runs.setRuns({});
  QCOMPARE(filter.rowCount(), 0);

  TextTableModel text;
  QAbstractItemModelTester t3(&text, QAbstractItemModelTester::FailureReportingMode::QtTest);
  text.setTable({"a", "b"}, {{"1", "2"}, {"3", "4"}});
  QCOMPARE(text.columnCount(), 2);
  QCOMPARE(text.index(1, 1).data().toString(), QString("4"));
  text.setTable({}, {});
  QCOMPARE(text.rowCount(), 0);
}

void GuiTest::decimationKeepsEveryPixelsExtremes() {
  std::mt19937 rng(7);
  std::normal_distribution<double> noise(0, 1);
  std::vector<QPointF> pts;
  for (int i = 0; i < 100000; ++i) pts.emplace_back(i, std::sin(i / 5000.0) + noise(rng) * 0.1);
  pts[54321].setY(50);  // a spike must survive decimation
  pts[12345].setY(-50);
  const int columns = 700;
  const auto out = decimateMinMax(pts, 0, 99999, columns);
  QVERIFY(out.size() <= 2 * columns + 2);
  QVERIFY(out.size() >= columns);
  QCOMPARE(out.front(), pts.front());
  QCOMPARE(out.back(), pts.back());
  QVERIFY(std::any_of(out.begin(), out.end(), [](const QPointF& p) { return p.y() == 50; }));
  QVERIFY(std::any_of(out.begin(), out.end(), [](const QPointF& p) { return p.y() == -50; }));
  QVERIFY(std::is_sorted(out.begin(), out.end(), [](const QPointF& a, const QPointF& b) { return a.x() < b.x(); }));
  // Every column's extremes are kept: the min and max of the points in each bucket appear.
  const double width = 99999.0 / columns;
  for (int c = 0; c < columns; c += 37) {
    double lo = 1e9, hi = -1e9;
    for (const auto& p : pts)
      if (static_cast<int>(p.x() / width) == c) lo = std::min(lo, p.y()), hi = std::max(hi, p.y());
    QVERIFY(std::any_of(out.begin(), out.end(), [&](const QPointF& p) { return p.y() == lo; }));
    QVERIFY(std::any_of(out.begin(), out.end(), [&](const QPointF& p) { return p.y() == hi; }));
  }
  // Few points: all of them.
  std::vector<QPointF> few(pts.begin(), pts.begin() + 100);
  QCOMPARE(decimateMinMax(few, 0, 99, columns).size(), qsizetype(100));
  // The mean decimation (for the smoothed curve): one point per column, the ends kept.
  const auto mean = decimateMean(pts, 0, 99999, columns);
  QVERIFY(mean.size() <= columns + 2);
  QCOMPARE(mean.front(), pts.front());
  QCOMPARE(mean.back(), pts.back());
  // Smoothing: debiased, a constant stays constant.
  std::vector<QPointF> flat(50, QPointF(0, 3.0));
  for (const auto& p : smoothCurve(flat, 0.9)) QVERIFY(std::abs(p.y() - 3.0) < 1e-12);
}

void GuiTest::curveOf100000PointsRendersFast() {
  CurveChart chart("loss");
  chart.resize(900, 500);
  chart.show();
  QVERIFY(QTest::qWaitForWindowExposed(&chart));
  const int c = chart.addCurve("train", true);
  std::vector<QPointF> pts;
  for (int i = 0; i < 100000; ++i) pts.emplace_back(i, 3.0 + std::sin(i * 0.01) + (i % 97) * 0.01);
  QElapsedTimer t;
  t.start();
  chart.setCurve(c, pts);
  chart.flush();
  const double flush_ms = t.nsecsElapsed() / 1e6;
  const QPixmap shot = chart.grab();
  const double ms = t.nsecsElapsed() / 1e6;
  t.restart();
  chart.grab();
  const double again_ms = t.nsecsElapsed() / 1e6;
  qInfo("100,000-point curve (raw + smoothed): decimated to %d drawn points, rendered in %.1f ms (decimation %.1f ms); "
        "drawn again in %.1f ms", chart.drawnPoints(c), ms, flush_ms, again_ms);
  QVERIFY(!shot.isNull());
  QVERIFY(chart.drawnPoints(c) <= 2 * 900 + 2);
  QVERIFY2(ms < 200, qPrintable(QString("render took %1 ms").arg(ms)));
  // Live appends only store the point; the chart gets a new decimation at most every 100 ms.
  t.restart();
  for (int i = 0; i < 5000; ++i) chart.append(c, QPointF(100000 + i, 3.0));
  const double append_ms = t.nsecsElapsed() / 1e6;
  qInfo("5,000 live appends to it: %.2f ms", append_ms);
  QCOMPARE(chart.rawPoints(c), 105000);
  QCOMPARE(chart.lastDrawnX(c), 99999.0);  // not handed to the chart yet
  QTRY_COMPARE(chart.lastDrawnX(c), 104999.0);  // the next decimation has them
  QVERIFY(chart.drawnPoints(c) <= 2 * 900 + 2);
  chart.setCurve(c, {{1, -1.0}, {2, 0.0}, {3, 0.5}, {4, 2.0}});
  chart.setLogY(true);  // log y drops what it cannot show
  QCOMPARE(chart.drawnPoints(c), 2);
}

void GuiTest::ganttClassifiesInstructions() {
  QCOMPARE(barKindOf("2F0"), BarKind::Forward);
  QCOMPARE(barKindOf("0B3"), BarKind::Backward);
  QCOMPARE(barKindOf("1R2"), BarKind::Recompute);
  QCOMPARE(barKindOf("1SEND_F3@0"), BarKind::Copy);
  QCOMPARE(barKindOf("0PW"), BarKind::Copy);
  QCOMPARE(barKindOf("0STEP"), BarKind::Optimizer);
  QCOMPARE(barKindOf("0RW"), BarKind::Other);
}

// Chat data trains on the assistant turns only: the examples show both kinds of tokens.
void GuiTest::dataPageMarksTrainedAndMaskedTokens() {
  const QString data = dataDir();
  DataPage page;
  project_config cfg;
  cfg.model.path = (data + "/models/stories260K/hf").toStdString();
  cfg.data.train = (data + "/instruct/quiz_chat.jsonl").toStdString();
  page.show();
  page.setProject(cfg, true);
  QTRY_VERIFY_WITH_TIMEOUT(!page.busy() && page.counts()->rowCount() > 0, 60000);
  QCOMPARE(page.counts()->text(0, 1), QString("600"));  // records
  const QString html = page.examplesHtml();
  const QString examples = html.mid(html.indexOf("Example 1"));
  QVERIFY(examples.contains("#c8ecd0"));   // trained: the answers
  QVERIFY(examples.contains("#777777"));   // masked: the prompts and template
  QVERIFY(page.histogramBars() == 1 && page.histogramTotal() > 0);
  page.setProject(cfg, false);  // an invalid project: no stale report replaces the message
  QTRY_VERIFY(!page.busy());
}

void GuiTest::mainFlow() {
  const QString data = dataDir();
  MainWindow w;
  w.show();
  QVERIFY(QTest::qWaitForWindowExposed(&w));
  auto* project = w.projectPage();
  // A project from the model folder and Tiny Shakespeare.
  QVERIFY(project->setField("model.path", data + "/models/stories260K/hf"));
  QVERIFY(project->setField("data.train", data + "/text/tinyshakespeare.txt"));
  QTRY_VERIFY_WITH_TIMEOUT(project->modelSummary().contains("parameters"), 10000);
  QVERIFY2(project->modelSummary().startsWith("llama · 260.0K parameters · float32"), qPrintable(project->modelSummary()));
  QVERIFY2(project->modelSummary().contains("context 512 tokens"), qPrintable(project->modelSummary()));
  QVERIFY(project->modelSummary().contains("tokenizer.model"));
  QVERIFY(w.isWindowModified());
  // A validation error appears next to its field as you type, and goes when fixed.
  auto* seq = qobject_cast<QLineEdit*>(project->editor("data.seq_len"));
  QVERIFY(seq);
  seq->selectAll();
  QTest::keyClicks(seq, "4096");  // typed: the inline error appears without anything else done
  QTRY_VERIFY(project->fieldError("data.seq_len").contains("context length"));
  QVERIFY(project->fieldError("model.path").isEmpty());
  seq->selectAll();
  QTest::keyClicks(seq, "128");
  QTRY_VERIFY(project->fieldError("data.seq_len").isEmpty());
  QVERIFY(project->editor("name") != nullptr);  // every field has an editor
  for (const auto& f : project_fields())
    if (f.path != "schema_version") QVERIFY2(project->editor(QString::fromStdString(f.path)), f.path.c_str());
  QVERIFY(project->setField("run.output_dir", tmp_.filePath("out")));
  QVERIFY(project->setField("run.database", db()));
  QVERIFY(project->setField("run.steps", 120));
  QVERIFY(project->setField("run.eval_interval", 50));
  QVERIFY(project->setField("run.sample_tokens", 0));
  QVERIFY(project->setField("run.checkpoint_interval", 0));
  QVERIFY(project->setField("run.trace_interval", 20));
  project->validateNow();
  QVERIFY2(project->problems().isEmpty(), qPrintable(project->problems().join('\n')));
  QVERIFY(w.saveProjectAs(tmp_.filePath("p.lorapipe.json")));
  QVERIFY(!w.isWindowModified());
  QVERIFY(QFile::exists(tmp_.filePath("p.lorapipe.json")));
  QVERIFY(w.windowTitle().contains("p.lorapipe.json"));
  QCOMPARE(QSettings().value("recentProjects").toStringList().value(0), tmp_.filePath("p.lorapipe.json"));

  // Data: counts, histogram, examples with trained tokens highlighted.
  w.showPage(MainWindow::DataIndex);
  QTRY_VERIFY_WITH_TIMEOUT(!w.dataPage()->busy() && w.dataPage()->counts()->rowCount() > 0, 60000);
  QCOMPARE(w.dataPage()->counts()->text(0, 0), QString("Records"));
  QVERIFY(w.dataPage()->counts()->text(1, 1).toInt() > 1000);  // documents of Tiny Shakespeare
  QCOMPARE(w.dataPage()->histogramBars(), 1);
  QVERIFY(w.dataPage()->histogramTotal() == w.dataPage()->counts()->text(1, 1).toInt());  // every document counted
  const QString examples = w.dataPage()->examplesHtml();
  QVERIFY(examples.contains("Example 1"));
  QVERIFY(examples.mid(examples.indexOf("Example 1")).contains("#c8ecd0"));  // plain text: all trained

  // Plan for cpu:2, changed from the Plan page's own controls.
  w.showPage(MainWindow::PlanIndex);
  auto* plan = w.planPage();
  plan->findChild<QComboBox*>("planSchedule")->setCurrentText("1f1b");
  auto* devices = plan->findChild<QLineEdit*>("planDevices");
  devices->selectAll();
  QTest::keyClicks(devices, "cpu:2");
  plan->findChild<QSpinBox*>("planMicroBatches")->setValue(4);
  QTRY_VERIFY_WITH_TIMEOUT(!plan->busy() && plan->gantt()->rowCount() == 2 && plan->links()->rowCount() == 2, 20000);
  QVERIFY2(plan->summary().contains("bubble ratio"), qPrintable(plan->summary()));
  QVERIFY2(plan->summary().contains("Layers per stage: <b>") && plan->summary().contains("cpu:1 ×1"), qPrintable(plan->summary()));
  QCOMPARE(project->config().parallel.devices, std::string("cpu:2"));
  QVERIFY(std::any_of(plan->gantt()->bars().begin(), plan->gantt()->bars().end(), [](const GanttBar& b) { return b.kind == BarKind::Backward && b.row == 1; }));
  QVERIFY2(plan->summary().contains("Largest fit: no device has a capacity"), qPrintable(plan->summary()));
  // What-if beside the plan (planned off the GUI thread), then the plan's choices kept in the project.
  auto* whatIf = plan->findChild<QLineEdit*>("planWhatIf");
  whatIf->setText("seq_len=32 devices=+2");
  QTest::mouseClick(plan->findChild<QPushButton*>("planAsk"), Qt::LeftButton);
  QTRY_VERIFY_WITH_TIMEOUT(!plan->askingWhatIf() && plan->whatIfAnswer().contains("tokens/s"), 20000);
  QVERIFY2(plan->whatIfAnswer().contains("data.seq_len: ") && plan->whatIfAnswer().contains("parallel.devices: cpu:2 -&gt; cpu:4"),
           qPrintable(plan->whatIfAnswer()));
  QCOMPARE(project->config().parallel.partition, std::string("auto"));
  QTest::mouseClick(plan->findChild<QPushButton*>("planKeep"), Qt::LeftButton);
  QVERIFY2(project->config().parallel.partition != "auto", project->config().parallel.partition.c_str());
  QCOMPARE(project->config().parallel.schedule, std::string("1f1b"));
  QCOMPARE(project->config().parallel.micro_batches, int64_t{4});
  QTRY_VERIFY_WITH_TIMEOUT(!plan->busy() && plan->summary().contains("Layers per stage"), 20000);
  QVERIFY(w.isWindowModified());

  // Train: start from the button, see points arrive, stop.
  w.showPage(MainWindow::TrainIndex);
  auto* train = w.trainPage();
  LatencyProbe probe;
  probe.start();
  QTest::mouseClick(train->findChild<QPushButton*>("startButton"), Qt::LeftButton);
  QVERIFY2(train->isLive(), qPrintable(train->errorText()));
  QVERIFY(!w.isWindowModified());  // saved before it started
  QVERIFY(train->copyCliCommand().contains("train"));
  QVERIFY(train->copyCliCommand().contains("p.lorapipe.json"));
  track(train);
  QTRY_VERIFY_WITH_TIMEOUT(train->lossChart()->rawPoints(0) > 0, 60000);
  const int64_t run1 = train->runId();
  QVERIFY(run1 > 0);
  QTest::mouseClick(train->findChild<QPushButton*>("stopButton"), Qt::LeftButton);
  QTRY_VERIFY_WITH_TIMEOUT(!train->isLive(), 60000);
  QVERIFY2(train->statusText().contains("stopped"), qPrintable(train->statusText()));
  QVERIFY(train->errorText().isEmpty());
  const int stopped_at = train->stepPoints();
  QVERIFY(stopped_at > 0 && stopped_at < 120);

  // Runs: the run is there, stopped; resume it to the end from the Runs page.
  auto* runs = w.runsPage();
  w.showPage(MainWindow::RunsIndex);
  QCOMPARE(runStatus(runs, run1), QString("stopped"));
  runs->selectRuns({run1});
  auto* resume = runs->findChild<QPushButton*>("runsResumeButton");
  QVERIFY(resume->isEnabled());
  QTest::mouseClick(resume, Qt::LeftButton);
  QCOMPARE(w.currentPage(), MainWindow::TrainIndex);
  QVERIFY(train->isLive());
  track(train);
  QVERIFY(train->copyCliCommand().contains(QStringLiteral("resume %1").arg(run1)));
  QTRY_VERIFY_WITH_TIMEOUT(!train->isLive(), 120000);
  QVERIFY2(train->statusText().contains("completed"), qPrintable(train->statusText()));
  // The curve is whole: the history before the stop from the database, then the resumed steps.
  QTRY_COMPARE_WITH_TIMEOUT(train->stepPoints(), 120, 10000);
  QCOMPARE(train->lossChart()->rawPoints(0), 120);
  QVERIFY(train->measuredTimeline()->rowCount() == 2 && !train->measuredTimeline()->bars().empty());  // a traced step
  probe.stop();
  qInfo("event-loop latency while training: p50 %.1f ms, p99 %.1f ms, max %.1f ms over %zu ticks", probe.percentile(0.5),
        probe.percentile(0.99), probe.percentile(1.0), probe.samples());
  QVERIFY(probe.samples() > 100);
  QVERIFY2(probe.percentile(0.99) < 100, qPrintable(QString("p99 latency %1 ms").arg(probe.percentile(0.99))));
  QCOMPARE(runStatus(runs, run1), QString("completed"));

  // A second run (fewer steps, one device), compared with the first.
  QVERIFY(project->setField("run.steps", 30));
  QVERIFY(project->setField("parallel.devices", "cpu"));
  QVERIFY(project->setField("parallel.schedule", "single"));
  QVERIFY(project->setField("run.output_dir", tmp_.filePath("out2")));
  QVERIFY(train->start());
  track(train);
  QTRY_VERIFY_WITH_TIMEOUT(!train->isLive(), 120000);
  const int64_t run2 = train->runId();
  QVERIFY(run2 > run1);
  QCOMPARE(runStatus(runs, run2), QString("completed"));
  runs->selectRuns({run1, run2});
  QCOMPARE(runs->selectedRuns().size(), 2);
  QVERIFY(runs->findChild<QPushButton*>("compareButton")->isEnabled());
  runs->compareSelected();
  QTRY_COMPARE_WITH_TIMEOUT(runs->comparisons(), 1, 20000);
  QCOMPARE(runs->overlay()->curveCount(), 2);
  bool steps_differ = false;
  for (int r = 0; r < runs->diff()->rowCount(); ++r) steps_differ |= runs->diff()->text(r, 0) == "run.steps" && runs->diff()->text(r, 1) == "120";
  QVERIFY(steps_differ);

  // Try: the base model and the adapter side by side; export the adapter.
  auto* tryPage = w.tryPage();
  tryPage->setAdapter(tmp_.filePath("out/adapter"));
  tryPage->setPrompt("Once upon a time");
  tryPage->generate();
  QVERIFY(tryPage->generating());
  QTRY_VERIFY_WITH_TIMEOUT(!tryPage->generating(), 60000);
  QVERIFY2(tryPage->baseText().contains("Lily"), qPrintable(tryPage->baseText()));  // stories260K's greedy story
  QVERIFY(!tryPage->adapterText().isEmpty());
  QVERIFY(!tryPage->adapterText().contains("error"));
  QVERIFY(tryPage->adapterText() != tryPage->baseText());
  tryPage->exportTo(tmp_.filePath("export"), "merged");
  QTRY_VERIFY_WITH_TIMEOUT(!tryPage->exporting(), 60000);
  QVERIFY2(QFile::exists(tmp_.filePath("export/config.json")), qPrintable(tryPage->exportStatus()));
  QVERIFY(QFile::exists(tmp_.filePath("export/model.safetensors")));

  // Delete the second run: its row and its checkpoints; the first run's stay.
  const QString ckpt2 = tmp_.filePath(QStringLiteral("out2/checkpoints/run-%1").arg(run2));
  const QString ckpt1 = tmp_.filePath(QStringLiteral("out/checkpoints/run-%1").arg(run1));
  QVERIFY(QFile::exists(ckpt2) && QFile::exists(ckpt1));
  runs->deleteRun(run2, true);
  QTRY_COMPARE_WITH_TIMEOUT(runs->deletions(), 1, 20000);
  QCOMPARE(runStatus(runs, run2), QString("missing"));
  QVERIFY(!QFile::exists(ckpt2));
  QVERIFY(QFile::exists(ckpt1));
  QCOMPARE(runStatus(runs, run1), QString("completed"));
  w.setCloseAnswer(MainWindow::Discard);
  w.close();
}

void GuiTest::failingRunsLeaveTheWindowWorking() {
  const QString data = dataDir();
  QString error;
  MainWindow w;
  w.show();
  QVERIFY2(w.openProject(fixture(), &error), qPrintable(error));
  auto* project = w.projectPage();
  auto* train = w.trainPage();
  // A model path that exists but is no model: the run's process fails, the window shows why.
  QVERIFY(project->setField("model.path", data + "/text/tinyshakespeare.txt"));
  project->validateNow();
  QVERIFY(train->start());
  track(train);
  QTRY_VERIFY_WITH_TIMEOUT(!train->isLive(), 60000);
  QVERIFY2(!train->errorText().isEmpty(), qPrintable(train->statusText()));
  QVERIFY2(train->errorText().contains("tinyshakespeare"), qPrintable(train->errorText()));
  // A path that does not exist is refused before anything starts, naming the field.
  QVERIFY(project->setField("model.path", data + "/no/such/model"));
  QVERIFY(!train->start());
  QVERIFY2(train->errorText().contains("model.path"), qPrintable(train->errorText()));
  QVERIFY(!project->fieldError("model.path").isEmpty());
  // SIGKILL in the middle of a run: the window stays, the error is shown, the run reads as crashed.
  QVERIFY(project->setField("model.path", data + "/models/stories260K/hf"));
  QVERIFY(project->setField("run.checkpoint_interval", 5));
  QVERIFY(train->start());
  track(train);
  QTRY_VERIFY_WITH_TIMEOUT(train->lossChart()->rawPoints(0) >= 8, 60000);  // past its first checkpoint
  const int64_t run = train->runId();
  train->process()->kill();
  QTRY_VERIFY_WITH_TIMEOUT(!train->isLive(), 30000);
  QVERIFY2(train->errorText().contains("ended without finishing"), qPrintable(train->errorText()));
  QVERIFY(w.isVisible());
  QVERIFY(train->findChild<QPushButton*>("startButton")->isEnabled());
  auto* runs = w.runsPage();
  QCOMPARE(runStatus(runs, run), QString("crashed"));
  // The crashed run resumes from the Runs page, from its last checkpoint, and stops again cleanly.
  runs->selectRuns({run});
  auto* resume = runs->findChild<QPushButton*>("runsResumeButton");
  QVERIFY(resume->isEnabled());
  QTest::mouseClick(resume, Qt::LeftButton);
  QVERIFY(train->isLive());
  track(train);
  QVERIFY(train->errorText().isEmpty());
  QTRY_VERIFY_WITH_TIMEOUT(train->stepPoints() > 10, 60000);
  train->stop();
  QTRY_VERIFY_WITH_TIMEOUT(!train->isLive(), 60000);
  QVERIFY2(train->statusText().contains("stopped"), qPrintable(train->statusText()));
  QCOMPARE(runStatus(runs, run), QString("stopped"));
  w.setCloseAnswer(MainWindow::Discard);
  w.close();
}

void GuiTest::runLeftRunningIsFollowedByTheNextWindow() {
  qint64 pid = 0;
  int64_t run = 0;
  QString error;
  {
    MainWindow w;
    w.show();
    QVERIFY2(w.openProject(fixture(), &error), qPrintable(error));
    QVERIFY(w.trainPage()->start());
    track(w.trainPage());
    QTRY_VERIFY_WITH_TIMEOUT(w.trainPage()->lossChart()->rawPoints(0) > 0, 60000);
    pid = w.trainPage()->process()->pid();
    run = w.trainPage()->runId();
    w.setCloseAnswer(MainWindow::LeaveRunning);
    QVERIFY(w.close());
  }
  QVERIFY(processAlive(pid));  // left running
  MainWindow w2;
  w2.show();
  QVERIFY(w2.openProject(fixture(), &error));
  w2.followLiveRun();
  QTRY_VERIFY_WITH_TIMEOUT(w2.trainPage()->isLive() && w2.trainPage()->runId() == run, 20000);
  QCOMPARE(w2.currentPage(), MainWindow::TrainIndex);
  QTRY_VERIFY_WITH_TIMEOUT(w2.trainPage()->lossChart()->rawPoints(0) > 0, 20000);
  w2.trainPage()->stop();
  QTRY_VERIFY_WITH_TIMEOUT(!w2.trainPage()->isLive(), 60000);
  QTRY_VERIFY_WITH_TIMEOUT(!processAlive(pid), 10000);
  QCOMPARE(runStatus(w2.runsPage(), run), QString("stopped"));
  w2.setCloseAnswer(MainWindow::Discard);
  w2.close();

  // A run started from a terminal has no event stream the window knows: it is followed through the
  // run database (curves as the recorder writes them), and can be stopped from the window.
  QProcess cli;
  cli.setProgram(qEnvironmentVariable("LORAPIPE_CLI"));
  cli.setArguments({"train", fixture()});
  cli.setStandardOutputFile(QProcess::nullDevice());
  cli.setStandardErrorFile(QProcess::nullDevice());
  cli.start();
  QVERIFY(cli.waitForStarted(10000));
  pids_ << cli.processId();
  MainWindow w3;
  w3.show();
  QVERIFY(w3.openProject(fixture(), &error));
  int64_t terminal_run = 0;
  QVERIFY(QTest::qWaitFor([&] {
    auto* runs = w3.runsPage();
    runs->refresh();
    if (!QTest::qWaitFor([&] { return !runs->busy(); }, 5000)) return false;
    for (int r = 0; r < runs->runs()->rowCount(); ++r)
      if (const auto* o = runs->runs()->runAt(r); o && o->record.pid == cli.processId() && o->record.last_step > 0)
        terminal_run = o->record.id;
    return terminal_run > 0;
  }, 60000));
  w3.followLiveRun();
  QTRY_VERIFY_WITH_TIMEOUT(w3.trainPage()->isLive() && w3.trainPage()->runId() == terminal_run, 20000);
  QVERIFY2(w3.trainPage()->statusText().contains("from the database"), qPrintable(w3.trainPage()->statusText()));
  QTRY_VERIFY_WITH_TIMEOUT(w3.trainPage()->stepPoints() > 0, 20000);
  w3.trainPage()->stop();
  QVERIFY(cli.waitForFinished(60000));
  QTRY_VERIFY_WITH_TIMEOUT(!w3.trainPage()->isLive(), 20000);
  QCOMPARE(runStatus(w3.runsPage(), terminal_run), QString("stopped"));
  w3.setCloseAnswer(MainWindow::Discard);
  w3.close();
}

int main(int argc, char** argv) {
  // Settings, event streams and anything else the GUI writes go to a throwaway home.
  QTemporaryDir home;
  qputenv("XDG_CONFIG_HOME", (home.path() + "/config").toUtf8());
  qputenv("XDG_STATE_HOME", (home.path() + "/state").toUtf8());
  qputenv("XDG_DATA_HOME", (home.path() + "/data").toUtf8());
  qputenv("XDG_CACHE_HOME", (home.path() + "/cache").toUtf8());
  if (qEnvironmentVariableIsEmpty("QT_QPA_PLATFORM")) qputenv("QT_QPA_PLATFORM", "offscreen");
  if (qEnvironmentVariableIsEmpty("LORAPIPE_CLI")) qputenv("LORAPIPE_CLI", LORAPIPE_CLI_PATH);
  QApplication app(argc, argv);
  QApplication::setOrganizationName("lorapipe-tests");
  GuiTest t;
  return QTest::qExec(&t, argc, argv);
}

#include "test_gui.moc"
