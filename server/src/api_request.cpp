#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "berth/core/error.h"
#include "berth/core/strings.h"
#include "berth/models/utf8.h"
#include "berth/server/api.h"

namespace berth::server {

using json = nlohmann::json;

namespace {

constexpr size_t kMaxStops = 16;
constexpr size_t kMaxStopBytes = 1024;

[[noreturn]] void bad(std::string message) {
  throw ApiError{400, "invalid_request_error", std::move(message)};
}

// The value as the message quotes it (short). Arrays and objects are named, not dumped: dump()
// recurses, and a request may nest them 100000 deep.
std::string shown(const json& v) {
  if (v.is_array()) return fmt::format("an array of {}", v.size());
  if (v.is_object()) return fmt::format("an object of {} members", v.size());
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

const json* field(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return nullptr;
  return &*it;
}

bool get_bool(const json& j, const char* key, bool def) {
  const json* v = field(j, key);
  if (!v) return def;
  if (!v->is_boolean()) bad(fmt::format("'{}' must be true or false, got {}", key, shown(*v)));
  return v->get<bool>();
}

// An integer in [lo, hi]; a float with an integral value counts (some clients send 128.0).
int64_t get_int(const json& j, const char* key, int64_t lo, int64_t hi, int64_t def) {
  const json* v = field(j, key);
  if (!v) return def;
  int64_t x = 0;
  if (v->is_number_integer()) {
    if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(hi))
      bad(fmt::format("'{}' must be an integer in {}..{}, got {}", key, lo, hi, shown(*v)));
    x = v->get<int64_t>();
  } else if (v->is_number_float()) {
    const double d = v->get<double>();
    if (!(d >= static_cast<double>(lo) && d <= static_cast<double>(hi)) || std::floor(d) != d)
      bad(fmt::format("'{}' must be an integer in {}..{}, got {}", key, lo, hi, shown(*v)));
    x = static_cast<int64_t>(d);
  } else {
    bad(fmt::format("'{}' must be an integer, got {}", key, shown(*v)));
  }
  if (x < lo || x > hi)
    bad(fmt::format("'{}' must be an integer in {}..{}, got {}", key, lo, hi, x));
  return x;
}

float get_number(const json& j, const char* key, double lo, double hi, float def) {
  const json* v = field(j, key);
  if (!v) return def;
  if (!v->is_number()) bad(fmt::format("'{}' must be a number, got {}", key, shown(*v)));
  const double d = v->get<double>();
  if (!(d >= lo && d <= hi))
    bad(fmt::format("'{}' must be a number in [{}, {}], got {}", key, lo, hi, shown(*v)));
  return static_cast<float>(d);
}

std::vector<std::string> get_stops(const json& j) {
  const json* v = field(j, "stop");
  std::vector<std::string> out;
  if (!v) return out;
  auto add = [&](const json& s, const std::string& where) {
    if (!s.is_string()) bad(fmt::format("'{}' must be a string, got {}", where, shown(s)));
    std::string t = s.get<std::string>();
    if (t.empty()) bad(fmt::format("'{}' is an empty string", where));
    if (t.size() > kMaxStopBytes)
      bad(fmt::format("'{}' is longer than {} bytes", where, kMaxStopBytes));
    out.push_back(std::move(t));
  };
  if (v->is_string()) {
    add(*v, "stop");
  } else if (v->is_array()) {
    if (v->size() > kMaxStops)
      bad(fmt::format("'stop' has {} strings; at most {} are accepted", v->size(), kMaxStops));
    for (size_t i = 0; i < v->size(); ++i) add((*v)[i], fmt::format("stop[{}]", i));
  } else {
    bad(fmt::format("'stop' must be a string or an array of strings, got {}", shown(*v)));
  }
  return out;
}

// Token ids of a JSON array, each checked to be an integer (range: the engine checks it).
std::vector<int32_t> get_ids(const json& arr, const std::string& where, int64_t n_vocab) {
  std::vector<int32_t> ids;
  ids.reserve(arr.size());
  for (size_t i = 0; i < arr.size(); ++i) {
    const json& t = arr[i];
    if (!t.is_number_integer())
      bad(fmt::format("'{}[{}]' must be a token id (an integer), got {}", where, i, shown(t)));
    const int64_t id = t.get<int64_t>();
    if (t.is_number_unsigned() ? t.get<uint64_t>() >= static_cast<uint64_t>(n_vocab)
                               : (id < 0 || id >= n_vocab))
      bad(fmt::format("'{}[{}]' = {} is outside the vocabulary of {} tokens", where, i, shown(t),
                      n_vocab));
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

// A logit_bias entry's bias: a number in [-100, 100] (OpenAI's range), or false: the token is
// banned (-inf, llama-server's form).
float get_bias(const json& v, const std::string& where) {
  if (v.is_boolean() && !v.get<bool>()) return -INFINITY;
  if (!v.is_number() || !(v.get<double>() >= -100.0 && v.get<double>() <= 100.0))
    bad(fmt::format("'{}' must be a number in [-100, 100] or false, got {}", where, shown(v)));
  return static_cast<float>(v.get<double>());
}

// `logit_bias`: OpenAI's object of token ids (as strings) to biases, {"378": -100}, or
// llama-server's array of [token id, bias] pairs, [[378, -100], [13, false]]. Token ids only: a
// key or id that is text (llama-server tokenizes it) is refused, as is an id outside the
// vocabulary. An id given twice gets the sum of its biases (llama.cpp's sampler adds each).
// Banning every id of the vocabulary is refused.
std::vector<std::pair<int32_t, float>> get_logit_bias(const json& j, int64_t n_vocab) {
  const json* v = field(j, "logit_bias");
  std::vector<std::pair<int32_t, float>> out;
  if (!v) return out;
  const auto outside = [&](const std::string& what) {
    bad(fmt::format("{} is outside the vocabulary of {} tokens", what, n_vocab));
  };
  if (v->is_object()) {
    for (const auto& [key, bias] : v->items()) {
      const std::string k = shown(json(key));
      // A decimal integer: digits, after a minus sign at most (outside the vocabulary then).
      const size_t start = !key.empty() && key[0] == '-' ? 1 : 0;
      if (key.size() == start || key.find_first_not_of("0123456789", start) != std::string::npos)
        bad(fmt::format("'logit_bias' key {} is not a token id (an integer)", k));
      int64_t id = 0;
      for (size_t i = start; i < key.size() && id < n_vocab; ++i) id = id * 10 + (key[i] - '0');
      if (start == 1 && id != 0) id = -1;  // "-0" is 0
      if (id < 0 || id >= n_vocab) outside("'logit_bias' key " + k);
      out.emplace_back(static_cast<int32_t>(id), get_bias(bias, "logit_bias[" + k + "]"));
    }
  } else if (v->is_array()) {
    for (size_t i = 0; i < v->size(); ++i) {
      const json& e = (*v)[i];
      if (!e.is_array() || e.size() != 2)
        bad(fmt::format("'logit_bias[{}]' must be a [token id, bias] pair, got {}", i, shown(e)));
      const json& t = e[0];
      if (!t.is_number_integer())
        bad(fmt::format("'logit_bias[{}][0]' must be a token id (an integer), got {}", i,
                        shown(t)));
      if (t.is_number_unsigned() ? t.get<uint64_t>() >= static_cast<uint64_t>(n_vocab)
                                 : (t.get<int64_t>() < 0 || t.get<int64_t>() >= n_vocab))
        outside(fmt::format("'logit_bias[{}][0]' = {}", i, shown(t)));
      out.emplace_back(static_cast<int32_t>(t.get<int64_t>()),
                       get_bias(e[1], fmt::format("logit_bias[{}][1]", i)));
    }
  } else {
    bad(
        fmt::format("'logit_bias' must be an object of token ids to biases or an array of "
                    "[token id, bias] pairs, got {}",
                    shown(*v)));
  }
  // Every token banned: nothing can be sampled (a sampler would have to pick a banned one).
  if (static_cast<int64_t>(out.size()) >= n_vocab) {
    std::vector<bool> banned(static_cast<size_t>(n_vocab), false);
    int64_t n_banned = 0;
    for (const auto& [id, bias] : out)
      if (bias == -INFINITY && !banned[static_cast<size_t>(id)]) {
        banned[static_cast<size_t>(id)] = true;
        ++n_banned;
      }
    if (n_banned == n_vocab)
      bad(
          fmt::format("'logit_bias' bans every token of the vocabulary ({}): nothing can be "
                      "sampled",
                      n_vocab));
  }
  return out;
}

// `prompt` of /v1/completions and /completion: a string, an array of token ids, or an array
// holding one of those.
std::vector<int32_t> get_prompt(const json& j, const ModelContext& m, std::string& text) {
  const json* v = field(j, "prompt");
  if (!v) bad("'prompt' is required");
  const json* p = v;
  if (v->is_array() && v->size() == 1 && ((*v)[0].is_string() || (*v)[0].is_array())) {
    p = &(*v)[0];
  } else if (v->is_array() && v->size() > 1 && std::all_of(v->begin(), v->end(), [](const json& e) {
               return e.is_string() || e.is_array();
             })) {
    bad("'prompt' holds several prompts; berth answers one prompt per request");
  }
  if (p->is_string()) {
    text = p->get<std::string>();
    return m.tok->encode(text, true, true);
  }
  if (p->is_array()) {
    if (p->empty()) bad("'prompt' is an empty array");
    return get_ids(*p, "prompt", m.n_vocab);
  }
  bad(fmt::format("'prompt' must be a string or an array of token ids, got {}", shown(*v)));
}

void refuse_unsupported(const json& j, Endpoint e) {
  if (const json* n = field(j, "n"); n && !(n->is_number_integer() && n->get<int64_t>() == 1))
    bad(fmt::format("'n' must be 1 (one choice per request), got {}", shown(*n)));
  if (const json* t = field(j, "tools"); t && !(t->is_array() && t->empty()))
    bad("'tools' is not supported: berth does not parse tool calls");
  if (const json* t = field(j, "tool_choice");
      t && !(t->is_string() && t->get<std::string>() == "none"))
    bad("'tool_choice' is not supported: berth does not parse tool calls");
  if (const json* r = field(j, "response_format")) {
    const json* type = r->is_object() ? field(*r, "type") : nullptr;
    if (!type || !type->is_string() || type->get<std::string>() != "text")
      bad("'response_format' other than {\"type\": \"text\"} is not supported (no grammar "
          "constraints)");
  }
  // Constrained decoding: llama-server's GBNF `grammar` and `json_schema` (which it turns into
  // one). Unconstrained text in their place would pass for conforming output. An empty grammar
  // is none (llama-server's default).
  if (const json* g = field(j, "grammar"); g && !(g->is_string() && g->get<std::string>().empty()))
    bad("'grammar' is not supported: berth has no constrained decoding");
  if (field(j, "json_schema"))
    bad("'json_schema' is not supported: berth has no constrained decoding");
  if (e == Endpoint::completions && get_bool(j, "echo", false)) bad("'echo' is not supported");
  if (const json* s = field(j, "suffix"); s && !(s->is_string() && s->get<std::string>().empty()))
    bad("'suffix' is not supported");
}

}  // namespace

json parse_body(const std::string& body) {
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for 1e999
    // e.what() reads "[json.exception.parse_error.101] parse error at line 1, column 2: ..."
    std::string what = e.what();
    if (auto p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
    throw ApiError{400, "invalid_request_error",
                   fmt::format("the request body is not valid JSON: {}", printable(what, 300))};
  }
  if (!j.is_object())
    throw ApiError{400, "invalid_request_error",
                   fmt::format("the request body must be a JSON object, got {}", j.type_name())};
  return j;
}

std::vector<ChatMessage> parse_messages(const json& body) {
  const json* v = field(body, "messages");
  if (!v) bad("'messages' is required");
  if (!v->is_array()) bad(fmt::format("'messages' must be an array, got {}", shown(*v)));
  if (v->empty()) bad("'messages' is empty");
  std::vector<ChatMessage> out;
  out.reserve(v->size());
  for (size_t i = 0; i < v->size(); ++i) {
    const json& msg = (*v)[i];
    if (!msg.is_object())
      bad(fmt::format("'messages[{}]' must be an object with role and content, got {}", i,
                      shown(msg)));
    const json* role = field(msg, "role");
    if (!role || !role->is_string()) bad(fmt::format("'messages[{}].role' must be a string", i));
    const std::string r = role->get<std::string>();
    ChatMessage m;
    if (r == "system" || r == "developer") {
      m.role = ChatRole::system;
    } else if (r == "user") {
      m.role = ChatRole::user;
    } else if (r == "assistant") {
      m.role = ChatRole::assistant;
    } else {
      bad(
          fmt::format("'messages[{}].role' {} is not supported (system, developer, user or "
                      "assistant)",
                      i, shown(*role)));
    }
    const json* content = field(msg, "content");
    if (!content) {
      if (m.role != ChatRole::assistant) bad(fmt::format("'messages[{}].content' is required", i));
    } else if (content->is_string()) {
      m.content = content->get<std::string>();
    } else if (content->is_array()) {
      for (size_t k = 0; k < content->size(); ++k) {
        const json& part = (*content)[k];
        const json* type = part.is_object() ? field(part, "type") : nullptr;
        if (!type || !type->is_string() || type->get<std::string>() != "text")
          bad(
              fmt::format("'messages[{}].content[{}]' must be a {{\"type\": \"text\"}} part "
                          "(berth reads text only), got {}",
                          i, k, shown(part)));
        const json* text = field(part, "text");
        if (!text || !text->is_string())
          bad(fmt::format("'messages[{}].content[{}].text' must be a string", i, k));
        m.content += text->get<std::string>();
      }
    } else {
      bad(fmt::format("'messages[{}].content' must be a string or an array of text parts, got {}",
                      i, shown(*content)));
    }
    if (const json* tc = field(msg, "tool_calls"); tc && !(tc->is_array() && tc->empty()))
      bad(fmt::format("'messages[{}].tool_calls' is not supported", i));
    out.push_back(std::move(m));
  }
  return out;
}

ChatOptions parse_chat_options(const json& body) {
  ChatOptions o;
  const json* kw = field(body, "chat_template_kwargs");
  if (!kw || kw->is_null()) return o;
  if (!kw->is_object())
    bad(fmt::format("'chat_template_kwargs' must be an object, got {}", shown(*kw)));
  if (const json* t = field(*kw, "enable_thinking"); t && !t->is_null()) {
    if (!t->is_boolean())
      bad(fmt::format("'chat_template_kwargs.enable_thinking' must be true or false, got {}",
                      shown(*t)));
    o.enable_thinking = t->get<bool>();
  }
  return o;
}

CompletionRequest parse_completion(const json& j, Endpoint endpoint, const ModelContext& m) {
  CompletionRequest r;
  r.endpoint = endpoint;
  refuse_unsupported(j, endpoint);
  r.stream = get_bool(j, "stream", false);
  if (const json* so = field(j, "stream_options")) {
    if (!so->is_object())
      bad(fmt::format("'stream_options' must be an object, got {}", shown(*so)));
    r.include_usage = get_bool(*so, "include_usage", false);
  }

  // Prompt.
  if (endpoint == Endpoint::chat) {
    const std::vector<ChatMessage> msgs = parse_messages(j);
    const ChatOptions options = parse_chat_options(j);
    std::vector<ChatPiece> pieces;
    try {
      pieces = render_chat(m.chat_format, msgs, true, options);
    } catch (const Error& e) {
      bad(fmt::format("'messages': {}", e.what()));
    }
    r.gen.prompt = tokenize_chat(*m.tok, pieces, true);
    r.gen.stop_ids = m.chat_stop_ids;
  } else {
    r.gen.prompt = get_prompt(j, m, r.prompt_text);
  }
  if (r.gen.prompt.empty())
    bad("the prompt is empty and the vocabulary adds no BOS token: there is nothing to start from");

  // Token limit: max_completion_tokens (newer OpenAI), max_tokens, n_predict (llama-server).
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  int64_t limit = -1;
  for (const char* key : {"n_predict", "max_tokens", "max_completion_tokens"})
    if (field(j, key)) limit = get_int(j, key, -1, kMax, -1);
  r.gen.max_tokens = limit;

  SamplerParams& sp = r.gen.sampling.sampler;
  sp.temp = get_number(j, "temperature", 0.0, 1e6, sp.temp);
  sp.top_k = static_cast<int32_t>(get_int(j, "top_k", 0, kMax, sp.top_k));
  sp.top_p = get_number(j, "top_p", 0.0, 1.0, sp.top_p);
  sp.min_p = get_number(j, "min_p", 0.0, 1.0, sp.min_p);
  sp.repeat_penalty = get_number(j, "repeat_penalty", 1e-6, 1e6, sp.repeat_penalty);
  sp.repeat_last_n =
      static_cast<int32_t>(get_int(j, "repeat_last_n", 0, 1 << 20, sp.repeat_last_n));
  const int64_t seed = get_int(j, "seed", -1, 0xFFFFFFFFLL, -1);
  sp.seed = seed < 0 ? 0xFFFFFFFFu : static_cast<uint64_t>(seed);
  r.gen.sampling.presence_penalty = get_number(j, "presence_penalty", -2.0, 2.0, 0.0f);
  r.gen.sampling.frequency_penalty = get_number(j, "frequency_penalty", -2.0, 2.0, 0.0f);
  r.stop = get_stops(j);
  r.gen.cache_prompt = get_bool(j, "cache_prompt", true);
  r.gen.ignore_eos = get_bool(j, "ignore_eos", false);
  r.gen.slot = static_cast<int32_t>(get_int(j, "id_slot", -1, 1 << 20, -1));
  r.gen.sampling.logit_bias = get_logit_bias(j, m.n_vocab);

  // Log-probabilities: chat {logprobs: bool, top_logprobs: 0..20}; completions {logprobs:
  // 0..5} (the number of top tokens); native {n_probs: 0..20}.
  if (endpoint == Endpoint::chat) {
    r.logprobs = get_bool(j, "logprobs", false);
    r.top_logprobs = static_cast<int32_t>(get_int(j, "top_logprobs", 0, 20, 0));
    if (r.top_logprobs > 0 && !r.logprobs) bad("'top_logprobs' needs 'logprobs': true");
  } else if (endpoint == Endpoint::completions) {
    if (field(j, "logprobs")) {
      r.logprobs = true;
      r.top_logprobs = static_cast<int32_t>(get_int(j, "logprobs", 0, 5, 0));
    }
  } else {
    r.top_logprobs = static_cast<int32_t>(get_int(j, "n_probs", 0, 20, 0));
    r.logprobs = r.top_logprobs > 0;
    r.return_tokens = get_bool(j, "return_tokens", false);
  }
  r.gen.sampling.logprobs = r.logprobs;
  r.gen.sampling.n_top_logprobs = r.top_logprobs;
  return r;
}

}  // namespace berth::server
