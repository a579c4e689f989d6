// The JSON-lines protocol of engine events (`lorapipe-cli train --json` on stderr): one object per
// event with "event" (its kind) and "v" (protocol version), every field of the event struct. A
// front-end can run training in a child process and read this stream.
#pragma once

#include <nlohmann/json.hpp>

#include "core/base/events.h"
#include "core/base/result.h"

namespace lorapipe {

inline constexpr int event_protocol_version = 1;
nlohmann::ordered_json event_to_json(const engine_event& e);
// The inverse, for a front-end reading a child's stream: one line of the protocol back into the
// event struct (fields it lacks keep their defaults). An error names what is wrong with the line
// (not JSON, no "event", an unknown kind, a newer protocol version).
result<engine_event> event_from_json(const std::string& line);

}  // namespace lorapipe
