// A multi-turn chat over one Session that keeps the KV cache between turns: each turn prefills
// only the tokens the cache does not already hold.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "berth/models/chat.h"
#include "berth/models/tokenizer.h"
#include "berth/runtime/sampler.h"
#include "berth/runtime/session.h"

namespace berth {

/// What one call of ChatSession::respond() did.
struct ChatTurnStats {
  int64_t n_rendered = 0;   ///< tokens of the conversation up to the generation prompt
  int64_t n_reused = 0;     ///< of those, tokens already in the KV cache (common prefix)
  int64_t n_prefilled = 0;  ///< tokens evaluated before the reply: n_rendered - n_reused
  GenerateStats gen;        ///< the reply's generation (gen.n_prompt == n_prefilled)
};

/// A conversation with a model. Each respond() appends the user's message, renders the whole
/// conversation in `format` (render_chat + tokenize_chat, with each earlier reply's content
/// replaced by the token ids the model generated, never re-tokenized), finds the longest
/// common prefix with the token ids the KV cache holds, truncates the session there and
/// evaluates only the rest, then generates the reply. Generation stops at the vocabulary's
/// end-of-generation tokens, at the format's end-of-turn tokens (chat_stop_ids), after
/// `n_predict` tokens, when the context is full or when the callback returns false; the reply
/// is recorded either way and the next turn's rendering closes it with the format's end-of-turn
/// markup, so the whole earlier conversation stays in the cache.
///
/// The session, tokenizer and sampler must outlive the ChatSession, and nothing else may use the
/// session meanwhile (the ChatSession tracks what its KV cache holds). The sampler keeps its
/// state across turns: its repetition window sees every evaluated token and each sampled stop
/// token. Not thread-safe.
class ChatSession {
 public:
  /// `system_prompt`: the first message when not empty. `add_bos`: start the conversation with
  /// the vocabulary's BOS token when it asks for one (tokenizer.ggml.add_bos_token).
  ChatSession(Session& session, const Tokenizer& tok, Sampler& sampler, ChatFormat format,
              std::string system_prompt = {}, bool add_bos = true);

  /// Appends the user turn `user_text`, prefills what the cache lacks and generates the reply,
  /// streaming each token and the text it completes to `on_token` (the end-of-turn token is not
  /// passed; the last call may have id -1 with held-back bytes). `n_predict` < 0: until the end
  /// of the turn or a full context. Returns the reply's text. Throws Error(invalid_argument)
  /// when the rendered conversation does not fit in the context (naming both sizes; the turn
  /// is then not recorded) and what the callback or Session::eval throw.
  std::string respond(std::string_view user_text, int32_t n_predict,
                      const TokenCallback& on_token = {});

  /// Token ids of the conversation so far (replies as generated, each closed by the end-of-turn
  /// markup), followed by the generation prompt when `add_generation_prompt`.
  std::vector<int32_t> render_tokens(bool add_generation_prompt) const;

  const std::vector<ChatMessage>& messages() const { return messages_; }
  /// Token ids the KV cache holds, positions 0 .. session.n_past() - 1.
  const std::vector<int32_t>& cache_tokens() const { return cache_; }
  /// The last reply's token ids (without the stop token).
  const std::vector<int32_t>& last_reply_tokens() const { return last_reply_; }
  const ChatTurnStats& last_turn() const { return last_; }
  int64_t n_prefilled_last() const { return last_.n_prefilled; }    ///< tokens, last turn
  int64_t n_prefilled_total() const { return n_prefilled_total_; }  ///< tokens, all turns
  int32_t n_turns() const { return n_turns_; }
  ChatFormat format() const { return format_; }

 private:
  std::vector<int32_t> render(const std::vector<ChatMessage>& messages,
                              const std::vector<std::optional<std::vector<int32_t>>>& ids,
                              bool add_generation_prompt) const;

  Session& session_;
  const Tokenizer& tok_;
  Sampler& sampler_;
  ChatFormat format_;
  bool add_bos_;
  std::vector<int32_t> stop_ids_;
  std::vector<ChatMessage> messages_;
  /// Parallel to messages_: the generated token ids of each assistant message.
  std::vector<std::optional<std::vector<int32_t>>> reply_ids_;
  std::vector<int32_t> cache_;
  std::vector<int32_t> last_reply_;
  ChatTurnStats last_;
  int64_t n_prefilled_total_ = 0;
  int32_t n_turns_ = 0;
};

}  // namespace berth
