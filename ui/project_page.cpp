// Project page: see project_page.h.
#include "ui/project_page.h"

#include <QCheckBox>
#include <QComboBox>
#include <QDir>
#include <QFileDialog>
#include <QFileInfo>
#include <QFormLayout>
#include <QGroupBox>
#include <QHBoxLayout>
#include <QLineEdit>
#include <QRegularExpression>
#include <QScrollArea>
#include <QRegularExpressionValidator>
#include <QToolButton>
#include <QVBoxLayout>

#include <nlohmann/json.hpp>

#include "core/engine/model_session.h"
#include "ui/async.h"

namespace lorapipe::ui {
using json = nlohmann::json;

namespace {

const std::pair<const char*, const char*> kSections[] = {{"name", "Project"},         {"model", "Model"},         {"tokenizer", "Tokenizer"},
                                                         {"data", "Data"},           {"lora", "LoRA"},
                                                         {"optimizer", "Optimizer"}, {"parallel", "Devices and schedule"},
                                                         {"offload", "Offload"},     {"distributed", "Processes"},
                                                         {"run", "Run"}};

QString labelOf(const std::string& path) {
  static const std::pair<const char*, const char*> named[] = {
      {"optimizer.lr", "Learning rate"}, {"optimizer.eps", "Epsilon"},      {"optimizer.beta1", "Beta 1"},
      {"optimizer.beta2", "Beta 2"},     {"optimizer.min_lr_ratio", "Min LR ratio"}, {"lora.r", "Rank (r)"},
      {"data.seq_len", "Sequence length"}, {"data.add_bos", "Add BOS"},     {"data.add_eos", "Add EOS"},
      {"data.val_fraction", "Validation fraction"}, {"offload.device_memory_mb", "Device memory"},
      {"offload.copy_gbps", "Copy bandwidth"}, {"offload.pinned_memory_gb", "Pinned memory"},
      {"run.eval_interval", "Validation interval"}, {"run.eval_batches", "Validation batches"}};
  for (const auto& [p, label] : named)
    if (path == p) return QObject::tr(label);
  const auto dot = path.find('.');
  QString key = QString::fromStdString(dot == std::string::npos ? path : path.substr(dot + 1)).replace('_', ' ');
  if (!key.isEmpty()) key[0] = key[0].toUpper();
  return key;
}

QString humanCount(int64_t n) {
  if (n >= 1'000'000'000) return QString::number(n / 1e9, 'f', 2) + "B";
  if (n >= 1'000'000) return QString::number(n / 1e6, 'f', 1) + "M";
  if (n >= 1'000) return QString::number(n / 1e3, 'f', 1) + "K";
  return QString::number(n);
}

}  // namespace

ProjectPage::ProjectPage(QWidget* parent) : QWidget(parent) {
  auto* outer = new QVBoxLayout(this);
  general_error_ = new QLabel;
  general_error_->setObjectName("generalError");
  general_error_->setStyleSheet("color: #b02020;");
  general_error_->setWordWrap(true);
  general_error_->hide();
  outer->addWidget(general_error_);
  auto* scroll = new QScrollArea;
  scroll->setWidgetResizable(true);
  scroll->setFrameShape(QFrame::NoFrame);
  auto* body = new QWidget;
  auto* columns = new QHBoxLayout(body);
  QVBoxLayout* col[2] = {new QVBoxLayout, new QVBoxLayout};
  columns->addLayout(col[0], 1);
  columns->addLayout(col[1], 1);
  std::map<std::string, QFormLayout*> forms;
  int i = 0;
  for (const auto& [key, title] : kSections) {
    auto* box = new QGroupBox(tr(title));
    auto* form = new QFormLayout(box);
    form->setFieldGrowthPolicy(QFormLayout::ExpandingFieldsGrow);
    form->setLabelAlignment(Qt::AlignRight | Qt::AlignVCenter);
    forms[key] = form;
    col[i < 5 ? 0 : 1]->addWidget(box);
    ++i;
  }
  col[0]->addStretch(1);
  col[1]->addStretch(1);
  model_info_ = new QLabel(tr("Choose a model folder (config.json + safetensors) or a llama2.c .bin file."));
  model_info_->setObjectName("modelInfo");
  model_info_->setWordWrap(true);
  model_info_->setTextInteractionFlags(Qt::TextSelectableByMouse);
  for (const auto& info : project_fields()) {
    const std::string section = info.path.substr(0, info.path.find('.'));
    auto it = forms.find(section);
    if (it == forms.end()) continue;  // schema_version, name: kept as they are
    Field f{info};
    QWidget* editor = makeEditor(f);
    f.error = new QLabel;
    f.error->setObjectName(QString::fromStdString(info.path) + ".error");
    f.error->setStyleSheet("color: #b02020;");
    f.error->setWordWrap(true);
    f.error->hide();
    auto* cell = new QWidget;
    auto* v = new QVBoxLayout(cell);
    v->setContentsMargins(0, 0, 0, 0);
    v->setSpacing(1);
    auto* row = new QHBoxLayout;
    row->addWidget(editor, 1);
    if (!info.unit.empty()) row->addWidget(new QLabel(QString::fromStdString(info.unit)));
    v->addLayout(row);
    v->addWidget(f.error);
    if (info.path == "model.path") v->addWidget(model_info_);
    auto* label = new QLabel(labelOf(info.path));
    label->setToolTip(QString::fromStdString(info.path + ": " + info.doc));
    label->setBuddy(f.editor);
    it->second->addRow(label, cell);
    fields_.emplace(QString::fromStdString(info.path), std::move(f));
  }
  scroll->setWidget(body);
  outer->addWidget(scroll, 1);
  validate_timer_.setSingleShot(true);
  validate_timer_.setInterval(250);
  connect(&validate_timer_, &QTimer::timeout, this, &ProjectPage::validateNow);
  model_timer_.setSingleShot(true);
  model_timer_.setInterval(300);
  connect(&model_timer_, &QTimer::timeout, this, &ProjectPage::describeModel);
  setProject(project_config{}, {});
}

QWidget* ProjectPage::makeEditor(Field& f) {
  const QString path = QString::fromStdString(f.info.path);
  QString tip = QString::fromStdString(f.info.doc + "\nDefault: " + f.info.default_json);
  QWidget* w = nullptr;
  if (f.info.type == "bool") {
    auto* b = new QCheckBox;
    connect(b, &QCheckBox::toggled, this, [this, path] { onEdited(path); });
    w = b;
  } else if (!f.info.choices.empty()) {
    auto* c = new QComboBox;
    for (const auto& choice : f.info.choices) c->addItem(QString::fromStdString(choice));
    connect(c, &QComboBox::currentTextChanged, this, [this, path] { onEdited(path); });
    w = c;
  } else {
    auto* e = new QLineEdit;
    connect(e, &QLineEdit::textEdited, this, [this, path] { onEdited(path); });
    if (f.info.type == "list") tip += "\nSeparate entries with spaces.";
    if (f.info.type == "integer") {  // 64-bit values (seeds) do not fit a spin box
      static const QRegularExpression integer("-?\\d{0,18}");
      e->setValidator(new QRegularExpressionValidator(integer, e));
    }
    w = e;
    if (f.info.is_path) {
      auto* box = new QWidget;
      auto* h = new QHBoxLayout(box);
      h->setContentsMargins(0, 0, 0, 0);
      h->addWidget(e, 1);
      auto* browse = new QToolButton;
      browse->setText(tr("Browse…"));
      browse->setToolTip(tr("Choose %1").arg(path));
      const bool folder = f.info.is_folder || f.info.path == "model.path";
      connect(browse, &QToolButton::clicked, this, [this, e, path, folder] {
        QString chosen = folder ? QFileDialog::getExistingDirectory(this, tr("Choose %1").arg(path), e->text())
                                : QFileDialog::getOpenFileName(this, tr("Choose %1").arg(path), e->text());
        if (chosen.isEmpty()) return;
        e->setText(chosen);
        onEdited(path);
      });
      h->addWidget(browse);
      if (f.info.path == "model.path") {  // a model is a folder (HF) or a file (llama2.c .bin)
        browse->setText(tr("Folder…"));
        auto* file = new QToolButton;
        file->setText(tr("File…"));
        file->setToolTip(tr("Choose a llama2.c .bin model file"));
        connect(file, &QToolButton::clicked, this, [this, e, path] {
          const QString chosen = QFileDialog::getOpenFileName(this, tr("Choose %1").arg(path), e->text(), tr("llama2.c models (*.bin);;All files (*)"));
          if (chosen.isEmpty()) return;
          e->setText(chosen);
          onEdited(path);
        });
        h->addWidget(file);
      }
      f.editor = e;
      e->setObjectName(path);
      e->setToolTip(tip);
      return box;
    }
  }
  w->setObjectName(path);
  w->setToolTip(tip);
  f.editor = w;
  return w;
}

QWidget* ProjectPage::editor(const QString& path) const {
  auto it = fields_.find(path);
  return it == fields_.end() ? nullptr : it->second.editor;
}

QString ProjectPage::fieldError(const QString& path) const {
  auto it = fields_.find(path);
  return it == fields_.end() || it->second.error->isHidden() ? QString() : it->second.error->text();
}

void ProjectPage::setEditorValue(Field& f, const std::string& value_json) {
  const json v = json::parse(value_json, nullptr, false);
  if (auto* b = qobject_cast<QCheckBox*>(f.editor)) b->setChecked(v.is_boolean() && v.get<bool>());
  else if (auto* c = qobject_cast<QComboBox*>(f.editor)) c->setCurrentText(QString::fromStdString(v.is_string() ? v.get<std::string>() : ""));
  else if (auto* e = qobject_cast<QLineEdit*>(f.editor)) {
    QString text;
    if (v.is_string()) text = QString::fromStdString(v.get<std::string>());
    else if (v.is_array()) {
      QStringList parts;
      for (const auto& x : v) parts << QString::fromStdString(x.get<std::string>());
      text = parts.join(' ');
    } else if (v.is_number_integer()) text = QString::number(v.get<int64_t>());
    else if (v.is_number()) text = QString::number(v.get<double>(), 'g', 10);
    e->setText(text);
  }
}

void ProjectPage::setProject(const project_config& cfg, const QString& file) {
  loading_ = true;
  config_ = cfg;
  file_ = file;
  const json j = json::parse(project_to_json(cfg));
  for (auto& [path, f] : fields_) {
    const json* node = &j;
    for (const auto& part : path.split('.')) node = &(*node)[part.toStdString()];
    setEditorValue(f, node->dump());
  }
  loading_ = false;
  validateNow();
  describeModel();
}

void ProjectPage::setProjectFile(const QString& file) {
  file_ = file;
  validateNow();
}

bool ProjectPage::setField(const QString& path, const QVariant& value) {
  auto it = fields_.find(path);
  if (it == fields_.end()) return false;
  QWidget* w = it->second.editor;
  if (auto* b = qobject_cast<QCheckBox*>(w)) b->setChecked(value.toBool());
  else if (auto* c = qobject_cast<QComboBox*>(w)) c->setCurrentText(value.toString());
  else if (auto* e = qobject_cast<QLineEdit*>(w)) {
    e->setText(value.toString());
    onEdited(path);
  }
  return true;
}

QString ProjectPage::textOf(const Field& f) const {
  if (auto* e = qobject_cast<QLineEdit*>(f.editor)) return e->text();
  return {};
}

// The form as project JSON (the name and schema_version as loaded). A number field that does not
// parse is written as its text so that the engine's parser names the field.
std::string ProjectPage::formJson() const {
  json j = json::parse(project_to_json(config_));
  for (const auto& [path, f] : fields_) {
    json* node = &j;
    for (const auto& part : path.split('.')) node = &(*node)[part.toStdString()];
    if (auto* b = qobject_cast<QCheckBox*>(f.editor)) *node = b->isChecked();
    else if (auto* c = qobject_cast<QComboBox*>(f.editor)) *node = c->currentText().toStdString();
    else if (f.info.type == "integer") {
      bool ok = false;
      const qlonglong n = textOf(f).trimmed().toLongLong(&ok);
      *node = ok ? json(static_cast<int64_t>(n)) : json(textOf(f).toStdString());
    } else if (f.info.type == "list") {
      json a = json::array();
      for (const auto& part : textOf(f).split(QRegularExpression("[\\s,]+"), Qt::SkipEmptyParts)) a.push_back(part.toStdString());
      *node = a;
    } else if (f.info.type == "number") {
      bool ok = false;
      const double d = textOf(f).trimmed().toDouble(&ok);
      *node = ok ? json(d) : json(textOf(f).toStdString());
    } else {
      *node = textOf(f).toStdString();
    }
  }
  return j.dump();
}

void ProjectPage::onEdited(const QString& path) {
  if (loading_) return;
  emit edited();
  validate_timer_.start();
  if (path == "model.path") model_timer_.start();
}

void ProjectPage::validateNow() {
  validate_timer_.stop();
  const std::filesystem::path file = file_.isEmpty() ? std::filesystem::current_path() / "unsaved.lorapipe.json" : std::filesystem::path(file_.toStdString());
  auto parsed = parse_project(formJson(), file);
  QString problems;
  if (parsed) {
    parsed->base_dir = file.parent_path();
    auto st = validate_project(*parsed);
    if (!st) problems = QString::fromStdString(st.message());
  } else {
    problems = QString::fromStdString(parsed.message());
  }
  problems_ = problems.isEmpty() ? QStringList() : problems.split('\n', Qt::SkipEmptyParts);
  std::map<QString, QStringList> by_field;
  QStringList general;
  for (const auto& line : problems_) {
    QString best;
    for (const auto& [path, f] : fields_)
      if (line.startsWith(path + ":") && path.size() > best.size()) best = path;
    if (best.isEmpty()) general << line;
    else by_field[best] << line.mid(best.size() + 1).trimmed();
  }
  for (auto& [path, f] : fields_) {
    auto it = by_field.find(path);
    f.error->setText(it == by_field.end() ? QString() : it->second.join("; "));
    f.error->setVisible(it != by_field.end());
  }
  general_error_->setText(general.join('\n'));
  general_error_->setVisible(!general.isEmpty());
  parses_ = parsed.ok();
  if (parsed) {
    config_ = *parsed;
    emit configChanged(config_);
  }
}

void ProjectPage::describeModel() {
  // From the field as typed (the config is updated only when the whole form parses).
  const QString typed = textOf(fields_.at("model.path")).trimmed();
  project_config where;
  where.base_dir = file_.isEmpty() ? std::filesystem::current_path() : std::filesystem::path(file_.toStdString()).parent_path();
  const std::string path = typed.isEmpty() ? std::string() : where.resolve(typed.toStdString()).string();
  const int generation = ++model_generation_;
  if (path.empty()) {
    model_info_->setText(tr("Choose a model folder (config.json + safetensors) or a llama2.c .bin file."));
    return;
  }
  model_info_->setText(tr("Reading %1…").arg(QString::fromStdString(path)));
  runAsync(this, [path] { return describe_model(path); }, [this, generation](const result<model_info>& r) {
    if (generation != model_generation_) return;  // the path changed meanwhile
    if (!r) {
      model_info_->setText(QString::fromStdString(r.message()));
      return;
    }
    const auto& m = *r;
    QString tok = m.tokenizer.empty() ? tr("no tokenizer found") : QFileInfo(QString::fromStdString(m.tokenizer)).fileName();
    model_info_->setText(tr("%1 · %2 parameters · %3 · context %4 tokens · %5 layers, hidden %6, %7/%8 heads · vocabulary %9 · tokenizer: %10")
                             .arg(QString::fromStdString(m.architecture), humanCount(m.parameters), QString::fromStdString(m.dtype))
                             .arg(m.context_length)
                             .arg(m.layers)
                             .arg(m.hidden_size)
                             .arg(m.heads)
                             .arg(m.kv_heads)
                             .arg(m.vocab_size)
                             .arg(tok));
  });
}

}  // namespace lorapipe::ui
