// DiskReader (io/disk_reader.h): the bytes of random ranges through both backends, the choice
// of backend (forced, injected set-up failures, tmpfs), and the errors of failed reads.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "berth/core/error.h"
#include "berth/io/disk_reader.h"
#include "test_util.h"

namespace {

using berth::Error;
using berth::ErrorCategory;
using berth::io::AlignedBuffer;
using berth::io::direct_layout;
using berth::io::DiskBackend;
using berth::io::DiskReader;
using berth::io::DiskReaderOptions;
using berth::io::kDirectAlignment;
using berth::io::ReadRequest;
using berth::io::Ticket;
using Backend = DiskReaderOptions::Backend;

namespace fs = std::filesystem;

// Sets an environment variable for the scope (unset: value null), restoring the old value.
class EnvGuard {
 public:
  EnvGuard(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ~EnvGuard() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// Writes `size` seeded random bytes to `path` and returns them.
std::vector<uint8_t> make_file(const fs::path& path, size_t size, uint64_t seed) {
  std::vector<uint8_t> bytes(size);
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < size; i += 8) {
    const uint64_t v = rng();
    std::memcpy(bytes.data() + i, &v, std::min<size_t>(8, size - i));
  }
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(size));
  REQUIRE(out.good());
  return bytes;
}

// Calls f and returns the berth::Error it throws (fails the test when none is thrown).
template <class F>
Error expect_error(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  FAIL("no berth::Error thrown");
  return Error(ErrorCategory::internal, "unreachable");
}

// io_uring with O_DIRECT works for files in `dir` (not under some sandboxes: the io_uring cases
// then say so and stop).
bool uring_usable(const fs::path& file) {
  try {
    DiskReaderOptions o;
    o.backend = Backend::io_uring;
    DiskReader r(file.string(), o);
    return true;
  } catch (const Error& e) {
    MESSAGE("io_uring unavailable here, io_uring cases skipped: " << e.what());
    return false;
  }
}

constexpr size_t kGuard = 64;  // sentinel bytes around every destination
constexpr uint8_t kSentinel = 0xA5;

// One read in flight: its destination (with sentinels on both sides) and what it must receive.
struct Dest {
  AlignedBuffer buf;
  size_t at = 0;  // destination offset in buf
  uint64_t offset = 0;
  size_t length = 0;
};

// A destination for [offset, offset + length): congruent to the file offset modulo 4096 (the
// zero-copy path) or at a deliberately unaligned place, with kGuard sentinel bytes either side.
Dest make_dest(uint64_t offset, size_t length, bool congruent, std::mt19937_64& rng) {
  Dest d;
  d.offset = offset;
  d.length = length;
  size_t lead = kDirectAlignment + direct_layout(offset, length).pad;
  if (!congruent) {
    lead = kGuard + static_cast<size_t>(rng() % 4000);
    if (lead % kDirectAlignment == offset % kDirectAlignment) ++lead;
  }
  d.at = lead;
  d.buf = AlignedBuffer(lead + length + kGuard + kDirectAlignment);
  std::memset(d.buf.data(), kSentinel, d.buf.size());
  return d;
}

// The destination holds the file's bytes and nothing around it was written.
void check_dest(const Dest& d, const std::vector<uint8_t>& file) {
  CHECK(std::memcmp(d.buf.data() + d.at, file.data() + d.offset, d.length) == 0);
  bool guards_intact = true;
  for (size_t i = 0; i < d.at; ++i) guards_intact &= d.buf.data()[i] == kSentinel;
  for (size_t i = d.at + d.length; i < d.buf.size(); ++i)
    guards_intact &= d.buf.data()[i] == kSentinel;
  CHECK(guards_intact);
}

// Reads `n` random ranges (mixed sizes, a few over 8 MiB, some at the file's end, half to
// congruent destinations) in batches of 1..4, with up to 48 tickets outstanding, retired in a
// random order by poll() or wait(); checks every destination.
void random_reads(DiskReader& reader, const std::vector<uint8_t>& file, int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const uint64_t size = file.size();
  struct Outstanding {
    Ticket ticket;
    std::vector<Dest> dests;
  };
  std::deque<Outstanding> out;
  auto retire_one = [&] {
    const size_t k = rng() % out.size();
    Outstanding o = std::move(out[k]);
    out.erase(out.begin() + static_cast<std::ptrdiff_t>(k));
    if (rng() % 2 == 0) {
      while (!reader.poll(o.ticket)) std::this_thread::yield();
    } else {
      reader.wait(o.ticket);
    }
    for (const Dest& d : o.dests) check_dest(d, file);
  };
  for (int i = 0; i < n;) {
    Outstanding o;
    std::vector<ReadRequest> reqs;
    const int batch = 1 + static_cast<int>(rng() % 4);
    for (int j = 0; j < batch && i < n; ++j, ++i) {
      size_t length;
      const unsigned kind = rng() % 16;
      if (kind == 0)
        length = (size_t{8} << 20) + rng() % (size_t{1} << 20);  // split into pieces
      else if (kind < 6)
        length = 1 + rng() % 16384;
      else
        length = 1 + rng() % (size_t{1} << 20);
      length = std::min<uint64_t>(length, size);
      uint64_t offset = rng() % (size - length + 1);
      if (kind == 1) offset = size - length;                                 // the file's end
      if (kind == 2) offset = offset / kDirectAlignment * kDirectAlignment;  // aligned start
      o.dests.push_back(make_dest(offset, length, rng() % 2 == 0, rng));
      const Dest& d = o.dests.back();
      reqs.push_back({d.offset, d.length, d.buf.data() + d.at, "blk.0.ffn_up_exps.weight"});
    }
    o.ticket = reader.submit(reqs);
    out.push_back(std::move(o));
    if (out.size() >= 48) retire_one();
  }
  while (!out.empty()) retire_one();
}

struct Fixture {
  fs::path dir = berth::test::temp_dir("disk-reader");
  fs::path file = dir / "weights.bin";
  // Not a multiple of 4096: the last block is partial. Over 8 MiB: long reads are split.
  std::vector<uint8_t> bytes = make_file(file, (size_t{10} << 20) + 1234, 7);
};

}  // namespace

