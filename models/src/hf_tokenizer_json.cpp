// Reader of Hugging Face `tokenizer.json` files (the `tokenizers` library's serialization) for
// byte-level BPE models, producing the arrays GGUF's tokenizer.ggml.* keys hold.
//
// Format facts used (Hugging Face tokenizers, `tokenizer.json`):
//  - model: {"type": "BPE", "vocab": {token: id, ...}, "merges": [...]}; merges are by rank
//    (first = highest priority), either ["left", "right"] pairs (tokenizers >= 0.20) or
//    "left right" strings (older files);
//  - added_tokens: [{"id", "content", "special", ...}, ...], ids usually after the vocab;
//  - pre_tokenizer: a "Split" pre-tokenizer, or a "Sequence" of them ("pretokenizers"), whose
//    "pattern" is {"Regex": "..."} or {"String": "..."}; "ByteLevel" marks a byte-level model.
#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "berth/core/error.h"
#include "berth/core/strings.h"
#include "berth/models/tokenizer.h"
#include "tokenizer_bpe.h"

namespace berth {
namespace {

using nlohmann::json;

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw Error(ErrorCategory::format, fmt::format("{}: {}", path, what));
}

/// The member `key` of object `obj` (named `where` in messages), which must exist.
const json& member(const json& obj, const char* key, const std::string& path,
                   const std::string& where) {
  if (!obj.is_object()) fail(path, fmt::format("{} is not a JSON object", where));
  const auto it = obj.find(key);
  if (it == obj.end()) fail(path, fmt::format("{} has no \"{}\"", where, key));
  return *it;
}

/// Collects the regex patterns of every Split pre-tokenizer in `pre` (itself or, for a
/// Sequence, its members, recursively), in order.
void collect_split_regexes(const json& pre, std::vector<std::string>& out) {
  if (!pre.is_object()) return;
  const auto type = pre.find("type");
  if (type == pre.end() || !type->is_string()) return;
  if (*type == "Sequence") {
    const auto list = pre.find("pretokenizers");
    if (list == pre.end() || !list->is_array()) return;
    for (const json& p : *list) collect_split_regexes(p, out);
  } else if (*type == "Split") {
    const auto pattern = pre.find("pattern");
    if (pattern == pre.end() || !pattern->is_object()) return;
    const auto regex = pattern->find("Regex");
    if (regex != pattern->end() && regex->is_string()) out.push_back(regex->get<std::string>());
  }
}

/// True when `j` (a pre_tokenizer or decoder) is or contains a ByteLevel step.
bool has_byte_level(const json& j) {
  if (!j.is_object()) return false;
  const auto type = j.find("type");
  if (type == j.end() || !type->is_string()) return false;
  if (*type == "ByteLevel") return true;
  for (const char* list_key : {"pretokenizers", "decoders"}) {
    const auto list = j.find(list_key);
    if (list != j.end() && list->is_array()) {
      for (const json& p : *list) {
        if (has_byte_level(p)) return true;
      }
    }
  }
  return false;
}

/// tokenizer.ggml.pre for the Split regexes of a tokenizer.json: the known pre-tokenizer whose
/// regex list is exactly `regexes`, else "default" (documented in read_hf_tokenizer_json).
std::string guess_pre(const std::vector<std::string>& regexes) {
  for (std::string_view name : {"qwen2", "qwen35", "llama-bpe", "deepseek-v3"}) {
    const std::vector<std::string>* known = bpe_pre_regexes(name);
    if (known != nullptr && regexes == *known) return std::string(name);
  }
  return "default";
}

}  // namespace

