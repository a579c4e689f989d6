// RAII wrappers over SQLite: see sqlite_db.h.
#include "core/runs/sqlite_db.h"

#include <sqlite3.h>

#include <fmt/format.h>

#include "core/base/errors.h"

namespace lorapipe {

namespace {
std::string describe(int code, const std::string& msg) {
  const int primary = code & 0xff;
  if (primary == SQLITE_BUSY || primary == SQLITE_LOCKED) return "the database is locked by another process (" + msg + ")";
  if (primary == SQLITE_READONLY) return "the database is read-only (" + msg + ")";
  if (primary == SQLITE_CORRUPT || primary == SQLITE_NOTADB) return "the file is not a valid SQLite database (" + msg + ")";
  if (primary == SQLITE_FULL) return "the disk is full (" + msg + ")";
  if (primary == SQLITE_CANTOPEN) return "cannot open the database file (" + msg + ")";
  return msg;
}
}  // namespace

void sqlite_db::fail(int code, const std::string& what) const {
  const std::string msg = db_ != nullptr ? sqlite3_errmsg(db_) : sqlite3_errstr(code);
  throw database_error(fmt::format("{}: {}{}", path_.string(), describe(code, msg), what.empty() ? "" : " in: " + what), code);
}

sqlite_db::sqlite_db(const std::filesystem::path& path, mode m, int busy_timeout_ms) : path_(path) {
  const int access = m == mode::read_only         ? SQLITE_OPEN_READONLY
                     : m == mode::read_write_create ? SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE
                                                    : SQLITE_OPEN_READWRITE;
  const int flags = access | SQLITE_OPEN_NOMUTEX;
  const int rc = sqlite3_open_v2(path.c_str(), &db_, flags, nullptr);
  if (rc != SQLITE_OK) {
    const std::string msg = db_ != nullptr ? sqlite3_errmsg(db_) : sqlite3_errstr(rc);
    sqlite3_close(db_);
    db_ = nullptr;
    throw database_error(fmt::format("{}: {}", path.string(), describe(rc, msg)), rc);
  }
  sqlite3_extended_result_codes(db_, 1);
  sqlite3_busy_timeout(db_, busy_timeout_ms);
}

sqlite_db::~sqlite_db() { sqlite3_close_v2(db_); }

void sqlite_db::exec(const std::string& sql) {
  char* err = nullptr;
  const int rc = sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err);
  if (rc != SQLITE_OK) {
    std::string msg = err != nullptr ? err : sqlite3_errstr(rc);
    sqlite3_free(err);
    throw database_error(fmt::format("{}: {} in: {}", path_.string(), describe(rc, msg), sql.substr(0, 120)), rc);
  }
}

int64_t sqlite_db::last_insert_rowid() const { return sqlite3_last_insert_rowid(db_); }

int64_t sqlite_db::query_int(const std::string& sql) {
  sqlite_stmt s(*this, sql);
  return s.step() ? s.column_int(0) : 0;
}

std::string sqlite_db::query_text(const std::string& sql) {
  sqlite_stmt s(*this, sql);
  return s.step() ? s.column_text(0) : std::string();
}

sqlite_stmt::sqlite_stmt(sqlite_db& db, const std::string& sql) : db_(db), sql_(sql) {
  const int rc = sqlite3_prepare_v2(db.handle(), sql.c_str(), static_cast<int>(sql.size()), &stmt_, nullptr);
  if (rc != SQLITE_OK) db_.fail(rc, sql_.substr(0, 120));
}

sqlite_stmt::~sqlite_stmt() { sqlite3_finalize(stmt_); }

sqlite_stmt& sqlite_stmt::bind(int i, int64_t v) {
  if (const int rc = sqlite3_bind_int64(stmt_, i, v); rc != SQLITE_OK) db_.fail(rc, sql_.substr(0, 120));
  return *this;
}
sqlite_stmt& sqlite_stmt::bind(int i, double v) {
  if (const int rc = sqlite3_bind_double(stmt_, i, v); rc != SQLITE_OK) db_.fail(rc, sql_.substr(0, 120));
  return *this;
}
sqlite_stmt& sqlite_stmt::bind(int i, const std::string& v) {
  if (const int rc = sqlite3_bind_text(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT); rc != SQLITE_OK)
    db_.fail(rc, sql_.substr(0, 120));
  return *this;
}
sqlite_stmt& sqlite_stmt::bind_null(int i) {
  if (const int rc = sqlite3_bind_null(stmt_, i); rc != SQLITE_OK) db_.fail(rc, sql_.substr(0, 120));
  return *this;
}

bool sqlite_stmt::step() {
  const int rc = sqlite3_step(stmt_);
  if (rc == SQLITE_ROW) return true;
  if (rc == SQLITE_DONE) return false;
  sqlite3_reset(stmt_);
  db_.fail(rc, sql_.substr(0, 120));
}

void sqlite_stmt::exec() {
  while (step()) {
  }
  reset();
}

void sqlite_stmt::reset() {
  sqlite3_reset(stmt_);
  sqlite3_clear_bindings(stmt_);
}

int64_t sqlite_stmt::column_int(int i) const { return sqlite3_column_int64(stmt_, i); }
double sqlite_stmt::column_double(int i) const { return sqlite3_column_double(stmt_, i); }
std::string sqlite_stmt::column_text(int i) const {
  const auto* p = sqlite3_column_text(stmt_, i);
  return p != nullptr ? std::string(reinterpret_cast<const char*>(p), static_cast<size_t>(sqlite3_column_bytes(stmt_, i)))
                      : std::string();
}
bool sqlite_stmt::column_is_null(int i) const { return sqlite3_column_type(stmt_, i) == SQLITE_NULL; }

sqlite_txn::sqlite_txn(sqlite_db& db) : db_(db) { db_.exec("BEGIN IMMEDIATE"); }
sqlite_txn::~sqlite_txn() {
  if (!done_) sqlite3_exec(db_.handle(), "ROLLBACK", nullptr, nullptr, nullptr);
}
void sqlite_txn::commit() {
  db_.exec("COMMIT");
  done_ = true;
}

}  // namespace lorapipe
