// Main window: see main_window.h.
#include "ui/main_window.h"

#include <QAction>
#include <QApplication>
#include <QCloseEvent>
#include <QDir>
#include <QElapsedTimer>
#include <QFileDialog>
#include <QFileInfo>
#include <QHBoxLayout>
#include <QMenuBar>
#include <QMessageBox>
#include <QPushButton>
#include <QSettings>
#include <QStatusBar>
#include <QThreadPool>

#include "core/base/file_io.h"
#include "core/engine/build_info.h"
#include "core/engine/run_queries.h"
#include "core/engine/run_session.h"
#include "ui/data_page.h"
#include "ui/models.h"
#include "ui/plan_page.h"
#include "ui/project_page.h"
#include "ui/run_process.h"
#include "ui/runs_page.h"
#include "ui/train_page.h"
#include "ui/try_page.h"

// The Qt resources (icon) live in this static library: registered once before the first window.
static void initResources() { Q_INIT_RESOURCE(lorapipe); }

namespace lorapipe::ui {

namespace {

const char* kPageNames[] = {"Project", "Data", "Plan", "Train", "Runs", "Try & export"};
const char* kPageIcons[] = {"document-properties", "x-office-spreadsheet", "view-calendar-timeline", "media-playback-start",
                            "view-list-details", "mail-send"};
const char* kPageFiles[] = {"project", "data", "plan", "train", "runs", "try"};

}  // namespace

MainWindow::MainWindow(QWidget* parent) : QMainWindow(parent) {
  initResources();
  setWindowIcon(QIcon(":/lorapipe/lorapipe.svg"));
  auto* central = new QWidget;
  auto* h = new QHBoxLayout(central);
  h->setContentsMargins(0, 0, 0, 0);
  h->setSpacing(0);
  sidebar_ = new QListWidget;
  sidebar_->setObjectName("sidebar");
  sidebar_->setFixedWidth(150);
  sidebar_->setIconSize(QSize(22, 22));
  stack_ = new QStackedWidget;
  project_ = new ProjectPage;
  data_ = new DataPage;
  plan_ = new PlanPage;
  train_ = new TrainPage;
  runs_ = new RunsPage;
  try_ = new TryPage;
  QWidget* pages[] = {project_, data_, plan_, train_, runs_, try_};
  for (int i = 0; i < PageCount; ++i) {
    auto* item = new QListWidgetItem(QIcon::fromTheme(kPageIcons[i]), tr(kPageNames[i]));
    item->setSizeHint(QSize(140, 36));
    sidebar_->addItem(item);
    stack_->addWidget(pages[i]);
  }
  h->addWidget(sidebar_);
  h->addWidget(stack_, 1);
  setCentralWidget(central);
  connect(sidebar_, &QListWidget::currentRowChanged, stack_, &QStackedWidget::setCurrentIndex);
  sidebar_->setCurrentRow(0);
  connect(project_, &ProjectPage::edited, this, [this] { setModified(true); });
  connect(project_, &ProjectPage::configChanged, this, &MainWindow::onConfigChanged);
  connect(plan_, &PlanPage::fieldEdited, this, [this](const QString& path, const QVariant& v) {
    project_->setField(path, v);
    project_->validateNow();
  });
  train_->setProjectSaver([this](QString* why) -> QString {
    project_->validateNow();
    if (!project_->problems().isEmpty()) {
      *why = tr("Cannot start: the project has problems (see the Project page):\n%1").arg(project_->problems().join('\n'));
      return {};
    }
    if (saveProject()) return file_;
    *why = tr("Cannot start: the project is not saved.");
    return {};
  });
  connect(train_, &TrainPage::runChanged, this, [this](int64_t, const QString& status) {
    runs_->refresh();
    if (status != "running") statusBar()->showMessage(tr("Run ended: %1").arg(train_->statusText()), 10000);
  });
  connect(runs_, &RunsPage::showRunRequested, this, [this](int64_t run) {
    train_->showRun(run);
    showPage(TrainIndex);
  });
  connect(runs_, &RunsPage::resumeRequested, this, [this](int64_t run) {
    if (train_->resumeRun(run)) showPage(TrainIndex);
  });
  connect(runs_, &RunsPage::loaded, this, [this] {
    // The newest finished run's adapter is what Try offers first.
    const auto* model = runs_->runs();
    for (int r = 0; r < model->rowCount(); ++r)
      if (const auto* o = model->runAt(r); o && o->record.status == "completed") {
        try_->offerAdapter(QString::fromStdString(o->record.output_dir + "/adapter"));
        break;
      }
  });
  buildMenus();
  resize(1280, 800);
  newProject();
}

void MainWindow::buildMenus() {
  auto* file = menuBar()->addMenu(tr("&File"));
  file->addAction(QIcon::fromTheme("document-new"), tr("&New project"), QKeySequence::New, this, [this] {
    if (confirmDiscard()) newProject();
  });
  file->addAction(QIcon::fromTheme("document-open"), tr("&Open…"), QKeySequence::Open, this, [this] {
    if (!confirmDiscard()) return;
    const QString f = QFileDialog::getOpenFileName(this, tr("Open project"), QFileInfo(file_).absolutePath(),
                                                   tr("lorapipe projects (*.json);;All files (*)"));
    if (!f.isEmpty()) openProject(f);
  });
  recent_ = file->addMenu(tr("Open &recent"));
  rebuildRecentMenu();
  file->addAction(QIcon::fromTheme("document-save"), tr("&Save"), QKeySequence::Save, this, [this] { saveProject(); });
  file->addAction(QIcon::fromTheme("document-save-as"), tr("Save &as…"), QKeySequence::SaveAs, this, [this] {
    const QString f = QFileDialog::getSaveFileName(this, tr("Save project as"), file_.isEmpty() ? QDir::homePath() + "/project.lorapipe.json" : file_,
                                                   tr("lorapipe projects (*.json)"));
    if (!f.isEmpty()) saveProjectAs(f);
  });
  file->addSeparator();
  file->addAction(QIcon::fromTheme("application-exit"), tr("&Quit"), QKeySequence::Quit, this, &QWidget::close);
  auto* view = menuBar()->addMenu(tr("&View"));
  for (int i = 0; i < PageCount; ++i)
    view->addAction(tr(kPageNames[i]), QKeySequence(Qt::CTRL | (Qt::Key_1 + i)), this, [this, i] { showPage(static_cast<Page>(i)); });
  auto* run = menuBar()->addMenu(tr("&Run"));
  run->addAction(QIcon::fromTheme("media-playback-start"), tr("&Start training"), QKeySequence(Qt::Key_F5), this, [this] {
    showPage(TrainIndex);
    train_->start();
  });
  run->addAction(QIcon::fromTheme("media-playback-stop"), tr("S&top (checkpoint)"), QKeySequence(Qt::SHIFT | Qt::Key_F5), this, [this] { train_->stop(); });
  auto* help = menuBar()->addMenu(tr("&Help"));
  help->addAction(tr("&About lorapipe"), this, [this] {
    QMessageBox::about(this, tr("About lorapipe"),
                       tr("<h3>lorapipe %1</h3><p>LoRA fine-tuning of LLMs, pipelined across consumer GPUs with weights streamed "
                          "from host RAM.</p><pre>%2</pre><p>Licensed under the GNU General Public License, version 3 or later "
                          "(it uses Qt Charts, GPL-3).</p>")
                           .arg(QString::fromStdString(lorapipe_version()),
                                QString::fromStdString(build_info_text(describe_build())).toHtmlEscaped()));
  });
}

void MainWindow::showPage(Page p) { sidebar_->setCurrentRow(p); }
MainWindow::Page MainWindow::currentPage() const { return static_cast<Page>(stack_->currentIndex()); }

void MainWindow::updateTitle() {
  const QString name = QString::fromStdString(project_->config().name);
  const QString where = file_.isEmpty() ? tr("unsaved") : QFileInfo(file_).fileName();
  setWindowTitle(QStringLiteral("%1 — %2[*] — lorapipe").arg(name, where));
  setWindowModified(modified_);
}

void MainWindow::setModified(bool m) {
  modified_ = m;
  updateTitle();
}

void MainWindow::newProject() {
  file_.clear();
  project_->setProject(project_config{}, {});
  setModified(false);
  showPage(ProjectIndex);
}

bool MainWindow::openProject(const QString& file, QString* error) {
  auto cfg = load_project(file.toStdString());
  if (!cfg) {
    if (error) *error = QString::fromStdString(cfg.message());
    else QMessageBox::warning(this, tr("Cannot open project"), QString::fromStdString(cfg.message()));
    return false;
  }
  file_ = QFileInfo(file).absoluteFilePath();
  project_->setProject(*cfg, file_);
  setModified(false);
  addRecent(file_);
  // Try answers the project's sample prompt, as a chat turn when the project trains on chat data.
  try_->setPrompt(QString::fromStdString(cfg->run.sample_prompt));
  const auto& data = cfg->data;
  try_->setChat(data.format == "chat" || data.format == "alpaca" ||
                (data.format == "auto" && QString::fromStdString(data.train).endsWith(".jsonl")));
  statusBar()->showMessage(tr("Opened %1").arg(file_), 5000);
  return true;
}

bool MainWindow::saveProject() {
  if (file_.isEmpty()) {
    const QString f = QFileDialog::getSaveFileName(this, tr("Save project"), QDir::homePath() + "/project.lorapipe.json", tr("lorapipe projects (*.json)"));
    return !f.isEmpty() && saveProjectAs(f);
  }
  if (!modified_ && QFileInfo::exists(file_)) return true;
  return saveProjectAs(file_);
}

bool MainWindow::saveProjectAs(const QString& file) {
  const QString abs = QFileInfo(file).absoluteFilePath();
  project_->validateNow();  // the form as typed, not as of the last debounce
  if (!project_->parses()) {
    QMessageBox::warning(this, tr("Cannot save project"),
                         tr("Some fields do not parse:\n%1").arg(project_->problems().join('\n')));
    return false;
  }
  project_config cfg = project_->config();
  // Relative paths resolve against the project file's folder: keep them only if it stays the same.
  if (QFileInfo(abs).absolutePath().toStdString() != cfg.base_dir.string()) cfg = with_absolute_paths(cfg);
  auto st = write_file_atomic(abs.toStdString(), project_to_json(cfg));
  if (!st) {
    QMessageBox::warning(this, tr("Cannot save project"), QString::fromStdString(st.message()));
    return false;
  }
  file_ = abs;
  cfg.base_dir = QFileInfo(abs).absolutePath().toStdString();
  project_->setProject(cfg, file_);
  setModified(false);
  addRecent(file_);
  statusBar()->showMessage(tr("Saved %1").arg(file_), 5000);
  return true;
}

void MainWindow::addRecent(const QString& file) {
  QSettings s;
  QStringList files = s.value("recentProjects").toStringList();
  files.removeAll(file);
  files.prepend(file);
  while (files.size() > 8) files.removeLast();
  s.setValue("recentProjects", files);
  rebuildRecentMenu();
}

void MainWindow::rebuildRecentMenu() {
  recent_->clear();
  const QStringList files = QSettings().value("recentProjects").toStringList();
  for (const QString& f : files)
    recent_->addAction(f, this, [this, f] {
      if (confirmDiscard()) openProject(f);
    });
  recent_->setEnabled(!files.isEmpty());
}

void MainWindow::onConfigChanged(const project_config& cfg) {
  const bool valid = project_->problems().isEmpty();
  data_->setProject(cfg, valid);
  plan_->setProject(cfg, valid);
  const QString db = QString::fromStdString(resolve_database("", &cfg).string());
  runs_->setDatabase(db);
  train_->setDatabase(db);
  train_->setProjectFile(file_);
  if (!cfg.model.path.empty())
    try_->setModel(QString::fromStdString(cfg.resolve(cfg.model.path).string()),
                   cfg.tokenizer.path.empty() ? QString() : QString::fromStdString(cfg.resolve(cfg.tokenizer.path).string()),
                   QString::fromStdString(cfg.model.dtype));
  updateTitle();
}

bool MainWindow::confirmDiscard() {
  if (!modified_) return true;
  if (close_answer_ == Discard) return true;
  const auto b = QMessageBox::question(this, tr("Unsaved changes"), tr("The project has unsaved changes. Save them?"),
                                       QMessageBox::Save | QMessageBox::Discard | QMessageBox::Cancel);
  if (b == QMessageBox::Save) return saveProject();
  return b == QMessageBox::Discard;
}

void MainWindow::closeEvent(QCloseEvent* e) {
  if (!confirmDiscard()) {
    e->ignore();
    return;
  }
  if (train_->isLive()) {
    CloseAnswer a = close_answer_ == Discard ? LeaveRunning : close_answer_;
    if (a == Ask) {
      QMessageBox box(QMessageBox::Question, tr("A run is training"),
                      tr("Run %1 is still training. Stop it (it writes a checkpoint and can be resumed) or leave it running "
                         "in the background? lorapipe follows it again when you reopen.").arg(train_->runId()),
                      QMessageBox::Cancel, this);
      auto* stop = box.addButton(tr("Stop the run"), QMessageBox::DestructiveRole);
      auto* leave = box.addButton(tr("Leave it running"), QMessageBox::AcceptRole);
      box.exec();
      a = box.clickedButton() == stop ? StopRun : box.clickedButton() == leave ? LeaveRunning : Ask;
    }
    if (a == Ask) {
      e->ignore();
      return;
    }
    if (a == StopRun) train_->stop();
    else train_->process()->detach();
  }
  try_->stop();  // a generation ends at its next token
  hide();
  QThreadPool::globalInstance()->waitForDone(30000);  // background reads finish before the pages go
  e->accept();
}

void MainWindow::followLiveRun() {
  auto* model = runs_->runs();
  auto check = [this, model] {
    for (int r = 0; r < model->rowCount(); ++r)
      if (const auto* o = model->runAt(r); o && live_status(o->record) == "running" &&
                                           process_liveness(o->record.process()) == liveness::alive) {
        train_->showRun(o->record.id);
        showPage(TrainIndex);
        statusBar()->showMessage(tr("Following run %1, which is still training").arg(o->record.id), 10000);
        return;
      }
  };
  auto conn = std::make_shared<QMetaObject::Connection>();
  *conn = connect(runs_, &RunsPage::loaded, this, [check, conn] {
    check();
    QObject::disconnect(*conn);
  });
  runs_->refresh();
}

bool MainWindow::saveScreenshots(const QString& dir, int64_t run) {
  QDir().mkpath(dir);
  auto settle = [this](int ms) {
    QElapsedTimer t;
    t.start();
    while (t.elapsed() < ms) {
      QApplication::processEvents(QEventLoop::AllEvents, 50);
      if (t.elapsed() > 600 && !data_->busy() && !plan_->busy() && !plan_->askingWhatIf() && !runs_->busy() && !try_->generating() &&
          QThreadPool::globalInstance()->activeThreadCount() == 0)
        break;
    }
  };
  bool ok = true;
  for (int i = 0; i < PageCount; ++i) {
    showPage(static_cast<Page>(i));
    if (i == TrainIndex && run > 0) train_->showRun(run);
    if (i == RunsIndex) {
      runs_->refresh();
      settle(20000);
      QList<int64_t> ids;
      for (int r = 0; r < runs_->runs()->rowCount() && ids.size() < 2; ++r) ids << runs_->runs()->runAt(r)->record.id;
      runs_->selectRuns(ids);
      runs_->compareSelected();
    }
    if (i == TryIndex) try_->generate();
    if (i == PlanIndex) {
      settle(20000);  // the what-if compares with the plan on screen
      plan_->askWhatIf(QStringLiteral("seq_len=256 devices=+2"));
    }
    settle(30000);
    QApplication::processEvents();
    QImage shot = grab().toImage();
    const QString path = QStringLiteral("%1/%2.png").arg(dir, kPageFiles[i]);
    ok = shot.save(path, "PNG", 9) && ok;
  }
  return ok;
}

}  // namespace lorapipe::ui