TEST_CASE("disk reader: direct_layout and AlignedBuffer") {
  CHECK(direct_layout(0, 0).pad == 0);
  CHECK(direct_layout(0, 0).bytes == 0);
  CHECK(direct_layout(8192, 4096).pad == 0);
  CHECK(direct_layout(8192, 4096).bytes == 4096);
  CHECK(direct_layout(4097, 10).pad == 1);
  CHECK(direct_layout(4097, 10).bytes == 4096);
  CHECK(direct_layout(4095, 2).pad == 4095);
  CHECK(direct_layout(4095, 2).bytes == 8192);

  AlignedBuffer a(10000);
  REQUIRE(a.data() != nullptr);
  CHECK(reinterpret_cast<uintptr_t>(a.data()) % kDirectAlignment == 0);
  CHECK(a.size() == 10000);
  uint8_t* p = a.data();
  AlignedBuffer b(std::move(a));
  CHECK(b.data() == p);
  CHECK(a.data() == nullptr);
  CHECK(AlignedBuffer(0).data() == nullptr);
}

TEST_CASE("disk reader: random ranges read the file's bytes through both backends") {
  Fixture f;
  EnvGuard env("BERTH_DISK_READER", nullptr);
  SUBCASE("pread") {
    DiskReaderOptions o;
    o.backend = Backend::pread;
    o.pread_threads = 4;
    DiskReader r(f.file.string(), o);
    CHECK(r.backend() == DiskBackend::pread);
    CHECK(r.file_size() == f.bytes.size());
    random_reads(r, f.bytes, 250, 1);
  }
  SUBCASE("io_uring") {
    if (!uring_usable(f.file)) return;
    DiskReaderOptions o;
    o.backend = Backend::io_uring;
    o.queue_depth = 32;
    DiskReader r(f.file.string(), o);
    CHECK(r.backend() == DiskBackend::io_uring);
    CHECK(r.queue_depth() == 32);
    CHECK(r.registered_file());
    CHECK(r.backend_reason().find("io_uring with O_DIRECT, queue depth 32") != std::string::npos);
    random_reads(r, f.bytes, 250, 2);
  }
  SUBCASE("io_uring, queue depth 1") {
    if (!uring_usable(f.file)) return;
    DiskReaderOptions o;
    o.backend = Backend::io_uring;
    o.queue_depth = 1;
    DiskReader r(f.file.string(), o);
    random_reads(r, f.bytes, 60, 3);
  }
}

