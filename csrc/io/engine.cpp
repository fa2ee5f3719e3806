#include "io/engine.h"

#include "io/aligned_buffer.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>

namespace offloadpp {
namespace io {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// ---------------------------------------------------------------------------------------------
// Handle

bool Handle::wait_for(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  auto ready = [&] { return done_.load(std::memory_order_acquire); };
  if (timeout_s < 0) {
    cv_.wait(lock, ready);
  } else if (!cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), ready)) {
    return false;
  }
  if (failed_) throw IoError(err_, err_op_, err_path_, err_offset_);
  return true;
}

uint64_t Handle::wait() {
  wait_for(-1);
  return nbytes_;
}

bool Handle::failed() const { return done() && failed_; }

double Handle::elapsed_seconds() const {
  const int64_t end = done() ? t_done_ns_.load() : now_ns();
  return static_cast<double>(end - t_submit_ns_) * 1e-9;
}

// ---------------------------------------------------------------------------------------------
// BusyClock

void BusyClock::begin(bool write, int64_t now) {
  std::lock_guard<std::mutex> lock(mu_);
  if (active_[write]++ == 0) since_[write] = now;
}

void BusyClock::end(bool write, int64_t now) {
  std::lock_guard<std::mutex> lock(mu_);
  if (--active_[write] == 0) seconds_[write] += static_cast<double>(now - since_[write]) * 1e-9;
}

double BusyClock::seconds(bool write) const {
  std::lock_guard<std::mutex> lock(mu_);
  double s = seconds_[write];
  if (active_[write] > 0) s += static_cast<double>(now_ns() - since_[write]) * 1e-9;
  return s;
}

// ---------------------------------------------------------------------------------------------
// Engine: construction, submission

Engine::Engine(BackendKind kind, uint64_t block_size, unsigned queue_depth, unsigned num_threads,
               std::shared_ptr<BusyClock> clock)
    : kind_(kind),
      block_size_(block_size),
      queue_depth_(queue_depth),
      num_threads_(num_threads),
      clock_(clock ? std::move(clock) : std::make_shared<BusyClock>()) {
  if (kind == BackendKind::AUTO) throw IoError(EINVAL, "Engine needs a concrete backend, not auto", "", -1);
  if (block_size == 0 || !is_aligned(block_size)) {
    throw IoError(EINVAL, "block size " + std::to_string(block_size) + " is not a positive multiple of " +
                              std::to_string(kAlignment), "", -1);
  }
  if (queue_depth == 0 || queue_depth > 65536) {
    throw IoError(EINVAL, "queue depth " + std::to_string(queue_depth) + " outside [1, 65536]", "", -1);
  }
  if (num_threads == 0 || num_threads > 256) {
    throw IoError(EINVAL, "thread count " + std::to_string(num_threads) + " outside [1, 256]", "", -1);
  }
  // Backends first (they may throw), threads after, so a failure leaves nothing running.
  for (unsigned i = 0; i < num_threads; ++i) {
    auto w = std::make_unique<Worker>();
    w->backend = make_backend(kind, queue_depth);
    w->slots.resize(queue_depth);
    for (uint32_t s = queue_depth; s > 0; --s) w->free_slots.push_back(s - 1);
    workers_.push_back(std::move(w));
  }
  for (auto& w : workers_) {
    Worker* wp = w.get();
    w->thread = std::thread([this, wp] { worker_main(*wp); });
  }
  verifier_ = std::thread([this] { verifier_main(); });
}

Engine::~Engine() { close(); }

const char* Engine::backend_name_str() const { return backend_name(kind_); }

void Engine::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    stopping_ = true;
  }
  work_cv_.notify_all();
  // Workers drain every outstanding request before they exit: buffers handed to the kernel
  // must not be released while it may still write into them.
  for (auto& w : workers_) {
    if (w->thread.joinable()) w->thread.join();
  }
  // Every request has completed: what is left to verify is queued. The verifier drains it.
  {
    std::lock_guard<std::mutex> lock(mu_);
    verifier_stop_ = true;
  }
  verify_cv_.notify_all();
  if (verifier_.joinable()) verifier_.join();
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
}

