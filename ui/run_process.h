// A training run in its own process: `lorapipe-cli train|resume ... --json`, started detached (it
// outlives the window when the user leaves it running) with its stderr - the JSON-lines event
// stream - written to a file under $XDG_STATE_HOME/lorapipe/events/<pid>.jsonl, which this class
// tails and turns back into engine events. A crash, an OOM kill or a CUDA error ends the process,
// never the window: a process that is gone without a run_finished event is reported as failed, with
// the last lines it printed.
#pragma once

#include <QObject>
#include <QString>
#include <QStringList>
#include <QTimer>

#include "core/base/events.h"

namespace lorapipe::ui {

// The lorapipe-cli the GUI runs: $LORAPIPE_CLI, else next to this executable, else from PATH.
QString cliProgram();
// How a person would type `args` in a shell (copy as CLI command).
QString shellCommand(const QString& program, const QStringList& args);

class RunProcess : public QObject {
  Q_OBJECT
 public:
  explicit RunProcess(QObject* parent = nullptr);
  ~RunProcess() override;
  // Starts `cliProgram() args`; false (and `error` says why) when it cannot be started.
  bool start(const QStringList& args, QString* error);
  // Follows a run process started earlier (e.g. by a previous window) through its events file.
  bool attach(qint64 pid);
  bool isRunning() const { return pid_ > 0; }
  qint64 pid() const { return pid_; }
  QString eventsFile() const { return path_; }
  // SIGTERM: the CLI writes a checkpoint and records the run as stopped. `kill` sends SIGKILL.
  void stop();
  void kill();
  void detach();  // stop following; the process keeps running
  static QString eventsDir();

 signals:
  void eventReceived(const lorapipe::engine_event& e);
  void logLine(const QString& line);  // a line that is not an event (the CLI's messages)
  // The process is gone; `error` is empty when it ended with a run_finished event.
  void ended(const QString& error);

 private:
  void poll();
  void readNew();
  qint64 pid_ = 0;
  QString path_;
  qint64 offset_ = 0;
  QByteArray partial_;
  QStringList last_lines_;
  bool finished_seen_ = false;
  QTimer timer_;
};

}  // namespace lorapipe::ui
