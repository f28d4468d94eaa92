// `berth run`: generate text from a prompt, streaming it to stdout.
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "berth/core/error.h"
#include "berth/core/log.h"
#include "berth/io/gguf.h"
#include "berth/models/chat.h"
#include "berth/models/model.h"
#include "berth/models/tokenizer.h"
#include "berth/residency/expert_slots.h"
#include "berth/runtime/chat.h"
#include "berth/runtime/placed.h"
#include "berth/runtime/routing_io.h"
#include "berth/runtime/sampler.h"
#include "berth/runtime/session.h"
#include "commands.h"
#include "placement_flags.h"

namespace berth::cli {

std::string context_note(int64_t n_ctx, const Hparams& hp) {
  if (n_ctx <= hp.n_ctx_train) return {};
  return fmt::format(
      "-c {} is more than the {} tokens the model was trained on ({}.context_length)", n_ctx,
      hp.n_ctx_train, hp.arch);
}

bool write_stdout(std::string_view s) {
  if (s.empty()) return true;
  errno = 0;
  if (std::fwrite(s.data(), 1, s.size(), stdout) == s.size() && std::fflush(stdout) == 0)
    return true;
  // The reader went away (`| head`): stop quietly. Anything else (disk full, I/O error) is an
  // error the user must see.
  if (errno == EPIPE) return false;
  throw Error(ErrorCategory::io,
              fmt::format("cannot write to stdout: {}", std::strerror(errno ? errno : EIO)));
}

namespace {

struct RunOptions {
  std::string model;
  std::string prompt;
  std::string prompt_file;
  int32_t n_predict = -1;
  SessionParams session;
  placement::Flags placement;
  int32_t stream_min = kStreamExpertsAuto;
  std::string stream_split = "off";
  double host_expert_share = 0;
  int64_t warm_workers_us = kAutoWarmWorkersUs;  ///< --warm-workers (not given: the default)
  SamplerParams sampling;
  bool display_prompt = false;
  bool no_bos = false;
  int64_t seed = -1;
  bool chat = false;             ///< --chat / -cnv: conversation mode
  std::string chat_template;     ///< --chat-template NAME (empty: from tokenizer.chat_template)
  std::string dump_routing;      ///< --dump-routing FILE: the run's routing trace
  std::string residency_policy;  ///< --residency-policy (empty: the default)
  std::string system_prompt;     ///< -sys / --system-prompt
};

std::string read_text_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw Error(
        ErrorCategory::io,
        fmt::format("cannot read prompt file '{}': {}", path,
                    std::filesystem::exists(path, ec) ? "not a regular file" : "no such file"));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorCategory::io, fmt::format("cannot read prompt file '{}'", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

double rate(double n, double s) { return s > 0 ? n / s : 0.0; }

std::string join_counts(const std::vector<int64_t>& v) {
  std::string s;
  for (int64_t x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
  return s.empty() ? "-" : s;
}

// With expert slots (--residency adaptive), one stderr line: swaps, the share of routed expert
// calls on the device, MiB moved (ExpertSlots::summary).
void print_residency(Session& session) {
  const Residency* r = session.residency();
  if (r && r->expert_slots()) std::fprintf(stderr, "%s\n", r->expert_slots()->summary().c_str());
  if (const DiskTier* d = session.disk_tier())
    std::fprintf(stderr, "berth: %s\n", d->summary().c_str());
}

/// `--chat`: user turns from -p/-f and then stdin, one per line, until EOF or "/exit"; replies
/// stream to stdout, each followed by a newline. Each turn prefills only what the KV cache lacks
/// (ChatSession); the summary on stderr gives the prefilled and reused tokens per turn.
int run_chat(const RunOptions& o, const Tokenizer& tok, Session& session, Sampler& sampler,
             ChatFormat format) {
  ChatSession chat(session, tok, sampler, format, o.system_prompt, !o.no_bos);
  const bool tty_in = isatty(fileno(stdin)) != 0;
  std::vector<int64_t> prefilled, reused;
  int64_t n_decode = 0;
  double prefill_s = 0, decode_s = 0;
  bool out_ok = true;
  const auto turn = [&](const std::string& user) {
    chat.respond(user, o.n_predict, [&](int32_t, std::string_view text) {
      out_ok = write_stdout(text);
      return out_ok;
    });
    if (out_ok) out_ok = write_stdout("\n");
    const ChatTurnStats& t = chat.last_turn();
    prefilled.push_back(t.n_prefilled);
    reused.push_back(t.n_reused);
    n_decode += t.gen.n_decode_steps;
    prefill_s += t.gen.prompt_seconds;
    decode_s += t.gen.decode_seconds;
    log::info(
        "chat turn {}: {} tokens rendered, {} reused from the KV cache, {} prefilled; {} "
        "generated",
        chat.n_turns(), t.n_rendered, t.n_reused, t.n_prefilled, t.gen.n_generated);
    if (t.gen.stop == StopReason::context_full)
      std::fprintf(stderr, "berth: the context of %lld tokens is full (raise -c)\n",
                   static_cast<long long>(session.n_ctx()));
  };

  const std::string first = o.prompt_file.empty() ? o.prompt : read_text_file(o.prompt_file);
  if (!first.empty()) turn(first);
  std::string line;
  while (out_ok) {
    if (tty_in) {
      std::fputs("> ", stderr);
      std::fflush(stderr);
    }
    if (!std::getline(std::cin, line)) break;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line == "/exit") break;
    if (line.empty()) continue;
    turn(line);
  }
  if (tty_in && std::cin.eof()) std::fputs("\n", stderr);
  std::fprintf(stderr,
               "berth: chat (%s): %d turn%s | prefilled tokens per turn: %s (total %lld, %.1f ms, "
               "%.1f tok/s) | reused from the KV cache per turn: %s | decode %lld tokens in "
               "%.1f ms (%.1f tok/s) | %d threads%s\n",
               std::string(chat_format_name(format)).c_str(), chat.n_turns(),
               chat.n_turns() == 1 ? "" : "s", join_counts(prefilled).c_str(),
               static_cast<long long>(chat.n_prefilled_total()), prefill_s * 1e3,
               rate(static_cast<double>(chat.n_prefilled_total()), prefill_s),
               join_counts(reused).c_str(), static_cast<long long>(n_decode), decode_s * 1e3,
               rate(static_cast<double>(n_decode), decode_s), session.pool().n_threads(),
               sampler.params().temp > 0 ? fmt::format(" | seed {}", sampler.seed()).c_str() : "");
  print_residency(session);
  if (!out_ok) log::info("stdout was closed; the chat stopped");
  return 0;
}

int run(const RunOptions& o) {
  gguf::File file = gguf::File::open(o.model);
  std::unique_ptr<Model> model = load_model(file);
  std::unique_ptr<Tokenizer> tok = Tokenizer::from_gguf(file);
  if (tok->n_vocab() != model->hparams().n_vocab)
    throw Error(ErrorCategory::format,
                fmt::format("{}: the vocabulary has {} tokens but token_embd.weight has {} rows",
                            o.model, tok->n_vocab(), model->hparams().n_vocab));

  std::string prompt;
  std::vector<int32_t> ids;
  ChatFormat chat_format = ChatFormat::chatml;
  if (o.chat) {
    chat_format = chat_format_for(file, o.chat_template);
  } else {
    prompt = o.prompt_file.empty() ? o.prompt : read_text_file(o.prompt_file);
    ids = tok->encode(prompt, !o.no_bos);
    if (ids.empty())
      throw Error(ErrorCategory::invalid_argument,
                  o.no_bos
                      ? "the prompt is empty and --no-bos leaves no token to start from"
                      : "the prompt is empty and the vocabulary adds no BOS token (give -p TEXT)");
  }

  // Check the sampling flags before allocating anything large.
  SamplerParams sp = o.sampling;
  if (o.seed < 0)
    sp.seed = 0xFFFFFFFFu;  // -1: random, as llama.cpp
  else
    sp.seed = static_cast<uint64_t>(o.seed);
  const int64_t n_ctx = o.session.n_ctx > 0 ? o.session.n_ctx : default_n_ctx(model->hparams());
  if (sp.repeat_last_n == -1) sp.repeat_last_n = static_cast<int32_t>(n_ctx);  // as llama.cpp
  if (static_cast<int64_t>(ids.size()) > n_ctx)
    throw Error(
        ErrorCategory::invalid_argument,
        fmt::format("the prompt{} is {} tokens, more than the context size of {} (raise -c)",
                    o.prompt_file.empty() ? "" : fmt::format(" in {}", o.prompt_file), ids.size(),
                    n_ctx));
  Sampler sampler(sp, static_cast<int32_t>(model->hparams().n_vocab));
  if (std::string c = context_note(n_ctx, model->hparams()); !c.empty()) log::warn("{}", c);

  SessionParams params = o.session;
  if (!o.residency_policy.empty())
    params.hybrid.expert_slots.policy = make_slot_policy(o.residency_policy);
  params.hybrid.stream_experts_min_tokens = o.stream_min;  // before place(): they need room
  params.hybrid.stream_rates = parse_stream_split(o.stream_split, params.hybrid.stream_split);
  params.hybrid.host_expert_share = o.host_expert_share;
  const PlacementSetup placed = place(*model, o.placement, params, true);
  use_disk_tier(file, *model, placed.plan, params);
  params.hybrid.warm_workers_us = o.warm_workers_us;
  for (const std::string& note :
       device_option_notes(*model, params, false, o.warm_workers_us != kAutoWarmWorkersUs))
    log::warn("{}", note);
  log::info("{}", placed.summary());
  Session session(*model, params);
  log::info("{}: {} {}, {} layers, n_embd {}, vocab {}; context {} tokens, KV cache {:.1f} MiB",
            o.model, model->hparams().arch, file.get_string_opt("general.name").value_or(""),
            model->hparams().n_layer, model->hparams().n_embd, model->hparams().n_vocab,
            session.n_ctx(), static_cast<double>(session.kv_bytes()) / (1024.0 * 1024.0));
  std::shared_ptr<residency::RoutingTraceWriter> routing_out;
  if (!o.dump_routing.empty()) {
    routing_out = std::make_shared<residency::RoutingTraceWriter>(o.dump_routing,
                                                                  routing_shape(*model, true));
    attach_routing(session, *model, nullptr, routing_out);
  }
  if (o.chat) return run_chat(o, *tok, session, sampler, chat_format);
  if (o.display_prompt && !write_stdout(prompt)) return 0;

  bool out_ok = true;
  GenerateStats st =
      generate(session, *tok, sampler, ids, o.n_predict, [&](int32_t, std::string_view text) {
        out_ok = write_stdout(text);
        return out_ok;
      });
  // A terminal gets a final newline; a pipe gets exactly the generated text.
  if (isatty(fileno(stdout))) write_stdout("\n");
  std::fprintf(stderr,
               "berth: prompt %lld tokens in %.1f ms (%.1f tok/s) | decode %lld tokens in %.1f ms "
               "(%.1f tok/s) | %d threads%s\n",
               static_cast<long long>(st.n_prompt), st.prompt_seconds * 1e3,
               rate(static_cast<double>(st.n_prompt), st.prompt_seconds),
               static_cast<long long>(st.n_decode_steps), st.decode_seconds * 1e3,
               rate(static_cast<double>(st.n_decode_steps), st.decode_seconds),
               session.pool().n_threads(),
               sp.temp > 0 ? fmt::format(" | seed {}", sampler.seed()).c_str() : "");
  print_residency(session);
  if (routing_out) {
    routing_out->finish();
    std::fprintf(stderr, "berth: routing of %lld tokens written to %s\n",
                 static_cast<long long>(routing_out->n_tokens()), o.dump_routing.c_str());
  }
  if (st.stop == StopReason::context_full)
    std::fprintf(stderr, "berth: stopped: the context of %lld tokens is full (raise -c)\n",
                 static_cast<long long>(session.n_ctx()));
  // A closed stdout (e.g. `| head`) ends generation early; that is not an error.
  if (!out_ok) log::info("stdout was closed; generation stopped");
  return 0;
}

}  // namespace

Runner add_run(CLI::App& app) {
  auto o = std::make_shared<RunOptions>();
  CLI::App* sub = app.add_subcommand("run", "generate text from a prompt");
  sub->add_option("-m,--model", o->model, "GGUF model file")->required();
  auto* p = sub->add_option("-p,--prompt", o->prompt, "prompt text (none: start from BOS)");
  auto* f = sub->add_option("-f,--file", o->prompt_file, "read the prompt from a file");
  p->excludes(f);
  sub->add_option("-n,--n-predict", o->n_predict,
                  "tokens to generate (-1: until EOS or the context is full)")
      ->capture_default_str()
      ->check(range(int32_t{-1}, INT32_MAX));
  sub->add_option("-t,--threads", o->session.n_threads, "CPU threads (0: all physical cores)")
      ->capture_default_str()
      ->check(range(0, 4096));
  sub->add_option("-c,--ctx-size", o->session.n_ctx,
                  "context size in tokens (0: min(4096, model's))")
      ->capture_default_str()
      ->check(range(int64_t{0}, int64_t{1} << 24));
  o->session.n_ubatch = kRunUbatch;
  o->session.n_ubatch_auto = true;
  sub->add_option("--ubatch-size", o->session.n_ubatch, "tokens per prefill step (-ub)")
      ->capture_default_str()
      ->check(range(1, 1 << 16))
      ->each([o](const std::string&) { o->session.n_ubatch_auto = false; });
  add_placement_flags(*sub, o->placement);
  add_stream_experts(*sub, o->stream_min);
  add_stream_split(*sub, o->stream_split);
  add_host_expert_share(*sub, o->host_expert_share);
  add_warm_workers(*sub, o->warm_workers_us);
  add_residency_swaps(*sub, o->session.hybrid.expert_slots.max_swaps_per_step);
  add_residency_policy(*sub, o->residency_policy);
  sub->add_option("--temp", o->sampling.temp, "temperature (0: greedy)")->capture_default_str();
  sub->add_option("--top-k", o->sampling.top_k, "top-k sampling (0: off)")
      ->capture_default_str()
      ->check(range(0, 1 << 30));
  sub->add_option("--top-p", o->sampling.top_p, "top-p sampling (1: off)")->capture_default_str();
  sub->add_option("--min-p", o->sampling.min_p, "min-p sampling (0: off)")->capture_default_str();
  sub->add_option("--repeat-penalty", o->sampling.repeat_penalty, "repetition penalty (1: off)")
      ->capture_default_str();
  sub->add_option("--repeat-last-n", o->sampling.repeat_last_n,
                  "tokens the penalty looks back over (0: off, -1: the context size)")
      ->capture_default_str();
  sub->add_option("-s,--seed", o->seed, "RNG seed (-1 or 4294967295: random)")
      ->capture_default_str()
      ->check(range(int64_t{-1}, int64_t{0xFFFFFFFF}));
  sub->add_flag("--display-prompt", o->display_prompt,
                "print the prompt before the generated text");
  sub->add_flag("--no-bos", o->no_bos, "do not prepend the BOS token");
  auto* chat = sub->add_flag(
      "--chat", o->chat,
      "conversation mode (-cnv): user turns from -p/-f, then stdin line by line until EOF or "
      "/exit; the KV cache is kept between turns");
  sub->add_option("--dump-routing", o->dump_routing,
                  "write every step's expert choices (ids and weights, per MoE layer) to this "
                  "routing trace file (docs/routing-traces.md)");
  sub->add_option("--chat-template", o->chat_template,
                  "chat format for --chat: " + chat_format_names() +
                      " (default: detected from the model's tokenizer.chat_template)")
      ->needs(chat);
  sub->add_option("--system-prompt", o->system_prompt, "system prompt for --chat (-sys)")
      ->needs(chat);
  return [o] { return run(*o); };
}

}  // namespace berth::cli