static void validate_spec(const RequestSpec& s) {
  if (!s.file || s.file->closed()) throw IoError(EBADF, "submit (file is closed)", s.file ? s.file->path() : "", -1);
  const std::string& path = s.file->path();
  const char* op = s.write ? "pwrite" : "pread";
  if (s.write && !s.file->writable()) throw IoError(EBADF, std::string(op) + " (file not open for writing)", path, s.offset);
  if (!s.write && !s.file->readable()) throw IoError(EBADF, std::string(op) + " (file not open for reading)", path, s.offset);
  if (s.offset < 0) throw IoError(EINVAL, std::string(op) + " (negative offset)", path, s.offset);
  if (s.len > 0 && s.buf == nullptr) throw IoError(EFAULT, std::string(op) + " (null buffer)", path, s.offset);
  if (!s.write && s.required > s.len) {
    throw IoError(EINVAL, std::string(op) + " (required bytes exceed the request length)", path, s.offset);
  }
  if (s.crc_len > 0 && (s.write || s.crc_len > s.len)) {
    throw IoError(EINVAL, std::string(op) + " (a checksum is computed for reads, within the request)", path,
                  s.offset);
  }
  if (s.seal_at >= 0 && (!s.write || s.len < 8 || static_cast<uint64_t>(s.seal_at) + 8 > s.len ||
                         (s.seal_len > 0 && s.seal_src == nullptr))) {
    throw IoError(EINVAL, std::string(op) + " (a header is sealed by a write, its checksum inside it)", path,
                  s.offset);
  }
  if (s.file->direct()) {
    const auto addr = reinterpret_cast<uintptr_t>(s.buf);
    char what[200];
    if (!is_aligned(addr)) {
      std::snprintf(what, sizeof(what), "%s with O_DIRECT (buffer address 0x%llx is not %llu-byte aligned)", op,
                    static_cast<unsigned long long>(addr), static_cast<unsigned long long>(kAlignment));
      throw IoError(EINVAL, what, path, s.offset);
    }
    if (!is_aligned(s.len)) {
      std::snprintf(what, sizeof(what), "%s with O_DIRECT (length %llu is not a multiple of %llu)", op,
                    static_cast<unsigned long long>(s.len), static_cast<unsigned long long>(kAlignment));
      throw IoError(EINVAL, what, path, s.offset);
    }
    if (!is_aligned(static_cast<uint64_t>(s.offset))) {
      std::snprintf(what, sizeof(what), "%s with O_DIRECT (file offset is not a multiple of %llu)", op,
                    static_cast<unsigned long long>(kAlignment));
      throw IoError(EINVAL, what, path, s.offset);
    }
  }
}

std::shared_ptr<Handle> Engine::submit(std::vector<ChainSpec> chains, bool write, uint64_t nbytes) {
  auto h = std::make_shared<Handle>();
  h->nbytes_ = nbytes;
  h->write_ = write;
  for (auto& chain_spec : chains) {
    auto c = std::make_unique<Chain>();
    c->handle = h.get();
    for (auto& stage_spec : chain_spec) {
      std::vector<std::shared_ptr<Request>> reqs;
      for (auto& spec : stage_spec) {
        validate_spec(spec);
        if (spec.len == 0) continue;
        if (spec.crc_len > 0) h->crc_jobs_.emplace_back(spec.buf, spec.crc_len);
        auto r = std::make_shared<Request>();
        r->spec = spec;
        r->chain = c.get();
        reqs.push_back(std::move(r));
      }
      if (!reqs.empty()) c->stages.push_back(std::move(reqs));
    }
    if (!c->stages.empty()) h->chains_.push_back(std::move(c));
  }
  h->pending_chains_ = h->chains_.size();
  std::vector<std::shared_ptr<Handle>> fin;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) throw IoError(EBADF, "submit on a closed I/O engine", "", -1);
    h->t_submit_ns_ = now_ns();
    live_.emplace(h.get(), h);
    clock_->begin(write, h->t_submit_ns_);
    if (h->pending_chains_ == 0) {
      handle_finished_locked(*h, fin);
    } else {
      for (auto& c : h->chains_) start_stage_locked(*c, fin);
    }
  }
  notify(fin);
  work_cv_.notify_all();
  return h;
}

std::shared_ptr<Handle> Engine::submit_one(const RequestSpec& spec) {
  std::vector<ChainSpec> chains(1);
  chains[0].push_back(StageSpec{spec});
  const uint64_t n = spec.write ? spec.len : spec.required;
  return submit(std::move(chains), spec.write, n);
}

