// The JSON-lines protocol of engine events (`lorapipe-cli train --json` on stderr): one object per
// event with "event" (its kind) and "v" (protocol version), every field of the event struct. A
// front-end can run training in a child process and read this stream.
#pragma once

#include <nlohmann/json.hpp>

#include "core/base/events.h"

namespace lorapipe {

inline constexpr int event_protocol_version = 1;
nlohmann::ordered_json event_to_json(const engine_event& e);

}  // namespace lorapipe
