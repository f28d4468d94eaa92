// libFuzzer target: arbitrary bytes through everything that reads a model file: the GGUF
// parser, metadata rendering (berth inspect), the tokenizer, the model loader and one forward
// step. Anything but a berth::Error is a bug (ASan/UBSan report crashes and undefined behaviour).
//
// Build (clang): cmake -S . -B build-fuzz -G Ninja -DCMAKE_C_COMPILER=clang
//   -DCMAKE_CXX_COMPILER=clang++ -DBERTH_FUZZ=ON -DBERTH_CUDA=OFF && cmake --build build-fuzz
//   --target fuzz_load
// Run:   build-fuzz/bin/fuzz_load -seed_corpus_dir... (see scripts/fuzz.sh)
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "berth/core/error.h"
#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "berth/models/tokenizer.h"
#include "berth/runtime/session.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace berth;
  try {
    gguf::File f = gguf::File::from_memory(std::vector<uint8_t>(data, data + size), "fuzz.gguf");
    for (const gguf::KeyValue& kv : f.kvs()) (void)kv.value.to_string(8);
    std::unique_ptr<Tokenizer> tok;
    try {
      tok = Tokenizer::from_gguf(f);
      std::vector<int32_t> ids = tok->encode("Once upon a time <s> \xc3\xa9\xf0\x9f\xa6\x80", true, true);
      (void)tok->decode(ids);
      StreamDecoder dec(*tok);
      for (int32_t id : ids) (void)dec.push(id);
      (void)dec.flush();
    } catch (const Error&) {
    }
    std::unique_ptr<Model> model = load_model(f);
    // Bound the work a fuzzed file can ask for: small models only.
    const Hparams& hp = model->hparams();
    if (hp.n_embd * hp.n_layer > (1 << 16) || hp.n_vocab > (1 << 16) || hp.n_ff > (1 << 12)) return 0;
    Session s(*model, SessionParams{.n_threads = 1, .n_ctx = 4, .n_ubatch = 2});
    const int32_t prompt[3] = {0, static_cast<int32_t>(hp.n_vocab - 1), 0};
    (void)s.eval(prompt);
  } catch (const Error&) {
  }
  return 0;
}
