// aiodist as a c10d::Backend: the C++ object torch's ProcessGroup dispatches to.
//
// How it works: every virtual method of c10d::Backend that aiodist supports creates an
// AiodistWork (a c10d::Work with a c10 Future), takes the GIL and hands the work and the
// operation's arguments to a Python adapter (aiodist/torch/_adapter.py). The adapter starts the
// operation on aiodist's runtime loop and returns at once; when the operation ends, a
// completion callback on aiodist's loop calls AiodistWork._finish / _fail, which completes the
// work and its future (no polling, no thread of our own). Errors the adapter reports come back
// as (kind, message) and are raised as the c10 error class torch's Python face maps to its own
// exception classes (DistNetworkError, DistBackendError, ValueError, ...).

#include <torch/extension.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace aiodist_torch {

// The kinds of error the adapter reports (aiodist/torch/_adapter.py keeps the same numbers).
enum ErrorKind : int {
  kOk = 0,
  kDistError = 1,
  kBackendError = 2,  // timeouts, mismatches: torch's DistBackendError
  kNetworkError = 3,
  kStoreError = 4,
  kValueError = 5,
  kTypeError = 6,
  kRuntimeError = 7,
};

[[noreturn]] void throwKind(int kind, const std::string& msg) {
  switch (kind) {
    case kBackendError:
      C10_THROW_ERROR(DistBackendError, msg);
    case kNetworkError:
      C10_THROW_ERROR(DistNetworkError, msg);
    case kStoreError:
      C10_THROW_ERROR(DistStoreError, msg);
    case kValueError:
      C10_THROW_ERROR(ValueError, msg);
    case kTypeError:
      C10_THROW_ERROR(TypeError, msg);
    case kDistError:
      C10_THROW_ERROR(DistError, msg);
    default:
      C10_THROW_ERROR(Error, msg);
  }
}

std::exception_ptr makeError(int kind, const std::string& msg) {
  try {
    throwKind(kind, msg);
  } catch (...) {
    return std::current_exception();
  }
}

// Runs the completion of work futures, one at a time, in the order aiodist's loop finished the
// operations: off the loop thread, because a future callback may start another operation and
// wait for it (DDP's PowerSGD hook does), which needs the loop running; in order, because
// callbacks that start collectives must start them in the same order on every rank.
//
// A completion holds tensors and a future, whose last references may be Python objects: letting
// them go takes the GIL. Once the interpreter is finalizing, a thread that asks for the GIL is
// ended on the spot (pthread_exit), and ending it inside a destructor aborts the process
// ("terminate called without an active exception", after the program had done all its work).
// So at exit, before finalizing, close() lets the completions posted so far run and end, and
// later ones are kept, never run nor destroyed (the process is ending).
class Completer {
 public:
  static Completer& get() {
    static Completer* instance = new Completer();  // never destroyed: its thread is detached
    return *instance;
  }

  void post(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (closed_) {
        new std::function<void()>(std::move(fn));  // kept: see close()
        return;
      }
      queue_.push_back(std::move(fn));
    }
    cv_.notify_one();
  }

  // At interpreter exit (an atexit handler, the GIL released): take no more completions and
  // wait, ``seconds`` at most, until those posted have run and been destroyed. Any still queued
  // then are kept, never run: past this, this thread touches nothing of Python's.
  void close(double seconds) {
    std::unique_lock<std::mutex> lock(mutex_);
    closed_ = true;
    idle_.wait_for(lock, std::chrono::duration<double>(seconds), [this]() {
      return queue_.empty() && !busy_;
    });
    while (!queue_.empty()) {
      new std::function<void()>(std::move(queue_.front()));
      queue_.pop_front();
    }
  }

  bool onThread() const {
    return std::this_thread::get_id() == id_;
  }

 private:
  Completer() {
    std::thread t([this]() { run(); });
    id_ = t.get_id();
    t.detach();
  }

  void run() {
    for (;;) {
      {
        std::function<void()> fn;
        {
          std::unique_lock<std::mutex> lock(mutex_);
          cv_.wait(lock, [this]() { return !queue_.empty(); });
          fn = std::move(queue_.front());
          queue_.pop_front();
          busy_ = true;
        }
        try {
          fn();
        } catch (...) {
          // A future reports its callbacks' errors to whoever waits on the chained future.
        }
      }  // (what the completion held is let go here, before it counts as done)
      {
        std::lock_guard<std::mutex> lock(mutex_);
        busy_ = false;
      }
      idle_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::condition_variable idle_;
  std::deque<std::function<void()>> queue_;
  bool busy_ = false;
  bool closed_ = false;
  std::thread::id id_;
};

class AiodistWork : public c10d::Work {
 public:
  AiodistWork(int rank, c10d::OpType opType, std::vector<at::Tensor> outputs)
      : c10d::Work(rank, opType),
        // An operation started by a future callback (on the completer's thread) completes its
        // own future at once: the callback may be waiting for it, holding the completer.
        inline_(Completer::get().onThread()),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}

  // Called by the adapter on aiodist's loop thread when the operation succeeded: wait() is
  // released here, the future's callbacks run on the completer (see Completer).
  void finishOk(int sourceRank) {
    sourceRank_.store(sourceRank);
    finish();
    auto future = future_;
    auto outputs = outputs_;
    complete([future, outputs]() { future->markCompleted(c10::IValue(outputs)); });
  }

  // Called by the adapter on aiodist's loop thread when the operation failed.
  void finishError(int kind, const std::string& msg) {
    auto eptr = makeError(kind, msg);
    finish(eptr);
    auto future = future_;
    complete([future, eptr]() { future->setError(eptr); });
  }

  int sourceRank() const override {
    int rank = sourceRank_.load();
    TORCH_CHECK(rank >= 0, "sourceRank() is only defined for a completed receive");
    return rank;
  }

  std::vector<at::Tensor> result() override {
    return outputs_;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }

 private:
  void complete(std::function<void()> fn) {
    if (inline_) {
      fn();
    } else {
      Completer::get().post(std::move(fn));
    }
  }

  bool inline_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<int> sourceRank_{-1};
};

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

