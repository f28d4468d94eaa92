// ChatSession: multi-turn chat with KV-cache reuse between turns.
#include "berth/runtime/chat.h"

#include <fmt/format.h>

#include <algorithm>

#include "berth/core/error.h"

namespace berth {

ChatSession::ChatSession(Session& session, const Tokenizer& tok, Sampler& sampler,
                         ChatFormat format, std::string system_prompt, bool add_bos)
    : session_(session),
      tok_(tok),
      sampler_(sampler),
      format_(format),
      add_bos_(add_bos),
      stop_ids_(chat_stop_ids(tok, format)) {
  if (!system_prompt.empty()) {
    messages_.push_back(ChatMessage{ChatRole::system, std::move(system_prompt)});
    reply_ids_.emplace_back();
  }
}

std::vector<int32_t> ChatSession::render(
    const std::vector<ChatMessage>& messages,
    const std::vector<std::optional<std::vector<int32_t>>>& ids, bool add_generation_prompt) const {
  const std::vector<ChatPiece> pieces = render_chat(format_, messages, add_generation_prompt);
  std::vector<int32_t> out = tokenize_chat(tok_, {}, add_bos_);  // the BOS, if any
  for (const ChatPiece& p : pieces) {
    if (p.message >= 0 && static_cast<size_t>(p.message) < ids.size() && ids[p.message]) {
      const std::vector<int32_t>& reply = *ids[p.message];
      out.insert(out.end(), reply.begin(), reply.end());
    } else {
      append_chat_piece_tokens(tok_, p, out);
    }
  }
  return out;
}

std::vector<int32_t> ChatSession::render_tokens(bool add_generation_prompt) const {
  return render(messages_, reply_ids_, add_generation_prompt);
}

std::string ChatSession::respond(std::string_view user_text, int32_t n_predict,
                                 const TokenCallback& on_token) {
  std::vector<ChatMessage> messages = messages_;
  messages.push_back(ChatMessage{ChatRole::user, std::string(user_text)});
  std::vector<std::optional<std::vector<int32_t>>> ids = reply_ids_;
  ids.emplace_back();
  const std::vector<int32_t> prompt = render(messages, ids, /*add_generation_prompt=*/true);
  if (prompt.empty())
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("the {} rendering of the conversation has no tokens",
                            chat_format_name(format_)));
  if (static_cast<int64_t>(prompt.size()) > session_.n_ctx())
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("the conversation ({} tokens with turn {}) does not fit in the "
                            "context of {} tokens (raise -c)",
                            prompt.size(), n_turns_ + 1, session_.n_ctx()));

  // Longest common prefix of what the cache holds and the new rendering. At least one token is
  // evaluated: its logits start the reply.
  size_t prefix = 0;
  const size_t n = std::min(cache_.size(), prompt.size());
  while (prefix < n && cache_[prefix] == prompt[prefix]) ++prefix;
  if (prefix == prompt.size()) --prefix;
  // A recurrent state cannot be cut back: the conversation is evaluated again from the start.
  if (!session_.can_truncate() && static_cast<int64_t>(prefix) < session_.n_past()) prefix = 0;
  session_.truncate(static_cast<int64_t>(prefix));
  cache_.resize(prefix);

  std::vector<int32_t> reply;
  std::string text;
  const auto record_cache = [&] {
    // The cache holds the prompt, then the reply's tokens that were fed back (all but the last
    // sampled one).
    const auto n_past = static_cast<size_t>(session_.n_past());
    BERTH_CHECK(n_past >= prefix && n_past <= prompt.size() + reply.size(),
                fmt::format("chat: the session holds {} tokens, the turn knows {}", n_past,
                            prompt.size() + reply.size()));
    cache_.assign(prompt.begin(),
                  prompt.begin() + static_cast<ptrdiff_t>(std::min(n_past, prompt.size())));
    if (n_past > prompt.size())
      cache_.insert(cache_.end(), reply.begin(),
                    reply.begin() + static_cast<ptrdiff_t>(n_past - prompt.size()));
  };

  const std::span<const int32_t> suffix(prompt.data() + prefix, prompt.size() - prefix);
  GenerateStats gen;
  try {
    gen = generate(session_, tok_, sampler_, suffix, n_predict,
                   [&](int32_t id, std::string_view piece) {
                     if (id >= 0 && std::binary_search(stop_ids_.begin(), stop_ids_.end(), id))
                       return false;  // the format's end of turn
                     if (id >= 0) reply.push_back(id);
                     text += piece;
                     return on_token ? on_token(id, piece) : true;
                   });
  } catch (...) {
    record_cache();
    throw;
  }
  record_cache();

  messages.push_back(ChatMessage{ChatRole::assistant, text});
  ids.emplace_back(reply);
  messages_ = std::move(messages);
  reply_ids_ = std::move(ids);
  last_reply_ = std::move(reply);
  last_.n_rendered = static_cast<int64_t>(prompt.size());
  last_.n_reused = static_cast<int64_t>(prefix);
  last_.n_prefilled = static_cast<int64_t>(suffix.size());
  last_.gen = gen;
  n_prefilled_total_ += last_.n_prefilled;
  ++n_turns_;
  return text;
}

}  // namespace berth
