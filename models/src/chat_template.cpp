// Built-in chat formats: detection from the Jinja template text and rendering (see chat.h for
// the layout of each format).
#include <fmt/format.h>

#include <algorithm>
#include <array>

#include "berth/core/error.h"
#include "berth/io/gguf.h"
#include "berth/models/chat.h"

namespace berth {

namespace {

constexpr std::array<ChatFormat, 5> kFormats = {ChatFormat::chatml, ChatFormat::llama3,
                                                ChatFormat::mistral, ChatFormat::deepseek3,
                                                ChatFormat::qwen3};

// DeepSeek's markers use U+FF5C FULLWIDTH VERTICAL LINE and U+2581 LOWER ONE EIGHTH BLOCK.
constexpr std::string_view kDsUser = "<｜User｜>";
constexpr std::string_view kDsAssistant = "<｜Assistant｜>";
constexpr std::string_view kDsEos = "<｜end▁of▁sentence｜>";

std::string_view role_name(ChatRole role) {
  switch (role) {
    case ChatRole::system:
      return "system";
    case ChatRole::user:
      return "user";
    case ChatRole::assistant:
      return "assistant";
  }
  return "?";
}

/// Whitespace as Jinja's `trim` (Python's str.strip()) sees it, restricted to ASCII.
std::string trim(std::string_view s) {
  const auto ws = [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
  };
  size_t b = 0, e = s.size();
  while (b < e && ws(s[b])) ++b;
  while (e > b && ws(s[e - 1])) --e;
  return std::string(s.substr(b, e - b));
}

class Renderer {
 public:
  explicit Renderer(std::vector<ChatPiece>& out) : out_(out) {}
  void markup(std::string_view text) {
    // Adjacent markup merges into one piece (the result is the same text either way).
    if (!out_.empty() && out_.back().special && out_.back().message < 0) {
      out_.back().text += text;
    } else {
      out_.push_back(ChatPiece{std::string(text), true, -1});
    }
  }
  void content(std::string text, size_t message) {
    out_.push_back(ChatPiece{std::move(text), false, static_cast<int32_t>(message)});
  }

