// The Engine turns large requests into block operations kept in flight together on one or
// more backend workers, completes short transfers by resubmitting the remainder, and reports
// each submission through a Handle (byte count, done(), wait()).
//
// Note: request shape. A submission is a set of chains; a chain is a list of stages run one
// after the other; a stage is a set of requests run together. TensorStore's put is one chain
// per file: [invalidate header] -> [payload, tail] -> [final header], so a header that reads as
// valid is only ever written after its payload completed. A plain read or write is one chain
// with one stage holding one request.
//
// Note: checksums on the I/O side. A read may ask for the CRC-32C of its first `crc_len` bytes.
// When every request of a submission has completed, its handle goes to the engine's verifier
// thread, which computes those CRCs (no lock, no GIL) and only then completes the handle: the
// thread that waits for the read (the compute thread, for a fetch) finds them computed and only
// compares. Why a thread of its own and not the worker: the worker keeps the disk's queue full
// while a finished read of hundreds of MB is checksummed. Writes the same way: a put's final
// header is sealed (its payload's CRC-32C and its own CRC-32 filled in, RequestSpec::seal_*) by
// the verifier once the payload is written, so the thread that calls put does no pass either.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "io/backend.h"
#include "io/file.h"
#include "io/io_common.h"

namespace offloadpp {
namespace io {

struct Chain;
class Handle;

struct RequestSpec {
  bool write = false;
  std::shared_ptr<File> file;
  char* buf = nullptr;
  uint64_t len = 0;
  int64_t offset = 0;
  // Reads only: bytes that must arrive. An end of file past `required` (a padded tail read
  // of an unpadded file) ends the request successfully; before it, it is an error.
  uint64_t required = 0;
  // Reads only: the CRC-32C of buf[0, crc_len) is computed once the read completes, before its
  // handle does (Handle::crcs, in submission order of the requests that ask).
  uint64_t crc_len = 0;
  // Writes only: a header to seal before it is written (TensorStore's final header, written
  // after its payload): the engine stores the CRC-32C of seal_src[0, seal_len) as a
  // little-endian u32 at buf + seal_at, then the CRC-32 (zlib's polynomial) of buf[0, len - 4)
  // in its last 4 bytes, on the verifier thread, before the request's stage starts.
  const char* seal_src = nullptr;
  uint64_t seal_len = 0;
  int64_t seal_at = -1;
};

using StageSpec = std::vector<RequestSpec>;
using ChainSpec = std::vector<StageSpec>;

struct Request {
  RequestSpec spec;
  Chain* chain = nullptr;
  uint64_t handed = 0;       // bytes handed out as blocks
  uint32_t outstanding = 0;  // blocks handed out and not finished (in flight or awaiting retry)
  bool failed = false;
  bool names_error = false;  // its failure is the one the handle reports (fail_request_locked)
  bool finished = false;
  bool sealed = false;
};

struct Chain {
  std::vector<std::vector<std::shared_ptr<Request>>> stages;
  size_t current = 0;
  size_t pending = 0;  // unfinished requests of the current stage
  bool failed = false;
  Handle* handle = nullptr;
};

// Wall time with at least one submission outstanding, per direction. Several engines may share
// one clock (TensorStore: one engine per directory) so that their busy time is a union, not a sum.
class BusyClock {
 public:
  void begin(bool write, int64_t now);
  void end(bool write, int64_t now);
  double seconds(bool write) const;

 private:
  mutable std::mutex mu_;
  int active_[2] = {0, 0};
  int64_t since_[2] = {0, 0};
  double seconds_[2] = {0, 0};
};

struct EngineStats {
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  double read_seconds = 0;   // wall time with at least one read submission outstanding
  double write_seconds = 0;  // same for writes
  uint64_t reads = 0;
  uint64_t writes = 0;
};

// One submission. Owned jointly by the caller (Python) and the engine until it completes.
class Handle {
 public:
  uint64_t nbytes() const { return nbytes_; }
  bool is_write() const { return write_; }
  bool done() const { return done_.load(std::memory_order_acquire); }
  // Blocks until complete; returns nbytes or throws the first IoError. timeout_s < 0: forever.
  // Returns false (without throwing) if the timeout expired first.
  bool wait_for(double timeout_s);
  uint64_t wait();
  bool failed() const;
  double elapsed_seconds() const;  // submit -> completion (so far, if not done)
  // The CRC-32C of each read that asked (RequestSpec::crc_len), in submission order; complete
  // once done() and not failed().
  const std::vector<uint32_t>& crcs() const { return crcs_; }