TEST_CASE("disk reader: busy time and bytes read, both backends") {
  // 4 MiB from offset 0 into aligned memory: no partial blocks, so the kernel returns exactly
  // the range's bytes. The busy time lies inside the wall time of submit..wait, and does not
  // grow while nothing is in flight.
  Fixture f;
  EnvGuard env("BERTH_DISK_READER", nullptr);
  auto check = [&](DiskReader& r) {
    CHECK(r.busy_seconds() == 0.0);
    CHECK(r.bytes_read() == 0);
    const size_t n = size_t{4} << 20;
    AlignedBuffer buf(n);
    const auto t0 = std::chrono::steady_clock::now();
    r.wait(r.submit(ReadRequest{0, n, buf.data(), "blk.0.ffn_up_exps.weight"}));
    const double wall =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(std::memcmp(buf.data(), f.bytes.data(), n) == 0);
    CHECK(r.bytes_read() == n);
    const double busy = r.busy_seconds();
    CAPTURE(busy);
    CAPTURE(wall);
    CHECK(busy > 0.0);
    CHECK(busy <= wall);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK(r.busy_seconds() == busy);
  };
  SUBCASE("pread") {
    DiskReaderOptions o;
    o.backend = Backend::pread;
    DiskReader r(f.file.string(), o);
    check(r);
  }
  SUBCASE("io_uring") {
    if (!uring_usable(f.file)) return;
    DiskReaderOptions o;
    o.backend = Backend::io_uring;
    DiskReader r(f.file.string(), o);
    check(r);
  }
}

