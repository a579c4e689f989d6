// Long work off the GUI thread: runAsync runs `work` on Qt's thread pool and calls `done` with its
// result on the GUI thread, unless `context` was destroyed meanwhile. `work` must not touch widgets
// or capture `context`; it gets copies of what it needs.
#pragma once

#include <type_traits>
#include <utility>

#include <QFutureWatcher>
#include <QObject>
#include <QThreadPool>
#include <QtConcurrent/QtConcurrentRun>

namespace lorapipe::ui {

// `pool`: long work (generation, export) gets its own pool so that it never queues the short reads.
template <class Work, class Done>
void runAsync(QObject* context, Work work, Done done, QThreadPool* pool = QThreadPool::globalInstance()) {
  using R = std::invoke_result_t<Work>;
  auto* watcher = new QFutureWatcher<R>(context);
  QObject::connect(watcher, &QFutureWatcher<R>::finished, context, [watcher, done = std::move(done)]() mutable {
    done(watcher->result());
    watcher->deleteLater();
  });
  watcher->setFuture(QtConcurrent::run(pool, std::move(work)));
}

}  // namespace lorapipe::ui
