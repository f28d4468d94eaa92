// The request side of the HTTP API: JSON bodies of /v1/chat/completions, /v1/completions and
// llama-server's /completion turned into a GenerationRequest, every field checked. Field names
// and meanings are OpenAI's (https://platform.openai.com/docs/api-reference/chat/create) with
// llama-server's extras (tools/server/README.md in llama.cpp): n_predict, cache_prompt, id_slot,
// n_probs, repeat_penalty, repeat_last_n, min_p, top_k, ignore_eos, return_tokens, and
// logit_bias as [[id, bias], ...] pairs (bias false: the token is banned) beside OpenAI's object.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "berth/models/chat.h"
#include "berth/models/tokenizer.h"
#include "berth/server/engine.h"

namespace berth::server {

/// An error the HTTP layer answers with `{"error":{"code":status,"message","type"}}` plus the
/// members of `extra` (e.g. n_prompt_tokens and n_ctx for exceed_context_size_error).
struct ApiError {
  int status = 400;
  std::string type = "invalid_request_error";
  std::string message;
  nlohmann::json extra = nlohmann::json::object();
};

/// Which endpoint a completion request came to (they differ in fields and response shape).
enum class Endpoint {
  chat,         ///< POST /v1/chat/completions
  completions,  ///< POST /v1/completions (OpenAI's legacy text completions)
  native,       ///< POST /completion (llama-server's own)
};

/// What the API layer knows of the loaded model.
struct ModelContext {
  const Tokenizer* tok = nullptr;
  ChatFormat chat_format = ChatFormat::chatml;
  std::string chat_template;           ///< tokenizer.chat_template, "" when absent
  std::vector<int32_t> chat_stop_ids;  ///< chat_stop_ids(tok, chat_format)
  std::string model_path;
  std::string alias;  ///< the `model` field of responses (-a; default: the path)
  int64_t n_vocab = 0, n_ctx_train = 0, n_embd = 0, n_layer = 0;
  uint64_t file_size = 0;  ///< bytes
};

/// A checked completion request.
struct CompletionRequest {
  Endpoint endpoint = Endpoint::chat;
  GenerationRequest gen;
  std::vector<std::string> stop;  ///< stop strings (non-empty, valid UTF-8)
  bool stream = false;
  bool include_usage = false;  ///< stream_options.include_usage
  bool logprobs = false;
  int32_t top_logprobs = 0;
  bool return_tokens = false;  ///< native: "tokens" in responses
  std::string prompt_text;     ///< native: the prompt as given (echoed as "prompt")
};

/// Parses a completion request body. Defaults follow llama-server: temperature 0.8, top_k 40,
/// top_p 0.95, min_p 0.05, repeat_penalty 1, repeat_last_n 64, no token limit, a random seed,
/// cache_prompt true. Null values count as absent; unknown fields are ignored (clients send
/// many), except ones berth cannot honour, which are refused: n != 1, tools, a
/// response_format other than text, grammar (but ""), json_schema, echo, multiple prompts. Chat
/// messages are rendered in `m.chat_format` (content never becomes control tokens; "developer"
/// counts as "system"); text prompts (completions, native) are tokenized with the vocabulary's BOS
/// and with control tokens recognised, as llama-server does. Throws ApiError (400
/// invalid_request_error) whose message names the field, e.g. "'temperature' must be a number >= 0,
/// got \"hot\"".
CompletionRequest parse_completion(const nlohmann::json& body, Endpoint endpoint,
                                   const ModelContext& m);

/// The messages of a chat request (`messages`: a non-empty array of {role, content}, content a
/// string, null, or an array of {"type":"text","text":...} parts). Throws ApiError naming the
/// message index and field.
std::vector<ChatMessage> parse_messages(const nlohmann::json& body);

/// The template options of a chat request, llama-server's `chat_template_kwargs` (an object;
/// absent or null: none): `enable_thinking` (true or false; the qwen3 format renders an empty
/// thinking block after the generation prompt for false, other formats ignore it). Other keys are
/// ignored. Throws ApiError naming the field for a non-object or a non-boolean enable_thinking.
ChatOptions parse_chat_options(const nlohmann::json& body);

/// Parses a request body as JSON (must be an object). Throws ApiError naming the byte offset of
/// a syntax error.
nlohmann::json parse_body(const std::string& body);

}  // namespace berth::server