TEST_CASE("disk reader: ranges split into small reads (max_read_bytes, BERTH_DISK_MAX_READ)") {
  Fixture f;
  EnvGuard env("BERTH_DISK_READER", nullptr);
  // One aligned 64 KiB range is `reads` reads: an injected failure of read number `reads`
  // fails it, one of read `reads + 1` does not happen.
  auto count_reads = [&](DiskReaderOptions o, uint64_t reads) {
    AlignedBuffer buf(65536);
    for (const uint64_t nth : {reads, reads + 1}) {
      CAPTURE(nth);
      o.faults.fail_read_nth = nth;
      DiskReader r(f.file.string(), o);
      const Ticket t = r.submit(ReadRequest{0, 65536, buf.data(), "blk.0.ffn_up_exps.weight"});
      if (nth == reads) {
        CHECK(expect_error([&] { r.wait(t); }).category() == ErrorCategory::io);
      } else {
        r.wait(t);
        CHECK(std::memcmp(buf.data(), f.bytes.data(), 65536) == 0);
      }
    }
  };
  SUBCASE("pread, 8 KiB reads") {
    DiskReaderOptions o;
    o.backend = Backend::pread;
    o.max_read_bytes = 8192;
    count_reads(o, 8);
    DiskReader r(f.file.string(), o);
    random_reads(r, f.bytes, 60, 11);
  }
  SUBCASE("io_uring, 12 KiB reads from the environment") {
    if (!uring_usable(f.file)) return;
    EnvGuard max_read("BERTH_DISK_MAX_READ", "12288");
    DiskReaderOptions o;
    o.backend = Backend::io_uring;
    o.queue_depth = 8;
    count_reads(o, 6);  // 5 of 12 KiB and one of 4 KiB
    DiskReader r(f.file.string(), o);
    random_reads(r, f.bytes, 60, 12);
  }
  SUBCASE("sizes that are not whole blocks are refused") {
    DiskReaderOptions o;
    o.max_read_bytes = 5000;
    const Error a = expect_error([&] { DiskReader r(f.file.string(), o); });
    CHECK(a.category() == ErrorCategory::invalid_argument);
    CHECK(std::string(a.what()) ==
          "disk reader: a largest read of 5000 bytes is not a multiple of 4096 up to 1 GiB");
    EnvGuard max_read("BERTH_DISK_MAX_READ", "4095");
    const Error b = expect_error([&] { DiskReader r(f.file.string(), DiskReaderOptions{}); });
    CHECK(b.category() == ErrorCategory::invalid_argument);
    CHECK(std::string(b.what()) ==
          "disk reader: a largest read of 4095 bytes is not a multiple of 4096 up to 1 GiB "
          "(BERTH_DISK_MAX_READ)");
  }
  SUBCASE("a value that is not an integer up to 1 GiB names the variable and the range") {
    for (const char* bad : {"abc", "-1", "1073741825", "99999999999999999999"}) {
      CAPTURE(bad);
      EnvGuard max_read("BERTH_DISK_MAX_READ", bad);
      const Error e = expect_error([&] { DiskReader r(f.file.string(), DiskReaderOptions{}); });
      CHECK(e.category() == ErrorCategory::invalid_argument);
      CHECK(std::string(e.what()) == std::string("BERTH_DISK_MAX_READ='") + bad +
                                         "': expected an integer from 0 to 1073741824");
    }
  }
}

TEST_CASE("disk reader: io_uring reads into registered fixed buffers") {
  Fixture f;
  if (!uring_usable(f.file)) return;
  AlignedBuffer arena(size_t{16} << 20);
  DiskReaderOptions o;
  o.backend = Backend::io_uring;
  o.fixed_buffers = {{arena.data(), arena.size()}};
  DiskReader r(f.file.string(), o);
  REQUIRE(r.registered_buffers() == 1);
  CHECK(r.backend_reason().find("1 fixed buffer") != std::string::npos);
  // Three expert-like ranges (unaligned starts, as GGUF tensor data is 32-byte aligned) placed
  // congruently one after another in the arena, as an expert slot would hold gate, up and down.
  const uint64_t offsets[3] = {96, 5 * 1048576 + 32, 8 * 1048576 + 4000};
  const size_t lengths[3] = {884736, 884736 + 100, 1327104};
  std::vector<ReadRequest> reqs;
  size_t at = 0;
  for (int i = 0; i < 3; ++i) {
    const auto l = direct_layout(offsets[i], lengths[i]);
    reqs.push_back({offsets[i], lengths[i], arena.data() + at + l.pad, "expert"});
    at += l.bytes;
  }
  r.wait(r.submit(reqs));
  for (const ReadRequest& q : reqs)
    CHECK(std::memcmp(q.dst, f.bytes.data() + q.offset, q.length) == 0);
}

