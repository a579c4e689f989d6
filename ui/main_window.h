// The main window: a sidebar of pages (Project, Data, Plan, Train, Runs, Try & export), the project
// file (new / open / save / save-as, recent files, modified marker, confirm on close) and the wiring
// between pages. Closing while a run is live asks whether to stop it or leave it running; opening
// the window again finds a live run in the database and follows it.
#pragma once

#include <QListWidget>
#include <QMainWindow>
#include <QMenu>
#include <QStackedWidget>

#include "core/project/project.h"

namespace lorapipe::ui {

class DataPage;
class PlanPage;
class ProjectPage;
class RunsPage;
class TrainPage;
class TryPage;

class MainWindow : public QMainWindow {
  Q_OBJECT
 public:
  enum Page { ProjectIndex, DataIndex, PlanIndex, TrainIndex, RunsIndex, TryIndex, PageCount };
  explicit MainWindow(QWidget* parent = nullptr);
  // A failure is shown in a message box, or returned in *error when given.
  bool openProject(const QString& file, QString* error = nullptr);
  void newProject();
  bool saveProject();                  // Save As when the project has no file yet
  bool saveProjectAs(const QString& file);
  QString projectFile() const { return file_; }
  void showPage(Page p);
  Page currentPage() const;
  // Looks for a live run in the database and follows it (called at start-up).
  void followLiveRun();
  // Screenshot mode: every page, once its background work is done, as DIR/<page>.png.
  bool saveScreenshots(const QString& dir, int64_t run);

  ProjectPage* projectPage() const { return project_; }
  DataPage* dataPage() const { return data_; }
  PlanPage* planPage() const { return plan_; }
  TrainPage* trainPage() const { return train_; }
  RunsPage* runsPage() const { return runs_; }
  TryPage* tryPage() const { return try_; }
  // Test hook: answers the close questions instead of asking (0 = ask).
  enum CloseAnswer { Ask, StopRun, LeaveRunning, Discard };
  void setCloseAnswer(CloseAnswer a) { close_answer_ = a; }

 protected:
  void closeEvent(QCloseEvent* e) override;

 private:
  void buildMenus();
  void updateTitle();
  void setModified(bool m);
  void addRecent(const QString& file);
  void rebuildRecentMenu();
  void onConfigChanged(const project_config& cfg);
  bool confirmDiscard();
  QListWidget* sidebar_ = nullptr;
  QStackedWidget* stack_ = nullptr;
  ProjectPage* project_ = nullptr;
  DataPage* data_ = nullptr;
  PlanPage* plan_ = nullptr;
  TrainPage* train_ = nullptr;
  RunsPage* runs_ = nullptr;
  TryPage* try_ = nullptr;
  QMenu* recent_ = nullptr;
  QString file_;
  bool modified_ = false;
  CloseAnswer close_answer_ = Ask;
};

}  // namespace lorapipe::ui
