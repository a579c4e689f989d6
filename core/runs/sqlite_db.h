// Thin RAII layer over the SQLite C API for the run database: one connection (sqlite_db), prepared
// statements with positional binding (sqlite_stmt), and transactions that roll back unless
// committed. Every failing call throws database_error (errors.h) naming the database and the SQL;
// callers catch it at one boundary.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

struct sqlite3;
struct sqlite3_stmt;

namespace lorapipe {

class sqlite_db;

class sqlite_stmt {
 public:
  sqlite_stmt(sqlite_db& db, const std::string& sql);
  ~sqlite_stmt();
  sqlite_stmt(const sqlite_stmt&) = delete;
  sqlite_stmt& operator=(const sqlite_stmt&) = delete;

  // Bind by 1-based position; returns *this for chaining.
  sqlite_stmt& bind(int i, int64_t v);
  sqlite_stmt& bind(int i, double v);
  sqlite_stmt& bind(int i, const std::string& v);
  sqlite_stmt& bind_null(int i);
  template <class T>
  sqlite_stmt& bind(int i, const std::optional<T>& v) {
    return v ? bind(i, *v) : bind_null(i);
  }
  // Steps once: true while a row is available.
  bool step();
  // Runs a statement that returns no rows, then resets it for reuse.
  void exec();
  void reset();

  int64_t column_int(int i) const;
  double column_double(int i) const;
  std::string column_text(int i) const;
  bool column_is_null(int i) const;

 private:
  sqlite_db& db_;
  sqlite3_stmt* stmt_ = nullptr;
  std::string sql_;
};

class sqlite_db {
 public:
  // Opens (creating when allowed) the database file; busy_timeout_ms: how long a write waits for
  // another connection's lock before failing with a "locked" database_error.
  // read_only: no write is possible through this connection (and none takes a lock).
  enum class mode { read_write, read_write_create, read_only };
  sqlite_db(const std::filesystem::path& path, mode m, int busy_timeout_ms);
  ~sqlite_db();
  sqlite_db(const sqlite_db&) = delete;
  sqlite_db& operator=(const sqlite_db&) = delete;

  void exec(const std::string& sql);  // one or more statements, no results
  int64_t last_insert_rowid() const;
  int64_t query_int(const std::string& sql);  // first column of the first row (0 if none)
  std::string query_text(const std::string& sql);
  const std::filesystem::path& path() const { return path_; }
  sqlite3* handle() { return db_; }
  [[noreturn]] void fail(int code, const std::string& what) const;

 private:
  sqlite3* db_ = nullptr;
  std::filesystem::path path_;
};

// BEGIN IMMEDIATE on construction; ROLLBACK in the destructor unless commit() ran.
class sqlite_txn {
 public:
  explicit sqlite_txn(sqlite_db& db);
  ~sqlite_txn();
  sqlite_txn(const sqlite_txn&) = delete;
  sqlite_txn& operator=(const sqlite_txn&) = delete;
  void commit();

 private:
  sqlite_db& db_;
  bool done_ = false;
};

}  // namespace lorapipe