TEST_CASE("disk reader: the pread fallback is forced by the option or BERTH_DISK_READER") {
  Fixture f;
  SUBCASE("option") {
    EnvGuard env("BERTH_DISK_READER", "io_uring");  // the option wins over the variable
    DiskReaderOptions o;
    o.backend = Backend::pread;
    DiskReader r(f.file.string(), o);
    CHECK(r.backend() == DiskBackend::pread);
    CHECK(r.backend_reason() == "forced by the caller");
    random_reads(r, f.bytes, 40, 4);
  }
  SUBCASE("environment") {
    EnvGuard env("BERTH_DISK_READER", "pread");
    DiskReader r(f.file.string());
    CHECK(r.backend() == DiskBackend::pread);
    CHECK(r.backend_reason() == "forced by BERTH_DISK_READER=pread");
    random_reads(r, f.bytes, 40, 5);
  }
  SUBCASE("a bad value") {
    EnvGuard env("BERTH_DISK_READER", "uring");
    const Error e = expect_error([&] { DiskReader r(f.file.string()); });
    CHECK(e.category() == ErrorCategory::invalid_argument);
    CHECK(std::string(e.what()) == "BERTH_DISK_READER='uring': expected pread, io_uring or auto");
  }
  SUBCASE("io_uring required by the variable but refused") {
    EnvGuard env("BERTH_DISK_READER", "io_uring");
    DiskReaderOptions o;
    o.faults.uring_setup_errno = EPERM;
    const Error e = expect_error([&] { DiskReader r(f.file.string(), o); });
    CHECK(e.category() == ErrorCategory::unsupported);
    const std::string msg = e.what();
    CHECK(msg.find(f.file.string() + ": io_uring with O_DIRECT is unavailable: io_uring_setup "
                                     "failed: Operation not permitted (EPERM)") == 0);
  }
}

TEST_CASE("disk reader: falls back to pread when io_uring or O_DIRECT is refused") {
  Fixture f;
  EnvGuard env("BERTH_DISK_READER", nullptr);
  DiskReaderOptions o;
  std::string expected;
  SUBCASE("EPERM from io_uring_setup (seccomp)") {
    o.faults.uring_setup_errno = EPERM;
    expected =
        "io_uring_setup failed: Operation not permitted (EPERM) (refused by a seccomp profile "
        "such as Docker's default, or by the sysctl kernel.io_uring_disabled)";
  }
  SUBCASE("ENOSYS from io_uring_setup") {
    o.faults.uring_setup_errno = ENOSYS;
    expected =
        "io_uring_setup failed: Function not implemented (ENOSYS) (the kernel has no "
        "io_uring)";
  }
  SUBCASE("EINVAL from open(O_DIRECT)") {
    o.faults.direct_open_errno = EINVAL;
    expected =
        "open with O_DIRECT failed: Invalid argument (EINVAL) (the file system refuses "
        "direct I/O, as FUSE, exFAT and tmpfs before Linux 6.6 do)";
  }
  DiskReader r(f.file.string(), o);
  CHECK(r.backend() == DiskBackend::pread);
  CHECK(r.backend_reason() == expected);
  random_reads(r, f.bytes, 40, 6);
}

TEST_CASE("disk reader: a file on tmpfs (/dev/shm)") {
  if (!fs::is_directory("/dev/shm")) return;
  EnvGuard env("BERTH_DISK_READER", nullptr);
  const fs::path file = fs::path("/dev/shm") / ("berth-disk-reader-" + std::to_string(::getpid()));
  const std::vector<uint8_t> bytes = make_file(file, (size_t{3} << 20) + 5, 11);
  // What this kernel's tmpfs does with O_DIRECT (refused before Linux 6.6, accepted since).
  const int probe = ::open(file.c_str(), O_RDONLY | O_DIRECT);
  const int probe_errno = probe < 0 ? errno : 0;
  if (probe >= 0) ::close(probe);
  {
    DiskReader r(file.string());
    if (probe_errno == EINVAL) {
      CHECK(r.backend() == DiskBackend::pread);
      CHECK(r.backend_reason().find("open with O_DIRECT failed: Invalid argument (EINVAL)") == 0);
    } else if (probe_errno == 0 && r.backend() == DiskBackend::io_uring) {
      CHECK(r.backend_reason().find("io_uring with O_DIRECT") == 0);
    } else {
      MESSAGE("tmpfs: " << r.backend_reason());
    }
    random_reads(r, bytes, 40, 12);
  }
  fs::remove(file);
}