VocabData read_hf_tokenizer_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorCategory::io, fmt::format("{}: cannot open tokenizer.json", path));
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) throw Error(ErrorCategory::io, fmt::format("{}: read failed", path));
  const std::string text = std::move(buffer).str();

  json root;
  try {
    root = json::parse(text);
  } catch (const json::parse_error& e) {
    fail(path, fmt::format("not valid JSON: {}", e.what()));
  }

  const json& model = member(root, "model", path, "the root");
  if (const auto type = model.find("type"); type != model.end() && *type != "BPE") {
    fail(path, fmt::format("model.type is {}, not \"BPE\"", printable(type->dump())));
  }
  const json null_json;
  const auto pre_it = root.find("pre_tokenizer");
  const json& pre_tokenizer = pre_it == root.end() ? null_json : *pre_it;
  const auto dec_it = root.find("decoder");
  if (!has_byte_level(pre_tokenizer) && (dec_it == root.end() || !has_byte_level(*dec_it))) {
    fail(path, "neither pre_tokenizer nor decoder is ByteLevel: not a byte-level BPE tokenizer");
  }

  // Tokens by id: model.vocab, then added_tokens (which may repeat a vocab entry's id with the
  // same text, as some files do).
  const json& vocab = member(model, "vocab", path, "model");
  if (!vocab.is_object()) fail(path, "model.vocab is not an object of token -> id");
  const auto added = root.find("added_tokens");
  const bool has_added = added != root.end() && !added->is_null();
  if (has_added && !added->is_array()) fail(path, "added_tokens is not an array");
  // Dense ids cannot exceed the number of entries (this also bounds the memory a bad id costs).
  const size_t n_entries = vocab.size() + (has_added ? added->size() : 0);

  std::vector<std::optional<std::string>> by_id;
  std::vector<TokenType> types;
  // `where()` names the entry in messages (built only on failure).
  const auto place = [&](int64_t id, std::string token, TokenType type, const auto& where) {
    if (id < 0 || static_cast<uint64_t>(id) >= n_entries) {
      fail(path, fmt::format("{}: id {} is outside [0, {}): token ids must be dense 0..n-1 over "
                             "the {} entries of model.vocab and added_tokens",
                             where(), id, n_entries, n_entries));
    }
    const auto i = static_cast<size_t>(id);
    if (i >= by_id.size()) {
      by_id.resize(i + 1);
      types.resize(i + 1, TokenType::normal);
    }
    if (by_id[i] && *by_id[i] != token) {
      fail(path, fmt::format("{}: id {} is given to both '{}' and '{}'", where(), id,
                             printable(*by_id[i]), printable(token)));
    }
    by_id[i] = std::move(token);
    types[i] = type;
  };

  by_id.reserve(n_entries);
  types.reserve(n_entries);
  for (const auto& item : vocab.items()) {
    // (Not a structured binding: clang before C++20's P1091 cannot capture one in a lambda.)
    const std::string& token = item.key();
    const auto& id = item.value();
    if (!id.is_number_integer()) {
      fail(path, fmt::format("model.vocab['{}'] is not an integer id", printable(token)));
    }
    place(id.get<int64_t>(), token, TokenType::normal,
          [&] { return fmt::format("model.vocab['{}']", printable(token)); });
  }

  if (has_added) {
    for (size_t k = 0; k < added->size(); ++k) {
      const json& a = (*added)[k];
      const std::string where = fmt::format("added_tokens[{}]", k);
      const json& id = member(a, "id", path, where);
      const json& content = member(a, "content", path, where);
      if (!id.is_number_integer()) fail(path, where + ".id is not an integer");
      if (!content.is_string()) fail(path, where + ".content is not a string");
      const auto special = a.find("special");
      const bool is_special = special != a.end() && special->is_boolean() && special->get<bool>();
      place(id.get<int64_t>(), content.get<std::string>(),
            is_special ? TokenType::control : TokenType::user_defined, [&] { return where; });
    }
  }

  VocabData out;
  out.source = path;
  if (by_id.empty()) fail(path, "model.vocab is empty");
  out.tokens.reserve(by_id.size());
  for (size_t i = 0; i < by_id.size(); ++i) {
    if (!by_id[i]) {
      fail(path, fmt::format("token ids must be dense 0..{}, but id {} is in neither model.vocab "
                             "nor added_tokens",
                             by_id.size() - 1, i));
    }
    out.tokens.push_back(std::move(*by_id[i]));
  }
  out.types = std::move(types);

  const json& merges = member(model, "merges", path, "model");
  if (!merges.is_array()) fail(path, "model.merges is not an array");
  out.merges.reserve(merges.size());
  for (size_t k = 0; k < merges.size(); ++k) {
    const json& m = merges[k];
    if (m.is_string()) {
      out.merges.push_back(m.get<std::string>());  // "left right", checked by make_bpe
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      const std::string& left = m[0].get_ref<const std::string&>();
      const std::string& right = m[1].get_ref<const std::string&>();
      if (left.empty() || right.empty() || left.find(' ') != std::string::npos ||
          right.find(' ') != std::string::npos) {
        // GGUF stores merges as "left right"; a side with a space (or an empty side) cannot be
        // written that way unambiguously.
        fail(path, fmt::format("model.merges[{}] = ['{}', '{}'] has an empty side or a space, "
                               "which tokenizer.ggml.merges cannot represent",
                               k, printable(left), printable(right)));
      }
      out.merges.push_back(left + ' ' + right);
    } else {
      fail(path, fmt::format("model.merges[{}] is neither a \"left right\" string nor a pair of "
                             "strings",
                             k));
    }
  }

  std::vector<std::string> regexes;
  collect_split_regexes(pre_tokenizer, regexes);
  out.pre = guess_pre(regexes);
  out.bos_id = -1;
  out.eos_id = -1;
  out.add_bos = false;
  out.add_eos = false;
  out.add_space_prefix = false;
  out.extra_eog_ids = eog_ids_by_text(out.tokens, out.types);
  return out;
}

}  // namespace berth