void Engine::wait_all() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return live_.empty(); });
}

uint64_t Engine::outstanding() const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_.size();
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  EngineStats s = stats_;
  s.read_seconds = clock_->seconds(false);
  s.write_seconds = clock_->seconds(true);
  return s;
}

void Engine::inject_fault(int64_t after_blocks, int err, int64_t short_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  fault_countdown_ = after_blocks;
  fault_err_ = err;
  fault_short_ = short_bytes;
}

// ---------------------------------------------------------------------------------------------
// Engine: worker loop and completion processing (all *_locked run with mu_ held)

BlockOp Engine::make_op(const Request& r, uint64_t rel, uint64_t len, uint32_t slot) const {
  return BlockOp{r.spec.write, r.spec.file->fd(), r.spec.buf + rel, len, r.spec.offset + static_cast<int64_t>(rel),
                 slot};
}

void Engine::notify(std::vector<std::shared_ptr<Handle>>& fin) {
  for (auto& h : fin) {
    // done_ was set under mu_; taking the handle mutex orders this notify after any waiter's
    // predicate check, so no wake-up is lost.
    { std::lock_guard<std::mutex> g(h->mu_); }
    h->cv_.notify_all();
  }
  fin.clear();
}

void Engine::worker_main(Worker& w) {
  std::vector<BlockOp> batch;
  batch.reserve(queue_depth_);
  std::vector<BlockCompletion> events(queue_depth_);
  std::vector<std::shared_ptr<Handle>> fin;
  for (;;) {
    batch.clear();
    {
      std::unique_lock<std::mutex> lock(mu_);
      for (;;) {
        fill_locked(w, batch, fin);
        if (!batch.empty() || w.inflight > 0 || !fin.empty()) break;
        if (stopping_ && !queued_locked() && sealing_ == 0) return;  // a sealed stage queues more
        work_cv_.wait(lock);
      }
    }
    notify(fin);
    if (batch.empty() && w.inflight == 0) continue;
    try {
      if (!batch.empty()) {
        w.inflight += batch.size();
        w.backend->submit(batch.data(), batch.size());
      }
      const size_t n = w.backend->wait(events.data(), 1, events.size());
      bool more;
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (size_t i = 0; i < n; ++i) complete_block_locked(w, events[i], fin);
        more = queued_locked();
      }
      notify(fin);
      if (more && num_threads_ > 1) work_cv_.notify_all();
    } catch (const IoError& e) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        fail_everything_locked(w, e.err(), e.what(), fin);
      }
      notify(fin);
    }
  }
}

void Engine::fill_locked(Worker& w, std::vector<BlockOp>& batch, std::vector<std::shared_ptr<Handle>>& fin) {
  while (w.inflight + batch.size() < queue_depth_) {
    if (!w.retry.empty()) {
      const uint32_t si = w.retry.front();
      w.retry.pop_front();
      Slot& s = w.slots[si];
      if (s.req->failed) {
        release_block_locked(w, si, fin);
      } else {
        batch.push_back(make_op(*s.req, s.rel, s.len, si));
      }
      continue;
    }
    for (auto* q : {&reads_, &writes_}) {
      while (!q->empty() && (q->front()->failed || q->front()->handed >= q->front()->spec.len)) q->pop_front();
    }
    auto& queue = reads_.empty() ? writes_ : reads_;
    if (queue.empty()) break;
    std::shared_ptr<Request> rp = queue.front();
    Request& r = *rp;
    const uint64_t len = std::min<uint64_t>(block_size_, r.spec.len - r.handed);
    const uint32_t si = w.free_slots.back();
    w.free_slots.pop_back();
    w.slots[si] = Slot{rp, r.handed, len};
    batch.push_back(make_op(r, r.handed, len, si));
    r.handed += len;
    r.outstanding++;
    if (r.handed >= r.spec.len) queue.pop_front();
  }
}

