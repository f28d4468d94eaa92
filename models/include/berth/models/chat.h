// Chat templates: turning a conversation (system / user / assistant messages) into the token
// sequence an instruction-tuned model was trained on.
//
// GGUF stores the model's Jinja template in the string key `tokenizer.chat_template`. berth has
// no Jinja engine: it recognises the template's format from marker strings in its text and
// renders the built-in formats with its own code. The formats (public facts of each model
// family's published chat template):
//
//   chatml    (Qwen, Qwen2/2.5/3, many others): "<|im_start|>ROLE\nCONTENT<|im_end|>\n" per
//             message; generation prompt "<|im_start|>assistant\n"; turn ends at "<|im_end|>".
//   qwen3     (Qwen3, Qwen3.5: ChatML with thinking tags, as the chat_template of Qwen3's
//             tokenizer_config.json renders a conversation without tools): as chatml, except
//             that an assistant message's content loses its reasoning "...</think>" part
//             (the text after the last "</think>", leading newlines dropped), and an assistant
//             message after the last user query that is the last message, or has reasoning,
//             is rendered "<think>\nREASONING\n</think>\n\nCONTENT" (REASONING: the text before
//             the first "</think>" and after the last "<think>" in it, newlines stripped at both
//             ends); with enable_thinking = false the generation prompt is followed by
//             "<think>\n\n</think>\n\n". A user message of the form
//             "<tool_response>...</tool_response>" does not count as a query.
//   llama3    (Llama 3 / 3.1 / 3.2 / 3.3): BOS, then
//             "<|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|>" per message with
//             CONTENT trimmed of surrounding whitespace (as the template's `| trim`); generation
//             prompt "<|start_header_id|>assistant<|end_header_id|>\n\n"; turn ends at
//             "<|eot_id|>".
//   mistral   (Mistral-7B-Instruct v0.1-v0.3, Mixtral-Instruct): BOS, then
//             "[INST] USER [/INST]" per user message and "ASSISTANT</s>" per reply; a system
//             prompt goes in front of the first user message, "SYSTEM\n\nUSER"; the generation
//             prompt is empty (the model answers right after "[/INST]"); turn ends at "</s>".
//   deepseek3 (DeepSeek V2.5 / V3 / R1, fullwidth bars "｜" and "▁"): BOS, the system prompt
//             as is, then "<｜User｜>USER" per user message and
//             "<｜Assistant｜>ASSISTANT<｜end▁of▁sentence｜>" per reply; generation prompt
//             "<｜Assistant｜>"; turn ends at "<｜end▁of▁sentence｜>".
//
// The BOS token is not part of the rendering: tokenize_chat() adds the vocabulary's BOS when
// asked to and the vocabulary wants one (tokenizer.ggml.add_bos_token), as llama.cpp does.
// Rendering returns pieces so that template markup can become control tokens while message
// content never does, even when a user types "<|im_end|>".
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "berth/models/tokenizer.h"

namespace berth::gguf {
class File;
}