TEST_CASE("disk reader: a file truncated after open gives an error naming the range") {
  Fixture f;
  const std::string path = f.file.string();
  for (const Backend b : {Backend::pread, Backend::io_uring}) {
    if (b == Backend::io_uring && !uring_usable(f.file)) break;
    CAPTURE(static_cast<int>(b));
    make_file(f.file, size_t{1} << 20, 21);
    DiskReaderOptions o;
    o.backend = b;
    DiskReader r(path, o);
    fs::resize_file(f.file, 262144);
    AlignedBuffer dst(size_t{1} << 20);
    // Wholly past the new end, then straddling it (a short read, then the end of the file).
    const Error past = expect_error([&] {
      r.wait(r.submit(ReadRequest{524288, 65536, dst.data(), "blk.3.ffn_down_exps.weight"}));
    });
    CHECK(past.category() == ErrorCategory::io);
    CHECK(std::string(past.what()) ==
          path +
              ": cannot read 65536 bytes at offset 524288 (tensor 'blk.3.ffn_down_exps.weight'): "
              "the file ends at byte 262144; it had 1048576 bytes when opened (it shrank while "
              "open)");
    const Error straddling = expect_error([&] {
      r.wait(r.submit(ReadRequest{200704, 131072, dst.data() + 4096}));
    });
    CHECK(straddling.category() == ErrorCategory::io);
    CHECK(std::string(straddling.what()) ==
          path +
              ": cannot read 131072 bytes at offset 200704: the file ends at byte 262144; it had "
              "1048576 bytes when opened (it shrank while open)");
    // The bytes still in the file read as before.
    r.wait(r.submit(ReadRequest{4096, 8192, dst.data() + 4096}));
    CHECK(std::memcmp(dst.data() + 4096, make_file(f.dir / "again", 262144, 21).data() + 4096,
                      8192) == 0);
  }
}

TEST_CASE("disk reader: an injected EIO fails only its ticket, with the range in the message") {
  Fixture f;
  const std::string path = f.file.string();
  for (const Backend b : {Backend::pread, Backend::io_uring}) {
    if (b == Backend::io_uring && !uring_usable(f.file)) break;
    CAPTURE(static_cast<int>(b));
    DiskReaderOptions o;
    o.backend = b;
    o.faults.fail_read_nth = 3;
    DiskReader r(path, o);
    // Five aligned 64 KiB reads: one piece each, issued in order, so the third one fails.
    AlignedBuffer dst(5 * 65536);
    std::vector<Ticket> tickets;
    for (int i = 0; i < 5; ++i)
      tickets.push_back(
          r.submit(ReadRequest{uint64_t(i + 1) * 131072, 65536, dst.data() + i * 65536,
                               i == 2 ? "blk.7.ffn_gate_exps.weight" : ""}));
    for (int i = 0; i < 5; ++i) {
      if (i == 2) {
        const Error e = expect_error([&] { r.wait(tickets[i]); });
        CHECK(e.category() == ErrorCategory::io);
        CHECK(std::string(e.what()) ==
              path +
                  ": cannot read 65536 bytes at offset 393216 (tensor "
                  "'blk.7.ffn_gate_exps.weight'): the read at offset 393216 failed: Input/output "
                  "error (EIO)");
        // Retired by the throw.
        CHECK(expect_error([&] { r.poll(tickets[i]); }).category() ==
              ErrorCategory::invalid_argument);
      } else {
        r.wait(tickets[i]);
        CHECK(std::memcmp(dst.data() + i * 65536, f.bytes.data() + (i + 1) * 131072, 65536) == 0);
      }
    }
    random_reads(r, f.bytes, 20, 31);  // the reader goes on working
  }
  SUBCASE("BERTH_DISK_READER_FAIL_NTH") {
    EnvGuard env("BERTH_DISK_READER_FAIL_NTH", "1");
    DiskReader r(path);
    AlignedBuffer dst(4096);
    const Error e = expect_error([&] { r.wait(r.submit(ReadRequest{8192, 4096, dst.data()})); });
    CHECK(e.category() == ErrorCategory::io);
    CHECK(std::string(e.what()).find("the read at offset 8192 failed: Input/output error (EIO)") !=
          std::string::npos);
  }
}