void Engine::complete_block_locked(Worker& w, const BlockCompletion& c, std::vector<std::shared_ptr<Handle>>& fin) {
  const uint32_t si = static_cast<uint32_t>(c.tag);
  w.inflight--;
  Slot& s = w.slots[si];
  std::shared_ptr<Request> rp = s.req;
  Request& r = *rp;
  int64_t res = c.res;
  if (fault_countdown_ >= 0 && fault_countdown_-- == 0) {
    res = fault_err_ > 0 ? -static_cast<int64_t>(fault_err_) : std::min<int64_t>(res, fault_short_);
  }
  // (a block of a request already failed is still looked at: a failure before the one reported
  // names the error instead, see fail_request_locked; its remainder is not resubmitted, fill_locked)
  const int64_t file_off = r.spec.offset + static_cast<int64_t>(s.rel);
  const std::string op = std::string(r.spec.write ? "pwrite" : "pread") + " of " + std::to_string(s.len) +
                         " bytes (" + w.backend->name() + ")";
  if (res < 0) {
    fail_request_locked(r, static_cast<int>(-res), op, file_off);
    release_block_locked(w, si, fin);
    return;
  }
  const auto got = static_cast<uint64_t>(res);
  if (got >= s.len) {
    release_block_locked(w, si, fin);
    return;
  }
  // Short transfer.
  if (got == 0) {
    if (!r.spec.write && s.rel >= r.spec.required) {  // end of file inside padding: fine
      release_block_locked(w, si, fin);
    } else {
      fail_request_locked(r, EIO, op + (r.spec.write ? ": wrote 0 bytes" :
                                        ": unexpected end of file (file shorter than expected: truncated?)"),
                          file_off);
      release_block_locked(w, si, fin);
    }
    return;
  }
  s.rel += got;
  s.len -= got;
  if (r.spec.file->direct() && !is_aligned(got)) {
    // O_DIRECT cannot resume at an unaligned position. For a read this is the end of file.
    if (!r.spec.write && s.rel >= r.spec.required) {
      release_block_locked(w, si, fin);
    } else {
      fail_request_locked(r, EIO, op + ": short " + (r.spec.write ? "write" : "read") + " of " + std::to_string(got) +
                                      " bytes that O_DIRECT cannot resume" +
                                      (r.spec.write ? " (device full?)" : " (file truncated?)"),
                          file_off);
      release_block_locked(w, si, fin);
    }
    return;
  }
  w.retry.push_back(si);  // resubmit the remainder
}

void Engine::fail_request_locked(Request& r, int err, const std::string& op, int64_t offset) {
  r.failed = true;
  Handle& h = *r.chain->handle;
  // The first error of a handle is the one it reports; of one request's failed blocks, the first in
  // the file (where the data ran out), whichever completes first: the blocks run concurrently
  // (a threadpool's 32 KiB block could finish before the 24 KiB one, the read past the end of a
  // 24 KiB file then naming offset 32 KiB: tests/test_io_engine.py test_read_past_end).
  if (!h.failed_ || (r.names_error && offset < h.err_offset_)) {
    r.names_error = true;
    h.failed_ = true;
    h.err_ = err;
    h.err_op_ = op;
    h.err_path_ = r.spec.file ? r.spec.file->path() : "";
    h.err_offset_ = offset;
  }
}

void Engine::release_block_locked(Worker& w, uint32_t si, std::vector<std::shared_ptr<Handle>>& fin) {
  std::shared_ptr<Request> rp = std::move(w.slots[si].req);
  w.slots[si] = Slot{};
  w.free_slots.push_back(si);
  Request& r = *rp;
  r.outstanding--;
  if (r.outstanding == 0 && !r.finished && (r.failed || r.handed >= r.spec.len)) request_finished_locked(r, fin);
}

void Engine::request_finished_locked(Request& r, std::vector<std::shared_ptr<Handle>>& fin) {
  r.finished = true;
  Chain& c = *r.chain;
  if (r.failed) c.failed = true;
  if (--c.pending > 0) return;
  if (!c.failed && c.current + 1 < c.stages.size()) {
    c.current++;
    start_stage_locked(c, fin);
    return;
  }
  Handle& h = *c.handle;
  if (--h.pending_chains_ == 0) handle_finished_locked(h, fin);
}

void Engine::start_stage_locked(Chain& c, std::vector<std::shared_ptr<Handle>>& fin) {
  auto& reqs = c.stages[c.current];
  c.pending = reqs.size();
  for (auto& r : reqs) {
    if (r->spec.seal_at >= 0 && !r->sealed) {  // the verifier seals the header, then queues the stage
      auto it = live_.find(c.handle);
      if (it != live_.end()) {
        verify_.push_back(VerifyWork{it->second, &c});
        sealing_++;
        verify_cv_.notify_one();
        return;
      }
    }
  }
  queue_stage_locked(c);
}

