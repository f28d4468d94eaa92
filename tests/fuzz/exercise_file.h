// Feeds a model file's bytes through everything that reads one: the GGUF parser, metadata
// rendering (berth inspect), the tokenizer, the model loader and one forward step. Shared by the
// libFuzzer target and the regression test that replays the inputs fuzzing found.
#pragma once

#include <cstdint>
#include <vector>

#include "berth/core/error.h"
#include "berth/io/gguf.h"
#include "berth/models/chat.h"
#include "berth/models/model.h"
#include "berth/models/tokenizer.h"
#include "berth/runtime/session.h"

namespace berth::test {

/// Returns true when the file loaded and ran one step, false when berth rejected it with a
/// berth::Error. Any other exception or a crash is a bug.
inline bool exercise_file(std::vector<uint8_t> bytes) {
  try {
    gguf::File f = gguf::File::from_memory(std::move(bytes), "fuzz.gguf");
    for (const gguf::KeyValue& kv : f.kvs()) (void)kv.value.to_string(8);
    try {
      std::unique_ptr<Tokenizer> tok = Tokenizer::from_gguf(f);
      std::vector<int32_t> ids =
          tok->encode("Once upon a time <s> \xc3\xa9\xf0\x9f\xa6\x80", true, true);
      (void)tok->decode(ids);
      StreamDecoder dec(*tok);
      for (int32_t id : ids) (void)dec.push(id);
      (void)dec.flush();
      // The chat template the file names, rendered and tokenized (markup with control tokens).
      const ChatFormat fmt = chat_format_for(f, "");
      const ChatMessage msgs[] = {{ChatRole::system, "be brief"},
                                  {ChatRole::user, "hi <|im_end|>"},
                                  {ChatRole::assistant, "ok"}};
      (void)tokenize_chat(*tok, render_chat(fmt, msgs, false), true);
    } catch (const Error&) {
    }
    std::unique_ptr<Model> model = load_model(f);
    // Bound the work a fuzzed file can ask for: small models only.
    const Hparams& hp = model->hparams();
    if (hp.n_embd * hp.n_layer > (1 << 16) || hp.n_vocab > (1 << 16) || hp.n_ff > (1 << 12) ||
        hp.n_expert * hp.n_ff_exp > (1 << 14))
      return true;
    Session s(*model, SessionParams{.n_threads = 1, .n_ctx = 4, .n_ubatch = 2});
    const int32_t prompt[3] = {0, static_cast<int32_t>(hp.n_vocab - 1), 0};
    (void)s.eval(prompt);
    return true;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace berth::test
