// Writes a tiny but complete llama GGUF file (2 layers, n_embd 8, SPM vocabulary of 40 tokens)
// as a seed for fuzz_load: the fuzzer then mutates a file that reaches the deepest code.
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "berth/io/gguf_writer.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seed OUT.gguf\n");
    return 2;
  }
  using namespace berth;
  gguf::Writer w;
  w.set_string("general.architecture", "llama");
  w.set_u32("llama.context_length", 16);
  w.set_u32("llama.embedding_length", 8);
  w.set_u32("llama.feed_forward_length", 12);
  w.set_u32("llama.attention.head_count", 2);
  w.set_u32("llama.attention.head_count_kv", 1);
  w.set_u32("llama.block_count", 2);
  w.set_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<int32_t> types = {2, 3, 3};
  for (int b = 0; b < 16; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "<0x%02X>", b == 15 ? 0xC3 : b);
    tokens.push_back(buf);
    types.push_back(6);
  }
  const std::string sp = "\xe2\x96\x81";  // U+2581, SentencePiece's space
  for (const std::string& t : {sp, std::string("O"), std::string("n"), std::string("c"),
                               std::string("e"), sp + "O", std::string("on"), std::string("ce"),
                               std::string("a"), std::string("t"), std::string("i"),
                               std::string("m"), std::string("u"), std::string("p"), sp + "t",
                               std::string("im"), sp + "a", sp + "u", std::string("up"),
                               std::string("me"), std::string("\xc3\xa9")}) {
    tokens.push_back(t);
    types.push_back(1);
  }
  std::vector<float> scores(tokens.size());
  for (size_t i = 0; i < scores.size(); ++i) scores[i] = -static_cast<float>(i);
  const int64_t V = static_cast<int64_t>(tokens.size());
  w.set_string("tokenizer.ggml.model", "llama");
  w.set_string_array("tokenizer.ggml.tokens", tokens);
  w.set_f32_array("tokenizer.ggml.scores", scores);
  w.set_i32_array("tokenizer.ggml.token_type", types);
  w.set_u32("tokenizer.ggml.bos_token_id", 1);
  w.set_u32("tokenizer.ggml.eos_token_id", 2);
  w.set_u32("tokenizer.ggml.unknown_token_id", 0);

  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  auto add = [&](const std::string& name, std::vector<int64_t> ne) {
    int64_t n = 1;
    for (int64_t d : ne) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = nd(rng);
    w.add_tensor(name, GgmlType::F32, ne,
                 std::span(reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(float)));
  };
  add("token_embd.weight", {8, V});
  for (int l = 0; l < 2; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    add(p + "attn_norm.weight", {8});
    add(p + "attn_q.weight", {8, 8});
    add(p + "attn_k.weight", {8, 4});
    add(p + "attn_v.weight", {8, 4});
    add(p + "attn_output.weight", {8, 8});
    add(p + "ffn_norm.weight", {8});
    add(p + "ffn_gate.weight", {8, 12});
    add(p + "ffn_up.weight", {8, 12});
    add(p + "ffn_down.weight", {12, 8});
  }
  add("output_norm.weight", {8});
  w.write(argv[1]);
  return 0;
}