 private:
  friend class Engine;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  bool failed_ = false;
  int err_ = 0;
  std::string err_op_;
  std::string err_path_;
  int64_t err_offset_ = -1;
  uint64_t nbytes_ = 0;
  bool write_ = false;
  size_t pending_chains_ = 0;
  std::vector<std::unique_ptr<Chain>> chains_;
  int64_t t_submit_ns_ = 0;
  std::atomic<int64_t> t_done_ns_{0};
  std::vector<std::pair<const char*, uint64_t>> crc_jobs_;  // (buffer, bytes) to checksum
  std::vector<uint32_t> crcs_;
};

class Engine {
 public:
  Engine(BackendKind kind, uint64_t block_size, unsigned queue_depth, unsigned num_threads,
         std::shared_ptr<BusyClock> clock = nullptr);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates every request (O_DIRECT alignment of address, length and offset; readable or
  // writable file; required <= len) and throws IoError(EINVAL, ...) before anything starts.
  // `nbytes` is what the handle reports; `write` selects the statistics bucket.
  std::shared_ptr<Handle> submit(std::vector<ChainSpec> chains, bool write, uint64_t nbytes);

  // Convenience: one request.
  std::shared_ptr<Handle> submit_one(const RequestSpec& spec);

  void wait_all();  // until no submission is outstanding
  void close();     // drains outstanding work, stops the workers; idempotent
  EngineStats stats() const;

  BackendKind kind() const { return kind_; }
  const char* backend_name_str() const;
  uint64_t block_size() const { return block_size_; }
  unsigned queue_depth() const { return queue_depth_; }
  unsigned num_threads() const { return num_threads_; }
  uint64_t outstanding() const;

  // Test hook: the `after_blocks`-th block completion from now gets res = -err (err > 0) or is
  // cut to `short_bytes` (err == 0). Exercises the error and short-transfer paths of every
  // backend without a failing device.
  void inject_fault(int64_t after_blocks, int err, int64_t short_bytes);

 private:
  struct Slot {
    std::shared_ptr<Request> req;
    uint64_t rel = 0;  // offset of this block inside its request
    uint64_t len = 0;
  };
  struct Worker {
    std::unique_ptr<Backend> backend;
    std::vector<Slot> slots;
    std::vector<uint32_t> free_slots;
    std::deque<uint32_t> retry;
    size_t inflight = 0;
    std::thread thread;
  };

  void worker_main(Worker& w);
  void verifier_main();
  void complete_handle_locked(Handle& h, std::vector<std::shared_ptr<Handle>>& fin);
  void queue_stage_locked(Chain& c);
  void fill_locked(Worker& w, std::vector<BlockOp>& batch, std::vector<std::shared_ptr<Handle>>& fin);
  void complete_block_locked(Worker& w, const BlockCompletion& c, std::vector<std::shared_ptr<Handle>>& fin);
  void fail_request_locked(Request& r, int err, const std::string& op, int64_t offset);
  void release_block_locked(Worker& w, uint32_t slot, std::vector<std::shared_ptr<Handle>>& fin);
  void request_finished_locked(Request& r, std::vector<std::shared_ptr<Handle>>& fin);
  void start_stage_locked(Chain& c, std::vector<std::shared_ptr<Handle>>& fin);
  void handle_finished_locked(Handle& h, std::vector<std::shared_ptr<Handle>>& fin);
  void fail_everything_locked(Worker& w, int err, const std::string& what,
                              std::vector<std::shared_ptr<Handle>>& fin);
  static void notify(std::vector<std::shared_ptr<Handle>>& fin);
  BlockOp make_op(const Request& r, uint64_t rel, uint64_t len, uint32_t slot) const;

  BackendKind kind_;
  uint64_t block_size_;
  unsigned queue_depth_;
  unsigned num_threads_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::thread verifier_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // workers: new requests or stop
  std::condition_variable idle_cv_;  // wait_all
  // Requests not yet fully handed to a worker, reads and writes apart: a worker fills its free
  // slots from reads_ first. Why: the runtime's reads are on the critical path (a unit's
  // weights the next forward waits for) while its writes (updated state) only have to finish
  // before their own key is read again, which the TensorStore orders itself. In one FIFO a
  // fetch would queue behind hundreds of MB of state written at the end of a step.
  std::deque<std::shared_ptr<Request>> reads_;
  std::deque<std::shared_ptr<Request>> writes_;
  bool queued_locked() const { return !reads_.empty() || !writes_.empty(); }
  // Handles in flight, kept alive by the engine until they finish.
  std::unordered_map<Handle*, std::shared_ptr<Handle>> live_;
  bool stopping_ = false;
  bool closed_ = false;
  // The verifier's work: a handle whose I/O is complete and whose reads' CRCs are still to
  // compute (still in live_), or a chain whose next stage holds a header to seal first.
  struct VerifyWork {
    std::shared_ptr<Handle> handle;
    Chain* seal = nullptr;
  };
  std::deque<VerifyWork> verify_;
  size_t sealing_ = 0;  // chains handed to the verifier to seal, not yet queued again
  std::condition_variable verify_cv_;
  bool verifier_stop_ = false;

  EngineStats stats_;
  std::shared_ptr<BusyClock> clock_;

  int64_t fault_countdown_ = -1;
  int fault_err_ = 0;
  int64_t fault_short_ = 0;
};

int64_t now_ns();

}  // namespace io
}  // namespace offloadpp
