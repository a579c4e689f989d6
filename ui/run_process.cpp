// Run processes: see run_process.h.
#include "ui/run_process.h"

#include <cerrno>
#include <csignal>

#include <QCoreApplication>
#include <QDateTime>
#include <QDir>
#include <QFile>
#include <QFileInfo>
#include <QProcess>
#include <QStandardPaths>

#include "core/engine/event_json.h"

namespace lorapipe::ui {

QString cliProgram() {
  const QString env = qEnvironmentVariable("LORAPIPE_CLI");
  if (!env.isEmpty()) return env;
  const QString sibling = QCoreApplication::applicationDirPath() + "/lorapipe-cli";
  if (QFileInfo(sibling).isExecutable()) return sibling;
  return QStandardPaths::findExecutable("lorapipe-cli");
}

QString shellCommand(const QString& program, const QStringList& args) {
  QStringList parts;
  for (const QString& a : QStringList{program} + args) {
    static const QString safe = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:=,+@";
    bool plain = !a.isEmpty();
    for (QChar c : a) plain = plain && safe.contains(c);
    parts << (plain ? a : "'" + QString(a).replace("'", "'\\''") + "'");
  }
  return parts.join(' ');
}

QString RunProcess::eventsDir() {
  const QString base = qEnvironmentVariable("XDG_STATE_HOME", QDir::homePath() + "/.local/state");
  return base + "/lorapipe/events";
}

RunProcess::RunProcess(QObject* parent) : QObject(parent) {
  timer_.setInterval(100);
  connect(&timer_, &QTimer::timeout, this, &RunProcess::poll);
}

RunProcess::~RunProcess() = default;  // a live process keeps running: closing asks first (MainWindow)

bool RunProcess::start(const QStringList& args, QString* error) {
  if (isRunning()) {
    *error = tr("a run is already going");
    return false;
  }
  const QString program = cliProgram();
  if (program.isEmpty()) {
    *error = tr("lorapipe-cli not found (next to lorapipe, in PATH or $LORAPIPE_CLI)");
    return false;
  }
  if (!QDir().mkpath(eventsDir())) {
    *error = tr("cannot create %1 (where the run's event stream is written)").arg(eventsDir());
    return false;
  }
  const QString staging = QStringLiteral("%1/starting-%2-%3.jsonl").arg(eventsDir()).arg(QCoreApplication::applicationPid()).arg(QDateTime::currentMSecsSinceEpoch());
  QProcess p;
  p.setProgram(program);
  p.setArguments(args);
  p.setStandardOutputFile(QProcess::nullDevice());
  p.setStandardErrorFile(staging);
  qint64 pid = 0;
  if (!p.startDetached(&pid)) {
    *error = tr("cannot start %1: %2").arg(program, p.errorString());
    QFile::remove(staging);
    return false;
  }
  const QString final = QStringLiteral("%1/%2.jsonl").arg(eventsDir()).arg(pid);
  QFile::remove(final);
  path_ = QFile::rename(staging, final) ? final : staging;  // the child keeps writing through its descriptor
  pid_ = pid, offset_ = 0, partial_.clear(), last_lines_.clear(), finished_seen_ = false;
  timer_.start();
  return true;
}

bool RunProcess::attach(qint64 pid) {
  const QString path = QStringLiteral("%1/%2.jsonl").arg(eventsDir()).arg(pid);
  if (isRunning() || !QFileInfo::exists(path)) return false;
  path_ = path, pid_ = pid, offset_ = 0, partial_.clear(), last_lines_.clear(), finished_seen_ = false;
  timer_.start();
  return true;
}

void RunProcess::stop() {
  if (pid_ > 0) ::kill(static_cast<pid_t>(pid_), SIGTERM);
}

void RunProcess::kill() {
  if (pid_ > 0) ::kill(static_cast<pid_t>(pid_), SIGKILL);
}

void RunProcess::detach() {
  timer_.stop();
  pid_ = 0;
}

void RunProcess::readNew() {
  QFile f(path_);
  if (!f.open(QIODevice::ReadOnly)) return;
  if (!f.seek(offset_)) return;
  // At most 256 KiB per tick: following a long run's stream catches up without freezing the window.
  const QByteArray bytes = f.read(256 * 1024);
  offset_ += bytes.size();
  partial_ += bytes;
  qsizetype nl;
  while ((nl = partial_.indexOf('\n')) >= 0) {
    const QByteArray line = partial_.left(nl).trimmed();
    partial_.remove(0, nl + 1);
    if (line.isEmpty()) continue;
    if (line.startsWith('{')) {
      auto e = event_from_json(line.toStdString());
      if (e) {
        if (std::holds_alternative<run_finished_event>(*e)) finished_seen_ = true;
        emit eventReceived(*e);
        continue;
      }
    }
    const QString text = QString::fromUtf8(line);
    last_lines_ << text;
    if (last_lines_.size() > 8) last_lines_.removeFirst();
    emit logLine(text);
  }
}

namespace {

// Gone, or a zombie nobody has reaped yet (a container's init may never reap it).
bool processGone(qint64 pid) {
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  QFile stat(QStringLiteral("/proc/%1/stat").arg(pid));
  if (!stat.open(QIODevice::ReadOnly)) return false;
  const QByteArray s = stat.readAll();
  const qsizetype close = s.lastIndexOf(')');
  return close > 0 && close + 2 < s.size() && s[close + 2] == 'Z';
}

}  // namespace

void RunProcess::poll() {
  readNew();
  if (pid_ <= 0) return;
  if (!processGone(pid_)) return;
  for (qint64 before = -1; before != offset_;) {  // everything it wrote before it went
    before = offset_;
    readNew();
  }
  timer_.stop();
  pid_ = 0;
  QFile::remove(path_);  // the run database keeps what matters
  if (finished_seen_) {
    emit ended({});
    return;
  }
  QString why = last_lines_.isEmpty()
                    ? tr("the training process ended without finishing the run and without a word (killed, out of memory or crashed)")
                    : tr("the training process ended without finishing the run; its last words:\n%1").arg(last_lines_.join('\n'));
  emit ended(why);
}

}  // namespace lorapipe::ui