class AiodistBackend : public c10d::Backend {
 public:
  AiodistBackend(int rank, int size, py::object adapter)
      : c10d::Backend(rank, size), adapter_(std::move(adapter)) {}

  ~AiodistBackend() override {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      adapter_ = py::object();
    } else {
      adapter_.release();  // the interpreter is gone: leak rather than touch it
    }
  }

  const std::string getBackendName() const override {
    return "aiodist";
  }

  WorkPtr broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    return start("broadcast", c10d::OpType::BROADCAST, tensors, tensors, opts.rootRank, ms(opts.timeout));
  }

  WorkPtr allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    for (const auto& t : tensors) {
      if (t.is_sparse()) {  // torch's dispatcher sends sparse COO tensors here, as to gloo's
        return allreduce_sparse(tensors, opts);
      }
    }
    return start(
        "allreduce", c10d::OpType::ALLREDUCE, tensors, tensors, redop(opts.reduceOp), ms(opts.timeout));
  }

  // Sparse COO tensors (torch's dispatcher sends them here): blocking, completed on return
  // (see Adapter.allreduce_sparse).
  WorkPtr allreduce_sparse(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    return start(
        "allreduce_sparse",
        c10d::OpType::ALLREDUCE,
        tensors,
        tensors,
        redop(opts.reduceOp),
        ms(opts.timeout));
  }

  WorkPtr allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override {
    return start(
        "allreduce",
        c10d::OpType::ALLREDUCE_COALESCED,
        tensors,
        tensors,
        redop(opts.reduceOp),
        ms(opts.timeout));
  }

  WorkPtr reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    return start(
        "reduce",
        c10d::OpType::REDUCE,
        tensors,
        tensors,
        opts.rootRank,
        redop(opts.reduceOp),
        ms(opts.timeout));
  }

  WorkPtr allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    return start(
        "allgather", c10d::OpType::ALLGATHER, flat(outputs), outputs, inputs, ms(opts.timeout));
  }

  WorkPtr _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override {
    return start(
        "allgather_into_tensor",
        c10d::OpType::_ALLGATHER_BASE,
        {output},
        std::vector<at::Tensor>{output},
        std::vector<at::Tensor>{input},
        ms(opts.timeout));
  }

  WorkPtr allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    return start(
        "allgather_coalesced",
        c10d::OpType::ALLGATHER_COALESCED,
        flat(outputs),
        outputs,
        inputs,
        ms(opts.timeout));
  }

  WorkPtr allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    return start(
        "allgather_into_tensor",
        c10d::OpType::COALESCED,
        outputs,
        outputs,
        inputs,
        ms(opts.timeout));
  }

  WorkPtr gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override {
    return start(
        "gather", c10d::OpType::GATHER, flat(outputs), outputs, inputs, opts.rootRank, ms(opts.timeout));
  }

  WorkPtr scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override {
    return start(
        "scatter", c10d::OpType::SCATTER, outputs, outputs, inputs, opts.rootRank, ms(opts.timeout));
  }

  WorkPtr reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    return start(
        "reduce_scatter",
        c10d::OpType::REDUCE_SCATTER,
        outputs,
        outputs,
        inputs,
        redop(opts.reduceOp),
        ms(opts.timeout));
  }

  WorkPtr _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override {
    return start(
        "reduce_scatter_tensor",
        c10d::OpType::_REDUCE_SCATTER_BASE,
        {output},
        std::vector<at::Tensor>{output},
        std::vector<at::Tensor>{input},
        redop(opts.reduceOp),
        ms(opts.timeout));
  }

  WorkPtr reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    return start(
        "reduce_scatter_tensor",
        c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED,
        outputs,
        outputs,
        inputs,
        redop(opts.reduceOp),
        ms(opts.timeout));
  }

  WorkPtr alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplits,
      std::vector<int64_t>& inputSplits,
      const c10d::AllToAllOptions& opts) override {
    return start(
        "alltoall_base",
        c10d::OpType::ALLTOALL_BASE,
        {output},
        output,
        input,
        outputSplits,
        inputSplits,
        ms(opts.timeout));
  }

  WorkPtr alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override {
    return start("alltoall", c10d::OpType::ALLTOALL, outputs, outputs, inputs, ms(opts.timeout));
  }

  WorkPtr send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override {
    return start("send", c10d::OpType::SEND, tensors, tensors, dstRank, tag);
  }

  WorkPtr recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override {
    return start("recv", c10d::OpType::RECV, tensors, tensors, srcRank, tag);
  }

  WorkPtr recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return start("recv", c10d::OpType::RECVANYSOURCE, tensors, tensors, -1, tag);
  }

  WorkPtr barrier(const c10d::BarrierOptions& opts) override {
    return start("barrier", c10d::OpType::BARRIER, {}, ms(opts.timeout));
  }

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override {
    py::gil_scoped_acquire gil;
    check(adapter_.attr("monitored_barrier")(ms(opts.timeout), waitAllRanks));
  }

  void setSequenceNumberForGroup() override {}

  uint64_t getSequenceNumberForGroup() override {
    return seq_.load();
  }

  void shutdown() override {
    py::gil_scoped_acquire gil;
    check(adapter_.attr("shutdown")());
  }

  void abort() override {
    shutdown();
  }

 private:
  static int64_t ms(std::chrono::milliseconds timeout) {
    return timeout.count();  // -1: the group's own timeout
  }

  static int redop(const c10d::ReduceOp& op) {
    return static_cast<int>(op.op_);
  }

  static std::vector<at::Tensor> flat(const std::vector<std::vector<at::Tensor>>& lists) {
    std::vector<at::Tensor> out;
    for (const auto& l : lists) {
      out.insert(out.end(), l.begin(), l.end());
    }
    return out;
  }

  // The adapter's methods return None, or (kind, message) for an error raised at the call.
  static void check(const py::object& result) {
    if (result.is_none()) {
      return;
    }
    auto pair = result.cast<std::pair<int, std::string>>();
    throwKind(pair.first, pair.second);
  }

  template <typename... Args>
  WorkPtr start(const char* method, c10d::OpType type, std::vector<at::Tensor> outputs, Args&&... args) {
    auto work = c10::make_intrusive<AiodistWork>(rank_, type, std::move(outputs));
    if (type != c10d::OpType::SEND && type != c10d::OpType::RECV &&
        type != c10d::OpType::RECVANYSOURCE) {
      seq_.fetch_add(1);
    }
    py::gil_scoped_acquire gil;
    check(adapter_.attr(method)(work, std::forward<Args>(args)...));
    return work;
  }

  py::object adapter_;
  std::atomic<uint64_t> seq_{0};
};

}  // namespace aiodist_torch

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using aiodist_torch::AiodistBackend;
  using aiodist_torch::AiodistWork;
  py::module_::import("torch.distributed");  // registers c10d::Work and c10d::Backend with pybind

  py::class_<AiodistWork, c10d::Work, c10::intrusive_ptr<AiodistWork>>(m, "AiodistWork")
      .def(
          "_finish",
          &AiodistWork::finishOk,
          py::arg("source_rank") = -1,
          py::call_guard<py::gil_scoped_release>())
      .def("_fail", &AiodistWork::finishError, py::call_guard<py::gil_scoped_release>());

  py::class_<AiodistBackend, c10d::Backend, c10::intrusive_ptr<AiodistBackend>>(m, "AiodistBackend")
      .def(py::init<int, int, py::object>(), py::arg("rank"), py::arg("size"), py::arg("adapter"));

  m.def(
      "_close_completions",
      [](double seconds) { aiodist_torch::Completer::get().close(seconds); },
      py::arg("seconds"),
      py::call_guard<py::gil_scoped_release>());
}