namespace berth {

/// A built-in chat format (see the file comment for each one's layout).
enum class ChatFormat { chatml, llama3, mistral, deepseek3, qwen3 };

/// Who wrote a message.
enum class ChatRole { system, user, assistant };

/// One message of a conversation; `content` is UTF-8 text as the user or model wrote it.
struct ChatMessage {
  ChatRole role = ChatRole::user;
  std::string content;
};

/// A run of rendered text. `special` = true: template markup, tokenized with control-token
/// matching ("<|im_start|>" becomes its token); false: message content, tokenized as plain text.
/// `message`: index of the message whose content this piece carries, or -1 for markup (a
/// caller can swap an assistant message's content piece for the token ids the model generated).
struct ChatPiece {
  std::string text;
  bool special = false;
  int32_t message = -1;
};

/// "chatml", "llama3", "mistral", "deepseek3" or "qwen3": the name --chat-template takes.
std::string_view chat_format_name(ChatFormat format);

/// The built-in names, comma-separated, for messages and --help ("chatml, llama3, mistral,
/// deepseek3, qwen3").
std::string chat_format_names();

/// The format named `name` (one of chat_format_names()). Throws Error(invalid_argument) naming
/// the value and the built-in names for any other name.
ChatFormat chat_format_from_name(std::string_view name);

/// Recognises a Jinja chat template (the text of `tokenizer.chat_template`) by its markers:
/// "<｜User｜>" or "<｜Assistant｜>" -> deepseek3, "<|start_header_id|>" -> llama3,
/// "<|im_start|>" -> qwen3 when the template also has "<think>", chatml otherwise, "[INST]" ->
/// mistral, checked in that order (DeepSeek-distilled
/// Qwen models use DeepSeek's markers in a Qwen vocabulary). Throws Error(unsupported) for a
/// template without any of them; the message names `--chat-template NAME` and the built-in names.
ChatFormat detect_chat_format(std::string_view template_text);

/// The chat format for a model file: `override_name` when not empty (chat_format_from_name),
/// otherwise detect_chat_format() on the file's `tokenizer.chat_template`. Throws
/// Error(missing) naming the key, the file and `--chat-template NAME` when the key is absent (or
/// not a string) and no override is given; the errors of the two functions above otherwise.
ChatFormat chat_format_for(const gguf::File& file, std::string_view override_name);

/// Options of a rendering (Jinja variables some templates read).
struct ChatOptions {
  /// qwen3: `enable_thinking`. Unset (the template's "not defined") or true: the generation
  /// prompt is "<|im_start|>assistant\n" and the model decides whether to think; false: an
  /// empty thinking block follows it. Other formats ignore it.
  std::optional<bool> enable_thinking;
};

/// Renders `messages` in `format`. With `add_generation_prompt`, ends with the markup that
/// opens an assistant reply (for chatml and qwen3 "<|im_start|>assistant\n" with no thinking
/// block: Qwen3 then decides itself whether to think, as its template does when
/// enable_thinking is not set). In mistral and deepseek3 a system message is allowed only as the
/// first message (elsewhere: invalid_argument naming its index); chatml, qwen3 and llama3 render
/// one anywhere as its own block. Each
/// message's content is exactly one piece (possibly empty) with `message` set to its index,
/// except a system prompt in mistral, which shares the first user message's piece; in qwen3
/// an assistant's thinking block is part of its content piece (so a caller that swaps the
/// piece for generated ids keeps what the model generated). Rendering messages[0..k] is a
/// prefix of rendering messages[0..n] for k < n (qwen3: unless message k is an assistant
/// message after the last query, whose thinking block disappears once a message follows), and
/// the generation prompt is a prefix of an assistant message's rendering, so a growing
/// conversation only appends. Throws Error(invalid_argument) naming the index for a system
/// message after the first.
std::vector<ChatPiece> render_chat(ChatFormat format, std::span<const ChatMessage> messages,
                                   bool add_generation_prompt, const ChatOptions& options = {});

/// Concatenated text of `pieces` (what a Jinja engine would output, minus the BOS token).
std::string chat_text(std::span<const ChatPiece> pieces);

/// The markup that closes an assistant message in `format`, as pieces ("<|im_end|>\n" for
/// chatml and qwen3, "<|eot_id|>" for llama3, "</s>" for mistral, "<｜end▁of▁sentence｜>" for
/// deepseek3).
std::vector<ChatPiece> chat_end_of_turn(ChatFormat format);

/// Token texts that end an assistant turn in `format`; generation should stop at them (besides
/// the vocabulary's end-of-generation tokens): {"<|im_end|>"} (chatml, qwen3),
/// {"<|eot_id|>", "<|eom_id|>"},
/// {"</s>"}, {"<｜end▁of▁sentence｜>"}.
std::vector<std::string> chat_stop_texts(ChatFormat format);

/// Ids of chat_stop_texts(format) that are single tokens of `tok` (texts the vocabulary does
/// not have are left out), ascending and unique.
std::vector<int32_t> chat_stop_ids(const Tokenizer& tok, ChatFormat format);

/// Appends the tokens of one piece to `out`: special pieces with control-token matching, content
/// pieces as plain text. Each piece is tokenized on its own, so merges never cross a piece
/// boundary and the tokens of a conversation's prefix never change when it grows. With a
/// SentencePiece vocabulary that adds a dummy space prefix ("▁"), every piece would get one; a
/// piece's single leading space is then dropped so that the dummy prefix stands for it ("[INST]"
/// + " Hello" gives "▁Hello", not "▁▁Hello"). Empty pieces add nothing. Throws what
/// Tokenizer::encode throws.
void append_chat_piece_tokens(const Tokenizer& tok, const ChatPiece& piece,
                              std::vector<int32_t>& out);

/// Token ids of a rendered conversation: the vocabulary's BOS first when `add_bos` and the
/// vocabulary adds one (tokenizer.ggml.add_bos_token; never EOS), then each piece as
/// append_chat_piece_tokens() gives it.
std::vector<int32_t> tokenize_chat(const Tokenizer& tok, std::span<const ChatPiece> pieces,
                                   bool add_bos);

}  // namespace berth