 private:
  std::vector<ChatPiece>& out_;
};

void render_chatml(std::span<const ChatMessage> msgs, bool gen, Renderer& r) {
  for (size_t i = 0; i < msgs.size(); ++i) {
    r.markup(fmt::format("<|im_start|>{}\n", role_name(msgs[i].role)));
    r.content(msgs[i].content, i);
    r.markup("<|im_end|>\n");
  }
  if (gen) r.markup("<|im_start|>assistant\n");
}

/// Python's str.strip / lstrip / rstrip of newline characters only (the template's
/// .strip('\n') and friends).
std::string_view strip_nl(std::string_view s, bool left, bool right) {
  while (left && !s.empty() && s.front() == '\n') s.remove_prefix(1);
  while (right && !s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}

bool is_tool_response(std::string_view s) {
  return s.starts_with("<tool_response>") && s.ends_with("</tool_response>");
}

// Qwen3's chat_template (tokenizer_config.json) without tools: see chat.h.
void render_qwen3(std::span<const ChatMessage> msgs, bool gen, const ChatOptions& opts,
                  Renderer& r) {
  // The last user message that is a query (not a tool response); the last message if none.
  size_t last_query = msgs.empty() ? 0 : msgs.size() - 1;
  for (size_t i = msgs.size(); i-- > 0;) {
    if (msgs[i].role == ChatRole::user && !is_tool_response(msgs[i].content)) {
      last_query = i;
      break;
    }
  }
  for (size_t i = 0; i < msgs.size(); ++i) {
    const ChatMessage& m = msgs[i];
    r.markup(fmt::format("<|im_start|>{}\n", role_name(m.role)));
    if (m.role != ChatRole::assistant) {
      r.content(m.content, i);
      r.markup("<|im_end|>\n");
      continue;
    }
    std::string_view content = m.content, reasoning;
    if (const size_t end = content.rfind("</think>"); end != std::string_view::npos) {
      // content.split('</think>')[-1].lstrip('\n'); the reasoning: split('</think>')[0]
      // .rstrip('\n').split('<think>')[-1].lstrip('\n').
      std::string_view before = strip_nl(content.substr(0, content.find("</think>")), false, true);
      if (const size_t open = before.rfind("<think>"); open != std::string_view::npos)
        before.remove_prefix(open + 7);
      reasoning = strip_nl(before, true, false);
      content = strip_nl(content.substr(end + 8), true, false);
    }
    const bool last = i + 1 == msgs.size();
    if (i > last_query && (last || !reasoning.empty())) {
      r.content(fmt::format("<think>\n{}\n</think>\n\n{}", strip_nl(reasoning, true, true),
                            strip_nl(content, true, false)),
                i);
    } else {
      r.content(std::string(content), i);
    }
    r.markup("<|im_end|>\n");
  }
  if (gen) {
    r.markup("<|im_start|>assistant\n");
    if (opts.enable_thinking == false) r.markup("<think>\n\n</think>\n\n");
  }
}

void render_llama3(std::span<const ChatMessage> msgs, bool gen, Renderer& r) {
  for (size_t i = 0; i < msgs.size(); ++i) {
    r.markup(fmt::format("<|start_header_id|>{}<|end_header_id|>\n\n", role_name(msgs[i].role)));
    r.content(trim(msgs[i].content), i);
    r.markup("<|eot_id|>");
  }
  if (gen) r.markup("<|start_header_id|>assistant<|end_header_id|>\n\n");
}

void render_mistral(std::span<const ChatMessage> msgs, bool gen, Renderer& r) {
  std::string system;
  bool system_pending = false;
  for (size_t i = 0; i < msgs.size(); ++i) {
    const ChatMessage& m = msgs[i];
    switch (m.role) {
      case ChatRole::system:
        system = m.content;
        system_pending = true;
        break;
      case ChatRole::user:
        r.markup("[INST]");
        if (system_pending) {
          r.content(" " + system + "\n\n" + m.content, i);
          system_pending = false;
        } else {
          r.content(" " + m.content, i);
        }
        r.markup(" [/INST]");
        break;
      case ChatRole::assistant:
        r.content(m.content, i);
        r.markup("</s>");
        break;
    }
  }
  (void)gen;  // the model answers right after "[/INST]": the generation prompt is empty
}

void render_deepseek3(std::span<const ChatMessage> msgs, bool gen, Renderer& r) {
  for (size_t i = 0; i < msgs.size(); ++i) {
    const ChatMessage& m = msgs[i];
    switch (m.role) {
      case ChatRole::system:
        r.content(m.content, i);
        break;
      case ChatRole::user:
        r.markup(kDsUser);
        r.content(m.content, i);
        break;
      case ChatRole::assistant:
        r.markup(kDsAssistant);
        r.content(m.content, i);
        r.markup(kDsEos);
        break;
    }
  }
  if (gen) r.markup(kDsAssistant);
}

/// True when the vocabulary puts a dummy "▁" in front of every text fragment (SentencePiece's
/// add_dummy_prefix): the first token of "a" then decodes with a leading space.
bool adds_space_prefix(const Tokenizer& tok) {
  const std::vector<int32_t> probe = tok.encode("a", /*add_bos=*/false);
  return !probe.empty() && tok.token_to_piece(probe.front()).starts_with(' ');
}

void append_piece(const Tokenizer& tok, const ChatPiece& piece, bool space_prefix,
                  std::vector<int32_t>& out) {
  std::string_view text = piece.text;
  if (space_prefix && text.starts_with(' ')) text.remove_prefix(1);
  if (text.empty()) return;
  const std::vector<int32_t> ids = tok.encode(text, /*add_bos=*/false, piece.special);
  out.insert(out.end(), ids.begin(), ids.end());
}

}  // namespace

std::string_view chat_format_name(ChatFormat format) {
  switch (format) {
    case ChatFormat::chatml:
      return "chatml";
    case ChatFormat::llama3:
      return "llama3";
    case ChatFormat::mistral:
      return "mistral";
    case ChatFormat::deepseek3:
      return "deepseek3";
    case ChatFormat::qwen3:
      return "qwen3";
  }
  return "?";
}

std::string chat_format_names() {
  std::string s;
  for (ChatFormat f : kFormats) {
    if (!s.empty()) s += ", ";
    s += chat_format_name(f);
  }
  return s;
}

ChatFormat chat_format_from_name(std::string_view name) {
  for (ChatFormat f : kFormats)
    if (chat_format_name(f) == name) return f;
  throw Error(ErrorCategory::invalid_argument,
              fmt::format("unknown chat template '{}' (--chat-template takes one of: {})", name,
                          chat_format_names()));
}

ChatFormat detect_chat_format(std::string_view t) {
  if (t.find(kDsUser) != std::string_view::npos || t.find(kDsAssistant) != std::string_view::npos)
    return ChatFormat::deepseek3;
  if (t.find("<|start_header_id|>") != std::string_view::npos) return ChatFormat::llama3;
  if (t.find("<|im_start|>") != std::string_view::npos)
    return t.find("<think>") != std::string_view::npos ? ChatFormat::qwen3 : ChatFormat::chatml;
  if (t.find("[INST]") != std::string_view::npos) return ChatFormat::mistral;
  throw Error(ErrorCategory::unsupported,
              fmt::format("the model's chat template (tokenizer.chat_template, {} bytes) is not "
                          "one of berth's built-in formats; choose one with --chat-template NAME "
                          "(NAME: {})",
                          t.size(), chat_format_names()));
}

ChatFormat chat_format_for(const gguf::File& file, std::string_view override_name) {
  if (!override_name.empty()) return chat_format_from_name(override_name);
  const gguf::Value* v = file.find("tokenizer.chat_template");
  if (v == nullptr)
    throw Error(ErrorCategory::missing,
                fmt::format("{}: the model has no chat template (key tokenizer.chat_template); "
                            "choose one with --chat-template NAME (NAME: {})",
                            file.path(), chat_format_names()));
  return detect_chat_format(file.get_string("tokenizer.chat_template"));
}

std::vector<ChatPiece> render_chat(ChatFormat format, std::span<const ChatMessage> messages,
                                   bool add_generation_prompt, const ChatOptions& options) {
  // chatml, qwen3 and llama3 render a system message anywhere as a block of its own (Qwen3's
  // template: `message.role == "system" and not loop.first`); mistral folds the system prompt
  // into the first user turn and deepseek3 puts it before the first, so there it must come first.
  const bool system_first_only = format == ChatFormat::mistral || format == ChatFormat::deepseek3;
  for (size_t i = 1; i < messages.size() && system_first_only; ++i)
    if (messages[i].role == ChatRole::system)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("chat message {} is a system message; only the first message may "
                              "be one ({} format)",
                              i, chat_format_name(format)));
  std::vector<ChatPiece> out;
  Renderer r(out);
  switch (format) {
    case ChatFormat::chatml:
      render_chatml(messages, add_generation_prompt, r);
      break;
    case ChatFormat::llama3:
      render_llama3(messages, add_generation_prompt, r);
      break;
    case ChatFormat::mistral:
      render_mistral(messages, add_generation_prompt, r);
      break;
    case ChatFormat::deepseek3:
      render_deepseek3(messages, add_generation_prompt, r);
      break;
    case ChatFormat::qwen3:
      render_qwen3(messages, add_generation_prompt, options, r);
      break;
  }
  return out;
}

std::string chat_text(std::span<const ChatPiece> pieces) {
  std::string s;
  for (const ChatPiece& p : pieces) s += p.text;
  return s;
}

std::vector<ChatPiece> chat_end_of_turn(ChatFormat format) {
  switch (format) {
    case ChatFormat::chatml:
    case ChatFormat::qwen3:
      return {ChatPiece{"<|im_end|>\n", true, -1}};
    case ChatFormat::llama3:
      return {ChatPiece{"<|eot_id|>", true, -1}};
    case ChatFormat::mistral:
      return {ChatPiece{"</s>", true, -1}};
    case ChatFormat::deepseek3:
      return {ChatPiece{std::string(kDsEos), true, -1}};
  }
  return {};
}

std::vector<std::string> chat_stop_texts(ChatFormat format) {
  switch (format) {
    case ChatFormat::chatml:
    case ChatFormat::qwen3:
      return {"<|im_end|>"};
    case ChatFormat::llama3:
      return {"<|eot_id|>", "<|eom_id|>"};
    case ChatFormat::mistral:
      return {"</s>"};
    case ChatFormat::deepseek3:
      return {std::string(kDsEos)};
  }
  return {};
}

std::vector<int32_t> chat_stop_ids(const Tokenizer& tok, ChatFormat format) {
  std::vector<int32_t> ids;
  for (const std::string& text : chat_stop_texts(format)) {
    const int32_t id = tok.find_token(text);
    if (id >= 0) ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

void append_chat_piece_tokens(const Tokenizer& tok, const ChatPiece& piece,
                              std::vector<int32_t>& out) {
  append_piece(tok, piece, adds_space_prefix(tok), out);
}

std::vector<int32_t> tokenize_chat(const Tokenizer& tok, std::span<const ChatPiece> pieces,
                                   bool add_bos) {
  std::vector<int32_t> out;
  if (add_bos && tok.add_bos() && tok.bos_id() >= 0) out.push_back(tok.bos_id());
  const bool space_prefix = adds_space_prefix(tok);
  for (const ChatPiece& p : pieces) append_piece(tok, p, space_prefix, out);
  return out;
}

}  // namespace berth
