// lorapipe: the desktop application (Qt 6 Widgets; all of it in ui/). Usage:
//   lorapipe [project.json]
//   lorapipe --screenshots DIR [--run ID] project.json   (renders every page to DIR/<page>.png, then quits)
#include <QApplication>
#include <QCommandLineParser>
#include <QIcon>
#include <QTimer>

#include "core/engine/build_info.h"
#include "ui/main_window.h"

int main(int argc, char** argv) {
  QApplication app(argc, argv);
  QApplication::setApplicationName("lorapipe");
  QApplication::setOrganizationName("lorapipe");
  QApplication::setApplicationVersion(QString::fromStdString(lorapipe::lorapipe_version()));
  QApplication::setDesktopFileName("io.github.lorapipe.lorapipe");
  QApplication::setWindowIcon(QIcon(":/lorapipe/lorapipe.svg"));
  QCommandLineParser args;
  args.setApplicationDescription("LoRA fine-tuning of LLMs, pipelined across consumer GPUs");
  args.addHelpOption();
  args.addVersionOption();
  args.addPositionalArgument("project", "Project file to open");
  QCommandLineOption shots("screenshots", "Render every page to DIR/<page>.png and quit", "DIR");
  QCommandLineOption run("run", "With --screenshots: the run shown on the Train page", "ID");
  args.addOption(shots);
  args.addOption(run);
  args.process(app);
  lorapipe::ui::MainWindow w;
  if (!args.positionalArguments().isEmpty() && !w.openProject(args.positionalArguments().front())) return 1;
  w.show();
  if (args.isSet(shots)) {
    int rc = 0;
    QTimer::singleShot(0, &w, [&] {
      rc = w.saveScreenshots(args.value(shots), args.value(run).toLongLong()) ? 0 : 1;
      w.setCloseAnswer(lorapipe::ui::MainWindow::Discard);
      w.close();
    });
    const int loop = app.exec();
    return rc != 0 ? rc : loop;
  }
  w.followLiveRun();
  return app.exec();
}
