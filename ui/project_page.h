// Project page: a form for every project field, generated from the engine's field table
// (project_fields(): type, default, unit, choices, help as tooltip), the model folder's description
// (architecture, parameters, dtype, context, tokenizer), and the engine's validation shown inline
// next to each field as you type.
#pragma once

#include <map>

#include <QLabel>
#include <QTimer>
#include <QWidget>

#include "core/project/project.h"

namespace lorapipe::ui {

class ProjectPage : public QWidget {
  Q_OBJECT
 public:
  explicit ProjectPage(QWidget* parent = nullptr);
  // Shows `cfg` (from `file`, which relative paths resolve against; empty for an unsaved project).
  void setProject(const project_config& cfg, const QString& file);
  void setProjectFile(const QString& file);  // after save-as: paths now resolve against it
  // The project as the form holds it; `ok` false when a field does not parse.
  const project_config& config() const { return config_; }
  bool parses() const { return parses_; }
  QStringList problems() const { return problems_; }  // "field: problem"
  // Sets one field as if typed (Plan page controls, tests); returns false for an unknown field.
  bool setField(const QString& path, const QVariant& value);
  QWidget* editor(const QString& path) const;
  QString fieldError(const QString& path) const;  // the inline message shown ("" when none)
  QString modelSummary() const { return model_info_->text(); }
  void validateNow();

 signals:
  void edited();  // any change by the user (marks the project modified)
  void configChanged(const lorapipe::project_config& cfg);  // a change that parses

 private:
  struct Field {
    project_field info;
    QWidget* editor = nullptr;
    QLabel* error = nullptr;
  };
  QWidget* makeEditor(Field& f);
  QString textOf(const Field& f) const;
  void setEditorValue(Field& f, const std::string& json_value);
  std::string formJson() const;
  void onEdited(const QString& path);
  void describeModel();
  std::map<QString, Field> fields_;
  project_config config_;
  QString file_;
  bool parses_ = true, loading_ = false;
  QStringList problems_;
  QLabel* general_error_ = nullptr;
  QLabel* model_info_ = nullptr;
  QTimer validate_timer_, model_timer_;
  int model_generation_ = 0;
};

}  // namespace lorapipe::ui