TEST_CASE("disk reader: bad requests, tickets and files") {
  Fixture f;
  const std::string path = f.file.string();
  const uint64_t size = f.bytes.size();
  DiskReader r(path);
  AlignedBuffer dst(8192);

  const Error past = expect_error([&] { r.submit(ReadRequest{size - 10, 11, dst.data(), "t"}); });
  CHECK(past.category() == ErrorCategory::invalid_argument);
  CHECK(std::string(past.what()) ==
        path + ": read of 11 bytes at offset " + std::to_string(size - 10) +
            " (tensor 't') ends past the end of the file (" + std::to_string(size) + " bytes)");
  CHECK(expect_error([&] {
          r.submit(ReadRequest{~uint64_t{0}, 2, dst.data()});
        }).category() == ErrorCategory::invalid_argument);
  const Error null_dst = expect_error([&] { r.submit(ReadRequest{0, 1, nullptr}); });
  CHECK(null_dst.category() == ErrorCategory::invalid_argument);
  CHECK(std::string(null_dst.what()) == path + ": read of 1 bytes at offset 0: null destination");

  // Nothing to read: done at once.
  const Ticket empty = r.submit(std::span<const ReadRequest>());
  CHECK(r.poll(empty));
  const Ticket zero = r.submit(ReadRequest{size, 0, nullptr});
  CHECK(r.poll(zero));

  const Ticket t = r.submit(ReadRequest{0, 100, dst.data()});
  r.wait(t);
  const Error again = expect_error([&] { r.wait(t); });
  CHECK(again.category() == ErrorCategory::invalid_argument);
  CHECK(std::string(again.what()) ==
        path + ": disk reader ticket " + std::to_string(t) + " is unknown or already retired");
  CHECK(expect_error([&] { r.poll(0); }).category() == ErrorCategory::invalid_argument);

  const Error missing = expect_error([&] { DiskReader m((f.dir / "none.gguf").string()); });
  CHECK(missing.category() == ErrorCategory::io);
  CHECK(std::string(missing.what()) ==
        (f.dir / "none.gguf").string() + ": cannot open: No such file or directory (ENOENT)");
  const Error dir = expect_error([&] { DiskReader m(f.dir.string()); });
  CHECK(dir.category() == ErrorCategory::io);
  CHECK(std::string(dir.what()) == f.dir.string() + ": cannot read: not a regular file");
  DiskReaderOptions o;
  o.queue_depth = 0;
  CHECK(expect_error([&] { DiskReader m(path, o); }).category() == ErrorCategory::invalid_argument);
}

TEST_CASE("disk reader: destroyed with reads queued and in flight") {
  Fixture f;
  for (const Backend b : {Backend::pread, Backend::io_uring}) {
    if (b == Backend::io_uring && !uring_usable(f.file)) break;
    // Destinations outlive the reader; unaligned ones take the bounce path.
    std::vector<AlignedBuffer> dsts;
    for (int i = 0; i < 100; ++i) dsts.emplace_back(size_t{1} << 20);
    DiskReaderOptions o;
    o.backend = b;
    o.queue_depth = 4;
    DiskReader r(f.file.string(), o);
    for (int i = 0; i < 100; ++i)
      r.submit(ReadRequest{uint64_t(i) * 90001, (size_t{1} << 20) - 4096 * (i % 2),
                           dsts[i].data() + (i % 2) * 7});
  }
}
