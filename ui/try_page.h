// Try & export page: a prompt answered by the base model and by the model with the adapter side by
// side, streamed token by token (chat mode through the chat template; stop button), and export of
// the PEFT adapter or of a merged model with progress. One loaded model serves both sides (the
// adapter is switched on and off) and stays loaded between prompts; models load, generate and
// export on the page's own thread, off the GUI thread.
#pragma once

#include <memory>

#include <QCheckBox>
#include <QComboBox>
#include <QLabel>
#include <QLineEdit>
#include <QPlainTextEdit>
#include <QProgressBar>
#include <QPushButton>
#include <QSpinBox>
#include <QDoubleSpinBox>
#include <QThreadPool>
#include <QWidget>

#include "core/base/cancel.h"

namespace lorapipe::ui {

class TryPage : public QWidget {
  Q_OBJECT
 public:
  explicit TryPage(QWidget* parent = nullptr);
  // The project's model (its tokenizer and dtype go with it); a model typed here by hand is kept
  // until the project's model changes.
  void setModel(const QString& model, const QString& tokenizer = {}, const QString& dtype = "float32");
  void setAdapter(const QString& adapter);
  void offerAdapter(const QString& adapter);  // only when the user has not chosen one
  void setPrompt(const QString& prompt);
  void setChat(bool on) { chat_->setChecked(on); }
  void generate();
  void stop();
  bool generating() const { return running_ > 0; }
  QString baseText() const { return base_->toPlainText(); }
  QString adapterText() const { return tuned_->toPlainText(); }
  void exportTo(const QString& folder, const QString& format);
  bool exporting() const { return exporting_; }
  QString exportStatus() const { return export_status_->text(); }

 signals:
  void generationFinished();
  void exportFinished(bool ok);

 private:
  struct Loaded;  // the model session kept between prompts
  QLineEdit *model_ = nullptr, *adapter_ = nullptr, *export_dir_ = nullptr;
  QPlainTextEdit *prompt_ = nullptr, *base_ = nullptr, *tuned_ = nullptr;
  QCheckBox* chat_ = nullptr;
  QSpinBox* tokens_ = nullptr;
  QDoubleSpinBox* temperature_ = nullptr;
  QPushButton *generate_ = nullptr, *stop_ = nullptr, *export_ = nullptr;
  QComboBox *format_ = nullptr, *dtype_ = nullptr;
  QProgressBar* export_progress_ = nullptr;
  QLabel* export_status_ = nullptr;
  std::shared_ptr<cancel_token> cancel_;
  std::shared_ptr<Loaded> loaded_;
  QThreadPool* pool_ = nullptr;
  QString project_model_, tokenizer_, dtype_name_ = "float32", offered_adapter_;
  int running_ = 0;
  bool exporting_ = false;
};

}  // namespace lorapipe::ui