void Engine::queue_stage_locked(Chain& c) {
  for (auto& r : c.stages[c.current]) (r->spec.write ? writes_ : reads_).push_back(r);
}

void Engine::handle_finished_locked(Handle& h, std::vector<std::shared_ptr<Handle>>& fin) {
  const int64_t now = now_ns();
  h.t_done_ns_.store(now);
  if (!h.failed_) {
    if (h.write_) {
      stats_.bytes_written += h.nbytes_;
      stats_.writes++;
    } else {
      stats_.bytes_read += h.nbytes_;
      stats_.reads++;
    }
  }
  clock_->end(h.write_, now);
  if (!h.failed_ && !h.crc_jobs_.empty()) {
    auto it = live_.find(&h);
    if (it != live_.end()) {  // stays live (wait_all waits for it) until verified
      verify_.push_back(VerifyWork{it->second, nullptr});
      verify_cv_.notify_one();
      return;
    }
  }
  complete_handle_locked(h, fin);
}

void Engine::complete_handle_locked(Handle& h, std::vector<std::shared_ptr<Handle>>& fin) {
  h.done_.store(true, std::memory_order_release);
  auto it = live_.find(&h);
  if (it != live_.end()) {
    fin.push_back(std::move(it->second));
    live_.erase(it);
  }
  if (live_.empty()) idle_cv_.notify_all();
}

// CRC-32 with zlib's polynomial (0xEDB88320, reflected), as the header's own checksum
// (offloadpp/io/format.py): a few KiB a header, so a table is fast enough.
static uint32_t crc32_ieee(const char* p, uint64_t n) {
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = 0xFFFFFFFFu;
  for (uint64_t i = 0; i < n; ++i) c = table[(c ^ static_cast<unsigned char>(p[i])) & 0xff] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

void Engine::verifier_main() {
  std::vector<std::shared_ptr<Handle>> fin;
  for (;;) {
    VerifyWork w;
    {
      std::unique_lock<std::mutex> lock(mu_);
      verify_cv_.wait(lock, [&] { return !verify_.empty() || verifier_stop_; });
      if (verify_.empty()) return;
      w = std::move(verify_.front());
      verify_.pop_front();
    }
    if (w.seal != nullptr) {
      // The stage's requests are not queued: no other thread touches their buffers.
      for (auto& r : w.seal->stages[w.seal->current]) {
        const RequestSpec& s = r->spec;
        if (s.seal_at < 0) continue;
        const uint32_t crc = crc32c(s.seal_src, s.seal_len);
        for (int i = 0; i < 4; ++i) s.buf[s.seal_at + i] = static_cast<char>((crc >> (8 * i)) & 0xff);
        const uint32_t hcrc = crc32_ieee(s.buf, s.len - 4);
        for (int i = 0; i < 4; ++i) s.buf[s.len - 4 + i] = static_cast<char>((hcrc >> (8 * i)) & 0xff);
        r->sealed = true;
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        queue_stage_locked(*w.seal);
        sealing_--;
      }
      work_cv_.notify_all();
      continue;
    }
    std::shared_ptr<Handle> h = std::move(w.handle);
    // The handle is not done: nobody reads crcs_ yet, and the buffers are the caller's until it is.
    std::vector<uint32_t> crcs;
    crcs.reserve(h->crc_jobs_.size());
    for (const auto& job : h->crc_jobs_) crcs.push_back(crc32c(job.first, job.second));
    {
      std::lock_guard<std::mutex> lock(mu_);
      h->crcs_ = std::move(crcs);
      complete_handle_locked(*h, fin);
    }
    notify(fin);
  }
}

void Engine::fail_everything_locked(Worker& w, int err, const std::string& what,
                                    std::vector<std::shared_ptr<Handle>>& fin) {
  // The backend itself failed (io_getevents/io_uring_enter error): nothing it holds will
  // complete, so fail those requests rather than hang their waiters.
  w.retry.clear();
  for (uint32_t si = 0; si < w.slots.size(); ++si) {
    if (!w.slots[si].req) continue;
    Request& r = *w.slots[si].req;
    if (!r.failed) fail_request_locked(r, err, what, -1);
    release_block_locked(w, si, fin);
  }
  w.inflight = 0;
}

}  // namespace io
}  // namespace offloadpp
