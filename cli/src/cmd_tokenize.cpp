// `berth tokenize`: print the token ids of a text.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "berth/core/strings.h"
#include "berth/io/gguf.h"
#include "berth/models/tokenizer.h"
#include "commands.h"

namespace berth::cli {
namespace {

struct TokenizeOptions {
  std::string model;
  std::string prompt;
  bool no_bos = false;
  bool parse_special = false;
  bool pieces = false;
};

int tokenize(const TokenizeOptions& o) {
  gguf::File file = gguf::File::open(o.model);
  std::unique_ptr<Tokenizer> tok = Tokenizer::from_gguf(file);
  std::vector<int32_t> ids = tok->encode(o.prompt, !o.no_bos, o.parse_special);
  std::string out;
  if (o.pieces) {
    // Byte tokens show their name (<0x0A>); other pieces with control bytes escaped.
    for (int32_t id : ids)
      out += fmt::format("{:>6} -> '{}'\n", id,
                         tok->token_type(id) == TokenType::byte
                             ? tok->token_text(id)
                             : printable(tok->token_to_piece(id, /*render_special=*/true)));
  } else {
    out = fmt::format("[{}]\n", fmt::join(ids, ", "));
  }
  (void)write_stdout(out);  // false: the reader closed the pipe, not an error
  return 0;
}

}  // namespace

Runner add_tokenize(CLI::App& app) {
  auto o = std::make_shared<TokenizeOptions>();
  CLI::App* sub = app.add_subcommand("tokenize", "print the token ids of a text");
  sub->add_option("-m,--model", o->model, "GGUF model file (its vocabulary)")->required();
  sub->add_option("-p,--prompt", o->prompt, "text to tokenize")->required();
  sub->add_flag("--no-bos", o->no_bos, "do not prepend the BOS token");
  sub->add_flag("--parse-special", o->parse_special,
                "match control tokens written in the text (e.g. <s>)");
  sub->add_flag("--pieces", o->pieces, "print one 'id -> piece' line per token");
  return [o] { return tokenize(*o); };
}

}  // namespace berth::cli
