// Try & export page: see try_page.h.
#include "ui/try_page.h"

#include <QApplication>
#include <QFileDialog>
#include <QFormLayout>
#include <QGroupBox>
#include <QHBoxLayout>
#include <QPointer>
#include <optional>
#include <QSplitter>
#include <QVBoxLayout>

#include "core/engine/model_session.h"
#include "core/project/project.h"
#include "ui/async.h"

namespace lorapipe::ui {

namespace {

// Forwards the export's phase events to the page (queued onto the GUI thread).
class ExportObserver final : public observer {
 public:
  explicit ExportObserver(QPointer<QLabel> label) : label_(std::move(label)) {}
  void on_event(const engine_event& e) override {
    const auto* p = std::get_if<phase_event>(&e);
    if (!p) return;
    const QString text = QStringLiteral("%1 %2").arg(QString::fromLatin1(phase_name(p->what)).replace('_', ' '), QString::fromStdString(p->detail));
    QMetaObject::invokeMethod(qApp, [label = label_, text] {
      if (label) label->setText(text);
    }, Qt::QueuedConnection);
  }

 private:
  QPointer<QLabel> label_;
};

QWidget* browseRow(QLineEdit* edit, bool folder, QWidget* parent) {
  auto* w = new QWidget;
  auto* h = new QHBoxLayout(w);
  h->setContentsMargins(0, 0, 0, 0);
  h->addWidget(edit, 1);
  auto* b = new QPushButton(QObject::tr("Browse…"));
  QObject::connect(b, &QPushButton::clicked, parent, [edit, folder, parent] {
    const QString chosen = folder ? QFileDialog::getExistingDirectory(parent, QObject::tr("Choose a folder"), edit->text())
                                  : QFileDialog::getOpenFileName(parent, QObject::tr("Choose a file"), edit->text());
    if (!chosen.isEmpty()) edit->setText(chosen);
  });
  h->addWidget(b);
  return w;
}

}  // namespace

TryPage::TryPage(QWidget* parent) : QWidget(parent) {
  auto* layout = new QVBoxLayout(this);
  auto* source = new QFormLayout;
  model_ = new QLineEdit;
  model_->setObjectName("tryModel");
  adapter_ = new QLineEdit;
  adapter_->setObjectName("tryAdapter");
  adapter_->setPlaceholderText(tr("PEFT adapter folder (a run's output_dir/adapter)"));
  source->addRow(tr("&Model"), browseRow(model_, true, this));
  source->addRow(tr("&Adapter"), browseRow(adapter_, true, this));
  layout->addLayout(source);
  auto* promptBox = new QHBoxLayout;
  prompt_ = new QPlainTextEdit;
  prompt_->setObjectName("tryPrompt");
  prompt_->setPlaceholderText(tr("Prompt"));
  prompt_->setPlainText("Once upon a time");
  prompt_->setMaximumHeight(90);
  promptBox->addWidget(prompt_, 1);
  auto* opts = new QFormLayout;
  chat_ = new QCheckBox(tr("C&hat (through the chat template)"));
  tokens_ = new QSpinBox;
  tokens_->setRange(1, 4096);
  tokens_->setValue(64);
  temperature_ = new QDoubleSpinBox;
  temperature_->setRange(0, 2);
  temperature_->setSingleStep(0.1);
  temperature_->setToolTip(tr("0 = greedy"));
  opts->addRow(chat_);
  opts->addRow(tr("New &tokens"), tokens_);
  opts->addRow(tr("T&emperature"), temperature_);
  auto* buttons = new QHBoxLayout;
  generate_ = new QPushButton(tr("&Generate"));
  generate_->setObjectName("generateButton");
  generate_->setDefault(true);
  stop_ = new QPushButton(tr("St&op"));
  stop_->setEnabled(false);
  buttons->addWidget(generate_);
  buttons->addWidget(stop_);
  opts->addRow(buttons);
  promptBox->addLayout(opts);
  layout->addLayout(promptBox);
  auto* sides = new QSplitter(Qt::Horizontal);
  auto side = [&](const QString& title, QPlainTextEdit*& out, const char* name) {
    auto* box = new QGroupBox(title);
    auto* v = new QVBoxLayout(box);
    out = new QPlainTextEdit;
    out->setObjectName(name);
    out->setReadOnly(true);
    v->addWidget(out);
    sides->addWidget(box);
  };
  side(tr("Base model"), base_, "baseOutput");
  side(tr("With the adapter"), tuned_, "adapterOutput");
  layout->addWidget(sides, 1);
  auto* exp = new QGroupBox(tr("Export"));
  auto* ef = new QHBoxLayout(exp);
  format_ = new QComboBox;
  format_->addItem(tr("PEFT adapter"), "peft");
  format_->addItem(tr("merged model (HF folder)"), "merged");
  dtype_ = new QComboBox;
  for (const auto& d : field_choices("model.dtype")) dtype_->addItem(QString::fromStdString(d));
  export_dir_ = new QLineEdit;
  export_dir_->setObjectName("exportDir");
  export_dir_->setPlaceholderText(tr("output folder"));
  export_ = new QPushButton(tr("E&xport"));
  export_->setObjectName("exportButton");
  export_progress_ = new QProgressBar;
  export_progress_->setRange(0, 1);
  export_progress_->setMaximumWidth(140);
  export_status_ = new QLabel;
  export_status_->setObjectName("exportStatus");
  ef->addWidget(format_);
  ef->addWidget(dtype_);
  ef->addWidget(browseRow(export_dir_, true, this), 1);
  ef->addWidget(export_);
  ef->addWidget(export_progress_);
  ef->addWidget(export_status_, 1);
  layout->addWidget(exp);
  pool_ = new QThreadPool(this);
  pool_->setMaxThreadCount(1);  // one model at work at a time; the global pool stays free for reads
  connect(generate_, &QPushButton::clicked, this, &TryPage::generate);
  connect(stop_, &QPushButton::clicked, this, &TryPage::stop);
  connect(export_, &QPushButton::clicked, this, [this] { exportTo(export_dir_->text(), format_->currentData().toString()); });
}

struct TryPage::Loaded {
  std::string key;                         // model | tokenizer | dtype
  std::optional<model_session> session;
};

void TryPage::setModel(const QString& model, const QString& tokenizer, const QString& dtype) {
  if (model == project_model_ && tokenizer == tokenizer_ && dtype == dtype_name_) return;
  project_model_ = model, tokenizer_ = tokenizer, dtype_name_ = dtype;
  model_->setText(model);
}

void TryPage::setAdapter(const QString& adapter) { adapter_->setText(adapter); }

void TryPage::offerAdapter(const QString& adapter) {
  if (!adapter_->text().isEmpty() && adapter_->text() != offered_adapter_) return;  // the user's choice stays
  offered_adapter_ = adapter;
  adapter_->setText(adapter);
}

void TryPage::setPrompt(const QString& prompt) { prompt_->setPlainText(prompt); }

void TryPage::stop() {
  if (cancel_) cancel_->request();
}

namespace {

// Length of the longest prefix of `s` that ends on a whole UTF-8 character (a byte-fallback token
// may carry part of one; the rest comes with the next tokens).
size_t completeUtf8(const std::string& s) {
  size_t end = s.size();
  for (size_t back = 1; back <= 3 && back <= s.size(); ++back) {
    const auto c = static_cast<unsigned char>(s[s.size() - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    if (need > back) end = s.size() - back;  // the lead byte's character is not complete yet
    break;
  }
  return end;
}

// Streams the tokens of one generation into `target` (queued onto the GUI thread), whole UTF-8
// characters at a time.
std::function<bool(int32_t, const std::string&)> streamInto(QPointer<QPlainTextEdit> target) {
  auto pending = std::make_shared<std::string>();
  return [target, pending](int32_t, const std::string& piece) {
    *pending += piece;
    const size_t n = completeUtf8(*pending);
    if (n == 0) return true;
    const QString text = QString::fromUtf8(pending->data(), static_cast<qsizetype>(n));
    pending->erase(0, n);
    QMetaObject::invokeMethod(qApp, [target, text] {
      if (!target) return;
      target->moveCursor(QTextCursor::End);
      target->insertPlainText(text);
    }, Qt::QueuedConnection);
    return true;
  };
}

}  // namespace

// The base model answers first, then the same loaded model with the adapter switched on.
void TryPage::generate() {
  if (running_ > 0) return;
  cancel_ = std::make_shared<cancel_token>();
  base_->clear();
  tuned_->clear();
  running_ = 1;
  generate_->setEnabled(false);
  stop_->setEnabled(true);
  const QString model = model_->text().trimmed();
  const bool own_tokenizer = model == project_model_;  // a model typed here finds its own tokenizer
  model_request mr{model.toStdString(), "", own_tokenizer ? tokenizer_.toStdString() : std::string(),
                   own_tokenizer ? dtype_name_.toStdString() : std::string("float32"), 0};
  generate_request gr;
  gr.prompt = prompt_->toPlainText().toStdString();
  gr.chat = chat_->isChecked();
  gr.max_new_tokens = tokens_->value();
  gr.temperature = temperature_->value();
  const std::string adapter = adapter_->text().trimmed().toStdString();
  if (!loaded_) loaded_ = std::make_shared<Loaded>();
  auto loaded = loaded_;
  auto cancel = cancel_;
  QPointer<QPlainTextEdit> base(base_), tuned(tuned_);
  runAsync(
      this,
      [mr, gr, adapter, loaded, cancel, base, tuned]() -> std::pair<std::string, std::string> {
        const std::string key = mr.model + "|" + mr.tokenizer + "|" + mr.dtype;
        if (!loaded->session || loaded->key != key) {
          loaded->session.reset();
          auto m = model_session::open(mr);
          if (!m) return {m.message(), ""};
          loaded->session.emplace(std::move(*m));
          loaded->key = key;
        }
        auto& s = *loaded->session;
        std::pair<std::string, std::string> errors;
        if (auto st = s.set_adapter(""); !st) return {st.message(), ""};
        if (auto g = s.generate(gr, streamInto(base), cancel.get()); !g) errors.first = g.message();
        if (adapter.empty()) return {errors.first, "no adapter chosen"};
        if (cancel->requested()) return errors;
        if (auto st = s.set_adapter(adapter); !st) return {errors.first, st.message()};
        if (auto g = s.generate(gr, streamInto(tuned), cancel.get()); !g) errors.second = g.message();
        return errors;
      },
      [this, base, tuned](const std::pair<std::string, std::string>& err) {
        if (!err.first.empty() && base) base->appendPlainText(tr("\n[%1]").arg(QString::fromStdString(err.first)));
        if (!err.second.empty() && tuned) tuned->appendPlainText(tr("\n[%1]").arg(QString::fromStdString(err.second)));
        running_ = 0;
        generate_->setEnabled(true);
        stop_->setEnabled(false);
        emit generationFinished();
      },
      pool_);
}

void TryPage::exportTo(const QString& folder, const QString& format) {
  if (exporting_ || folder.trimmed().isEmpty()) {
    export_status_->setText(tr("Choose an output folder first."));
    return;
  }
  exporting_ = true;
  export_->setEnabled(false);
  export_progress_->setRange(0, 0);  // busy
  const std::string model = model_->text().trimmed().toStdString(), adapter = adapter_->text().trimmed().toStdString();
  const std::string out = folder.trimmed().toStdString(), fmt = format.toStdString(), dtype = dtype_->currentText().toStdString();
  QPointer<QLabel> label(export_status_);
  runAsync(this,
           [=] {
             ExportObserver obs(label);
             auto st = export_adapter(model, adapter, out, fmt, dtype, obs);
             return st ? std::string() : st.message();
           },
           [this, out](const std::string& err) {
             exporting_ = false;
             export_->setEnabled(true);
             export_progress_->setRange(0, 1);
             export_progress_->setValue(err.empty() ? 1 : 0);
             export_status_->setText(err.empty() ? tr("Written to %1").arg(QString::fromStdString(out)) : tr("Export failed: %1").arg(QString::fromStdString(err)));
             emit exportFinished(err.empty());
           },
           pool_);
}

}  // namespace lorapipe::ui
